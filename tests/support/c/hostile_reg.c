/* A freestanding C guest that registers hostile event descriptions (issue 26), one
 * class per run, chosen by `--rate` (the adversary's convention: the guest does not
 * pace itself). Every class registers `hreg:good` (seq, tag char[16], msg __data_loc
 * char[]) first, then the class's hostile entries; every vCPU writes `--events` records of every entry the host accepted
 * (hreg:good alone when it rejected the hostile ones) and exits. tests/hostile_reg.rs runs each class through `record` and the real
 * trace-cmd. Built by tests/support/cguest.rs. */
#include "hyptrace.h"

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

/* Classes (tests/hostile_reg.rs, `Class`). */
enum {
    C_CLEAN = 0,
    C_FMT_TRICKS = 1,
    C_ZERO_DIV = 2,
    C_HUGE_WIDTH = 3,
    C_STAR = 4,
    C_HEX_LEN = 5,
    C_FMT_ESCAPE = 6,
    C_NAME_ESCAPE = 7,
    C_STRINGS = 8,
    C_FIELDS = 9,
    C_FIELD_COUNT = 10,
    C_HELPERS = 11,
    C_SECOND_REG = 12,
    C_LYING_LOC = 13,
};

struct good {
    uint16_t common_type;
    uint8_t common_flags;
    uint8_t common_preempt_count;
    int32_t common_pid;
    uint64_t seq;
    char tag[16];
    uint32_t msg; /* __data_loc: offset | len << 16 */
    char str[60];
};

#define GOOD_FIXED 36

static const HtField good_fields[] = {
    {"seq", "u64", 8, 8, false},
    {"tag", "char[16]", 16, 16, true},
    {"msg", "__data_loc char[]", 32, 4, false},
};

#define NF(a) (sizeof(a) / sizeof((a)[0]))
#define EV(sys, nm, fmt, f, sz, sl) \
    {.system = sys, .name = nm, .print_fmt = fmt, .fields = f, .nr_fields = NF(f), \
     .size = sz, .slot = sl, .requested_id = 0, .handle = 0}

static HtEvent good = EV("hreg", "good",
    "\"seq=%llu tag=%s msg=%s\", REC->seq, REC->tag, __get_str(msg)",
    good_fields, GOOD_FIXED, 0);

/* Print fmt classes: the good event's fields under another name and format. */
#define BAD(nm, sl, fmt) EV("hreg", nm, fmt, good_fields, GOOD_FIXED, sl)

