/* An example freestanding C guest for hyptrace: registers an event the host has never
 * seen (cguest:sample, four fields), emits `--events` of them per vCPU through the C SDK
 * (libhyptrace.a: the Rust writer), and exits through the VMM's result slot.
 *
 * Build (tests/c_guest.rs does this):
 *   gcc -ffreestanding -nostdlib -static -fno-pic -no-pie -O2 -mno-red-zone \
 *       -I guest/c-sdk/include -Wl,-T,guest/link.ld -Wl,--build-id=none \
 *       guest/examples/c/main.c libhyptrace.a -o c-guest.elf
 * Run:
 *   hyptrace run --guest c-guest.elf --events 1000 [--rate R]
 */
#include "hyptrace.h"

/* Entry (the VMM's contract, as the Rust payload's rt.rs): rdi = pack GPA, rsi = vCPU
 * id, rdx = run-parameter block GPA, rcx = MMIO doorbell page or 0 (ring by port), rsp =
 * top of this vCPU's stack: c_main's four arguments. */
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

/* The record: the 8-byte common header (the SDK puts the id in its first two bytes),
 * then the fields. */
struct sample {
    uint16_t common_type;
    uint8_t common_flags;
    uint8_t common_preempt_count;
    int32_t common_pid;
    uint64_t seq;
    uint32_t cpu;
    int32_t delta;
    char tag[16];
};

static const HtField sample_fields[] = {
    {"seq", "u64", 8, 8, false},
    {"cpu", "u32", 16, 4, false},
    {"delta", "s32", 20, 4, true},
    {"tag", "char[16]", 24, 16, true},
};

static HtEvent sample = {
    .system = "cguest",
    .name = "sample",
    .print_fmt = "\"seq=%llu cpu=%u delta=%d tag=%s\", REC->seq, REC->cpu, REC->delta, REC->tag",
    .fields = sample_fields,
    .nr_fields = sizeof(sample_fields) / sizeof(sample_fields[0]),
    .size = sizeof(struct sample),
    .slot = 5,
    .requested_id = 0,
};

static HtEvent *const events[] = {&sample};

void c_main(uint64_t pack, uint64_t cpu, uint64_t params_gpa, uint64_t doorbell)
{
    /* Rings the VMM where it said: by port (doorbell 0) or at its MMIO doorbell page. */
    HtWriter *w = ht_attach_doorbell(pack, (uint32_t)cpu, params_gpa, doorbell);
    if (!w)
        ht_panic("c guest: cannot attach the trace writer");
    HtRunParams p;
    if (!ht_read_params(params_gpa, &p))
        ht_panic("c guest: bad run parameter block");
    int r = cpu == 0 ? ht_register(w, events, 1)
                     : ht_wait_registered(w, events, 1, 1ull << 34);
    if (r < 0 && r != HT_ERR_NO_TABLE)
        ht_panic("c guest: registration failed");

    /* --rate: event i is due i periods after the start (absolute deadlines). */
    uint64_t start = ht_rdtsc();
    uint64_t period = p.rate ? p.tsc_khz * 1000 / p.rate : 0;
    for (uint64_t i = 0; i < p.events; i++) {
        if (period) {
            uint64_t due = start + i * period;
            while ((int64_t)(due - ht_rdtsc()) > 0)
                ht_idle(w);
        }
        struct sample s = {
            .common_pid = (int32_t)cpu + 1,
            .seq = i,
            .cpu = (uint32_t)cpu,
            .delta = (int32_t)(i % 7) - 3,
        };
        /* tag: "c<cpu>-<i % 1000>" */
        char *t = s.tag;
        *t++ = 'c';
        *t++ = (char)('0' + cpu % 10);
        *t++ = '-';
        uint32_t v = (uint32_t)(i % 1000);
        char digits[4];
        int n = 0;
        do {
            digits[n++] = (char)('0' + v % 10);
            v /= 10;
        } while (v);
        while (n)
            *t++ = digits[--n];
        ht_emit(w, &sample, ht_rdtsc(), &s, sizeof s);
    }
    ht_exit(w);
}
