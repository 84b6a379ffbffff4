/* A freestanding C guest whose vCPU 0 registers its events late (issue 23): it spins
 * START_UP_MS of TSC (start-up work: a busy loop, no exit per iteration) after attaching
 * and before `ht_register`, while the other vCPUs, attached, wait for the answer (the
 * SDK protocol). Then every vCPU writes `--events` of `late:tick` (seq, cpu) and exits.
 * Built by tests/support/cguest.rs, run by tests/c_guest.rs. */
#include "hyptrace.h"

#define START_UP_MS 1000

__asm__(
    ".section .text.entry,\"ax\",@progbits\n"
    ".global _start\n"
    "_start:\n"
    "    and $-16, %rsp\n"
    "    xor %ebp, %ebp\n"
    "    call c_main\n"
    "1:  pause\n"
    "    jmp 1b\n"
    ".previous\n");

struct tick {
    uint16_t common_type;
    uint8_t common_flags;
    uint8_t common_preempt_count;
    int32_t common_pid;
    uint64_t seq;
    uint32_t cpu;
    uint32_t pad;
};

static const HtField tick_fields[] = {
    {"seq", "u64", 8, 8, false},
    {"cpu", "u32", 16, 4, false},
};

static HtEvent tick = {
    .system = "late",
    .name = "tick",
    .print_fmt = "\"seq=%llu cpu=%u\", REC->seq, REC->cpu",
    .fields = tick_fields,
    .nr_fields = sizeof(tick_fields) / sizeof(tick_fields[0]),
    .size = sizeof(struct tick),
    .slot = 3,
    .requested_id = 0,
};

static HtEvent *const events[] = {&tick};

void c_main(uint64_t pack, uint64_t cpu, uint64_t params_gpa)
{
    HtWriter *w = ht_attach(pack, (uint32_t)cpu, params_gpa);
    if (!w)
        ht_panic("late guest: cannot attach the trace writer");
    HtRunParams p;
    if (!ht_read_params(params_gpa, &p) || p.tsc_khz == 0)
        ht_panic("late guest: bad run parameter block");
    int r;
    if (cpu == 0) {
        uint64_t until = ht_rdtsc() + p.tsc_khz * START_UP_MS;
        while ((int64_t)(until - ht_rdtsc()) > 0)
            __asm__ volatile("pause");
        r = ht_register(w, events, 1);
    } else {
        r = ht_wait_registered(w, events, 1, 1ull << 40);
    }
    if (r != 1)
        ht_panic("late guest: registration failed");
    for (uint64_t i = 0; i < p.events; i++) {
        struct tick t = {
            .common_pid = (int32_t)cpu + 1,
            .seq = i,
            .cpu = (uint32_t)cpu,
        };
        ht_emit(w, &tick, ht_rdtsc(), &t, sizeof t);
    }
    ht_exit(w);
}