static HtEvent fmt_tricks[] = {
    BAD("pct_n", 1, "\"%n\", REC->seq"),
    BAD("str_of_int", 2, "\"%s\", REC->seq"),
    BAD("char_conv", 3, "\"%c%c\", REC->seq, REC->seq"),
    BAD("sym", 4, "\"%pS\", REC->seq"),
    BAD("mac", 5, "\"%pM\", REC->tag"),
    BAD("too_few", 6, "\"%llu %llu %s\", REC->seq"),
    BAD("not_a_field", 7, "\"%llu\", REC->nope"),
};
static HtEvent zero_div[] = {
    BAD("div0", 1, "\"%llu\", REC->seq / 0"),
    BAD("mod0", 2, "\"%llu\", REC->seq % 0"),
    BAD("div_field", 3, "\"%llu\", 100 / (REC->seq - REC->seq)"),
    BAD("div_minus1", 4, "\"%lld\", (long long)REC->seq / -1"),
    BAD("table_div0", 5, "\"%s\", __print_symbolic(REC->seq, { 1/0, \"x\" })"),
};
static HtEvent huge_width[] = {
    BAD("w9", 1, "\"%999999999d\", REC->seq"),
    BAD("p9", 2, "\"%.999999999s\", REC->tag"),
    BAD("w65", 3, "\"%65llu\", REC->seq"),
};
static HtEvent star[] = {
    BAD("star_w", 1, "\"%*d\", REC->seq, REC->seq"),
    BAD("star_p", 2, "\"%.*s\", REC->seq, REC->tag"),
};
static HtEvent hex_len[] = {
    BAD("hex_huge", 1, "\"%s\", __print_hex(REC->seq, 99999999)"),
    BAD("hex_field", 2, "\"%s\", __print_hex(REC->tag, REC->seq)"),
    BAD("hex_past", 3, "\"%s\", __print_hex_str(REC->tag, 17)"),
    BAD("array_huge", 4, "\"%s\", __print_array(REC->tag, 99999, 8)"),
};
static HtEvent fmt_escape[] = {
    BAD("nl", 1, "\"x\\n          <idle>-0     [003]     1.000000: hreg:good: seq=999\""),
    BAD("cr", 2, "\"x\\r\""),
    BAD("esc_e", 3, "\"x\\e[2J\""),
    BAD("esc_oct", 4, "\"x\\033[2J\""),
    BAD("esc_hex", 5, "\"x\\x1b[2J\""),
    BAD("sym_nl", 6, "\"%s\", __print_symbolic(REC->seq, { 0, \"a\\nb\" })"),
};
static HtEvent name_escape[] = {
    EV("hreg\n", "sys_nl", "\"%llu\", REC->seq", good_fields, GOOD_FIXED, 1),
    EV("hreg", "name\x1b[2J", "\"%llu\", REC->seq", good_fields, GOOD_FIXED, 2),
    EV("hreg", "dash-name", "\"%llu\", REC->seq", good_fields, GOOD_FIXED, 3),
};
static const HtField field_nl[] = {{"se\nq", "u64", 8, 8, false}};
static const HtField type_nl[] = {{"seq", "u64\n", 8, 8, false}};
static HtEvent name_escape_fields[] = {
    EV("hreg", "field_nl", "\"%llu\", REC->seq", field_nl, 16, 4),
    EV("hreg", "type_nl", "\"%llu\", REC->seq", type_nl, 16, 5),
};
static const HtField dup[] = {{"a", "u64", 8, 8, false}, {"a", "u32", 16, 4, false}};
static const HtField overlap[] = {{"a", "u64", 8, 8, false}, {"b", "u32", 12, 4, false}};
static const HtField past[] = {{"a", "u64", 8, 8, false}, {"b", "u64", 16, 8, false}};
static const HtField badsize[] = {{"a", "u64", 8, 4, false}};
static const HtField badtype[] = {{"a", "struct task_struct *", 8, 8, false}};
static HtEvent fields[] = {
    EV("hreg", "dup", "\"%llu\", REC->a", dup, 20, 1),
    EV("hreg", "overlap", "\"%llu\", REC->a", overlap, 16, 2),
    EV("hreg", "past", "\"%llu\", REC->a", past, 20, 3),
    EV("hreg", "badsize", "\"%llu\", REC->a", badsize, 16, 4),
    EV("hreg", "badtype", "\"%llu\", REC->a", badtype, 16, 5),
};
/* 40 one-byte fields: over the 32 per event. */
#define F(n) {"f" #n, "u8", 8 + n, 1, false}
static const HtField many[] = {
    F(0), F(1), F(2), F(3), F(4), F(5), F(6), F(7), F(8), F(9), F(10), F(11), F(12), F(13),
    F(14), F(15), F(16), F(17), F(18), F(19), F(20), F(21), F(22), F(23), F(24), F(25),
    F(26), F(27), F(28), F(29), F(30), F(31), F(32), F(33), F(34), F(35), F(36), F(37),
    F(38), F(39),
};
static HtEvent field_count[] = {
    EV("hreg", "many", "\"%u\", REC->f0", many, 48, 1),
};
static HtEvent helpers[] = {
    BAD("bitmask", 1, "\"%s\", __get_bitmask(msg)"),
    BAD("dynarray", 2, "\"%s\", __print_hex(__get_dynamic_array(msg), 99999)"),
    BAD("expect", 3, "\"%llu\", __builtin_expect(REC->seq, 1)"),
    BAD("func", 4, "\"%llu\", some_kernel_function(REC->seq)"),
    BAD("symbol", 5, "\"%llu\", jiffies"),
    BAD("stmt", 6, "\"%llu\", ({ REC->seq; })"),
};
static HtEvent second[] = {
    BAD("second", 1, "\"%llu\", REC->seq / 0"),
};

static void out32(uint16_t port, uint32_t v)
{
    __asm__ volatile("outl %0, %1" : : "a"(v), "Nd"(port));
}

static char *put(char *t, const char *s)
{
    while (*s)
        *t++ = *s++;
    return t;
}

/* The good record `i`: clean strings, or (C_STRINGS) strings holding newlines, ESC,
 * a carriage return and a line that looks like another CPU's event. */
static uint32_t fill(struct good *g, uint64_t i, int hostile)
{
    for (unsigned k = 0; k < sizeof g->tag; k++)
        g->tag[k] = 0;
    char *t = put(g->tag, hostile ? "t\n\x1b[2J\r" : "tag");
    *t = (char)('0' + i % 10);
    const char *m = hostile
        ? "m\n          <idle>-0     [007]     9.999999: hreg:good: seq=424242\x1b[31m"
        : "msg";
    char *e = put(g->str, m);
    *e++ = 0;
    uint32_t len = (uint32_t)(e - g->str);
    g->msg = (uint32_t)GOOD_FIXED | len << 16;
    return GOOD_FIXED + len;
}

/* C_LYING_LOC: even records' msg lies outside the record, odd ones' has no NUL (the
 * record ends with "m\x1b!"). */
static uint32_t lying(struct good *g, uint64_t i)
{
    fill(g, i, 0);
    if (i % 2 == 0) {
        g->msg = 0xfff0u | 40u << 16;
        return GOOD_FIXED + 4;
    }
    put(g->str, "m\x1b!");
    g->msg = (uint32_t)GOOD_FIXED | 3u << 16;
    return GOOD_FIXED + 3;
}

static HtEvent *table[64];

void c_main(uint64_t pack, uint64_t cpu, uint64_t params_gpa)
{
    HtWriter *w = ht_attach(pack, (uint32_t)cpu, params_gpa);
    if (!w)
        ht_panic("hostile_reg: cannot attach the trace writer");
    HtRunParams p;
    if (!ht_read_params(params_gpa, &p))
        ht_panic("hostile_reg: bad run parameter block");
    HtEvent *bad = 0;
    uint32_t nbad = 0;
    switch (p.rate) {
    case C_FMT_TRICKS: bad = fmt_tricks, nbad = NF(fmt_tricks); break;
    case C_ZERO_DIV: bad = zero_div, nbad = NF(zero_div); break;
    case C_HUGE_WIDTH: bad = huge_width, nbad = NF(huge_width); break;
    case C_STAR: bad = star, nbad = NF(star); break;
    case C_HEX_LEN: bad = hex_len, nbad = NF(hex_len); break;
    case C_FMT_ESCAPE: bad = fmt_escape, nbad = NF(fmt_escape); break;
    case C_NAME_ESCAPE: bad = name_escape, nbad = NF(name_escape); break;
    case C_FIELDS: bad = fields, nbad = NF(fields); break;
    case C_FIELD_COUNT: bad = field_count, nbad = NF(field_count); break;
    case C_HELPERS: bad = helpers, nbad = NF(helpers); break;
    default: break;
    }
    uint32_t n = 0;
    table[n++] = &good;
    for (uint32_t k = 0; k < nbad; k++)
        table[n++] = &bad[k];
    if (p.rate == C_NAME_ESCAPE)
        for (uint32_t k = 0; k < NF(name_escape_fields); k++)
            table[n++] = &name_escape_fields[k];
    int r = cpu == 0 ? ht_register(w, table, n) : ht_wait_registered(w, table, n, 1ull << 34);
    if (r < 1)
        ht_panic("hostile_reg: the host did not accept the good event");
    if (p.rate == C_SECOND_REG && cpu == 0) {
        /* The SDK refuses a second table; then the exit itself, again. */
        HtEvent *again[] = {&second[0]};
        if (ht_register(w, again, 1) != HT_ERR_ALREADY_REGISTERED)
            ht_panic("hostile_reg: the SDK took a second registration");
        out32(0x512, 0);
    }
    struct good g = {.common_pid = (int32_t)cpu + 1};
    for (uint64_t i = 0; i < p.events; i++) {
        g.seq = i;
        uint32_t len = p.rate == C_LYING_LOC ? lying(&g, i) : fill(&g, i, p.rate == C_STRINGS);
        /* Every accepted entry gets a record (the good one's bytes): a hostile entry
         * a host let through shows in the outputs (the test fails on it). */
        for (uint32_t k = 0; k < n; k++)
            if (ht_event_id(table[k]) != -1)
                ht_emit(w, table[k], ht_rdtsc(), &g, len);
    }
    ht_exit(w);
}
