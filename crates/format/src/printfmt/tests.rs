use super::*;
use crate::format::Field;

fn fmt_with(fields: &[(&str, &str, usize, usize, bool)]) -> EventFormat {
    let mut f = crate::format::guest_formats().remove(0);
    f.fields = fields
        .iter()
        .map(|&(t, n, offset, size, signed)| Field {
            type_name: t.into(),
            name: n.into(),
            offset,
            size,
            signed,
        })
        .collect();
    f
}

fn run(fmt: &EventFormat, pf: &str, payload: &[u8]) -> String {
    let p = Program::compile(fmt, pf, 8).unwrap_or_else(|e| panic!("{pf}: {e}"));
    let mut s = String::new();
    p.run(&mut s, payload, &KernelSymbols::new()).unwrap();
    s
}

fn payload(vals: &[(usize, &[u8])]) -> Vec<u8> {
    let mut p = vec![0u8; 64];
    for (o, b) in vals {
        p[*o..*o + b.len()].copy_from_slice(b);
    }
    p
}

#[test]
fn conversions() {
    let f = fmt_with(&[
        ("int", "a", 8, 4, true),
        ("unsigned long", "b", 16, 8, false),
        ("char[8]", "s", 24, 8, false),
    ]);
    let p = payload(&[
        (8, &(-5i32).to_le_bytes()),
        (16, &0x7fc0_afc0_0000u64.to_le_bytes()),
        (24, b"abc\0"),
    ]);
    let pf = r#""%d %u %x %5d|%-5d|%05d %+d %.3d %ld %lld %hhd", REC->a, REC->a, REC->a, REC->a, REC->a, REC->a, REC->a, REC->a, REC->a, REC->a, REC->a"#;
    assert_eq!(
        run(&f, pf, &p),
        "-5 4294967291 fffffffb    -5|-5   |-0005 -5 -005 -5 -5 -5"
    );
    let pf = r#""%#016lx %lx %#x %p %s|%5s|%-5s|%.2s %c%%", REC->b, REC->b, 0, REC->b, REC->s, REC->s, REC->s, REC->s, 'x'"#;
    assert_eq!(
        run(&f, pf, &p),
        "0x007fc0afc00000 7fc0afc00000 0 0x7fc0afc00000 abc|  abc|abc  |ab x%"
    );
    assert_eq!(run(&f, r#""%p", 0"#, &p), "(nil)");
}

#[test]
fn expressions() {
    let f = fmt_with(&[
        ("int", "e", 8, 4, true),
        ("unsigned int", "r", 12, 4, false),
    ]);
    let p = payload(&[(8, &(-4i32).to_le_bytes()), (12, &2u32.to_le_bytes())]);
    let pf = r#""reason %s (%d)", REC->e < 0 ? (REC->e == -4 ? "restart" : "error") : __print_symbolic(REC->r, { 2, "KVM_EXIT_" "IO" }), REC->e < 0 ? -REC->e : REC->r"#;
    assert_eq!(run(&f, pf, &p), "reason restart (4)");
    let p2 = payload(&[(12, &2u32.to_le_bytes())]);
    assert_eq!(run(&f, pf, &p2), "reason KVM_EXIT_IO (2)");
    // Casts, unknown identifiers (0 in arithmetic), shifts, UL suffixes.
    let pf = r#""%lu %d %x %d", (unsigned long)(((struct page *)vmemmap_base) + (REC->r)), (int)(u8)REC->e, (( gfp_t)((((1UL))) << (10))|((((1UL))) << (11))), sizeof(u64)"#;
    assert_eq!(run(&f, pf, &p), "2 252 c00 8");
    // Symbolic: unknown names match nothing; flags: table order, rest in hex.
    let pf = r#""%s %s %s %s", __print_symbolic(REC->r, { MODE_X, "X" }), __print_flags(REC->r | 5, "|", { 1, "A" }, { 2, "B" }, { 1 << (UNKNOWN), "C" }), __print_flags(0, "|", { 0, "NONE" }), __print_flags(REC->r, "|", { 1, "A" })"#;
    assert_eq!(run(&f, pf, &p), "0x2 A|B|0x4  0x2");
}

#[test]
fn unsupported_and_hostile() {
    let f = fmt_with(&[("int", "a", 8, 4, true)]);
    for pf in [
        r#""%d""#,
        r#""%d", REC->a, REC->a"#,
        r#""%pU", REC->a"#,
        r#""%d", REC->nope"#,
        r#""%s", ({ 1; })"#,
        r#""%*d", REC->a"#,
        "\"%d\", REC->a +",
        "\"unterminated",
    ] {
        assert!(Program::compile(&f, pf, 8).is_err(), "{pf}");
    }
    let deep = format!("\"%d\", {}1{}", "(".repeat(5000), ")".repeat(5000));
    assert!(Program::compile(&f, &deep, 8).is_err());
    let p = Program::compile(&f, r#""x=%d y=%d", REC->a, 1 / REC->a"#, 8).unwrap();
    let mut s = String::from("keep");
    assert!(p.run(&mut s, &[0u8; 12], &KernelSymbols::new()).is_none());
    assert_eq!(s, "keep");
    assert!(p.run(&mut s, &[0u8; 10], &KernelSymbols::new()).is_none());
}

#[test]
fn symbols() {
    let f = fmt_with(&[("unsigned long", "ip", 8, 8, false)]);
    let mut k = KernelSymbols::new();
    k.parse_kallsyms(b"ffffffff81000000 T foo\nffffffff81000100 T bar\n");
    let p = Program::compile(&f, r#""%pS %ps %pS""#.replace("\"\"", "").as_str(), 8);
    assert!(p.is_err());
    let p = Program::compile(&f, r#""%pS %ps %pS", REC->ip, REC->ip, 5"#, 8).unwrap();
    let mut s = String::new();
    p.run(
        &mut s,
        &payload(&[(8, &0xffffffff81000010u64.to_le_bytes())]),
        &k,
    )
    .unwrap();
    assert_eq!(s, "foo+0x10 foo 0x5");
}

#[test]
fn timer_start_flags() {
    let f = fmt_with(&[("unsigned int", "flags", 8, 4, false)]);
    let pf = r#""cpu=%u idx=%u flags=%s", REC->flags & 0x0003FFFF, REC->flags >> 22, __print_flags(REC->flags & (0x00040000 | 0x00080000 | 0x00100000 | 0x00200000), "|", { 0x00040000, "M" }, { 0x00080000, "D" }, { 0x00100000, "P" }, { 0x00200000, "I" })"#;
    let v: u32 = 0x380000 | (54 << 22) | 1;
    assert_eq!(
        run(&f, pf, &payload(&[(8, &v.to_le_bytes())])),
        "cpu=1 idx=54 flags=D|P|I"
    );
}

/// libtraceevent's grouping, which trace-cmd prints: `x & (a | b | c | d)` is
/// `(x & a) | b | c | d` (timer_start's flags print `D|P|I` for flags with none of
/// those bits, as trace-cmd 3.1.6 prints them in tests/fixtures/kernel/kernel.txt).
#[test]
fn libtraceevent_grouping() {
    let f = fmt_with(&[("unsigned int", "flags", 8, 4, false)]);
    let pf = r#""flags=%s", __print_flags(REC->flags & (0x00040000 | 0x00080000 | 0x00100000 | 0x00200000), "|", { 0x00040000, "M" }, { 0x00080000, "D" }, { 0x00100000, "P" }, { 0x00200000, "I" })"#;
    let v: u32 = 0xD80_0001;
    assert_eq!(
        run(&f, pf, &payload(&[(8, &v.to_le_bytes())])),
        "flags=D|P|I"
    );
    // Equal operators group to the right; a looser one takes the whole.
    assert_eq!(
        run(
            &f,
            r#""%d %d %d", 10 - 4 - 3, 2 * 3 + 4, 1 + 2 * 3"#,
            &[0u8; 12]
        ),
        "9 10 7"
    );
    // `x != -1 ? a : b` is `(x != -1) ? a : b`.
    assert_eq!(
        run(&f, r#""%d", REC->flags != -1 ? 5 : 6"#, &[0u8; 12]),
        "5"
    );
}

#[test]
fn star_width_precision_and_array_elements() {
    let f = fmt_with(&[
        ("int", "n", 8, 4, true),
        ("__data_loc char[]", "name", 12, 4, false),
        ("unsigned long[3]", "args", 16, 24, false),
    ]);
    let mut p = payload(&[(8, &3i32.to_le_bytes()), (40, b"abcdef\0")]);
    p[12..16].copy_from_slice(&(40u32 | 7 << 16).to_le_bytes());
    for (i, v) in [7u64, 0xabc, u64::MAX].iter().enumerate() {
        p[16 + 8 * i..24 + 8 * i].copy_from_slice(&v.to_le_bytes());
    }
    let pf = r#""%.*s|%*d|%-*d|%lx %lx %lx", REC->n, __get_str(name), REC->n, 1, -3, 2, REC->args[0], REC->args[1], REC->args[2]"#;
    assert_eq!(run(&f, pf, &p), "abc|  1|2  |7 abc ffffffffffffffff");
    assert!(Program::compile(&f, r#""%lx", REC->args[3]"#, 8).is_err());
    assert!(Program::compile(&f, r#""%lx", REC->n[0]"#, 8).is_err());
}

#[test]
fn flexible_string_to_the_end_without_its_newline() {
    let f = fmt_with(&[("char[]", "buf", 8, 0, false)]);
    let mut p = b"xxxxxxxxhello\n".to_vec();
    assert_eq!(run(&f, r#""%s", REC->buf"#, &p), "hello");
    p.extend_from_slice(b"\0junk");
    assert_eq!(run(&f, r#""%s", REC->buf"#, &p), "hello");
    // Other strings keep their newline (escaped).
    let f = fmt_with(&[("char[8]", "s", 8, 8, false)]);
    assert_eq!(
        run(&f, r#""%s", REC->s"#, b"xxxxxxxxab\n\0\0\0\0\0"),
        "ab\\n"
    );
}

/// What trace-cmd printed for real inet_sock_set_state / fib / fib6 / tcp_probe events
/// (tests/fixtures/kernel/net.txt).
#[test]
fn network_addresses() {
    let f = fmt_with(&[
        ("__u8[4]", "a4", 8, 4, false),
        ("__u8[16]", "a6", 12, 16, false),
        ("__u8[28]", "sa", 28, 28, false),
    ]);
    let mut p = vec![0u8; 64];
    p[8..12].copy_from_slice(&[127, 0, 0, 1]);
    p[12..28].copy_from_slice(&[
        0, 0, 0, 0, 0xee, 0x30, 0, 0, 0x92, 2, 0, 0, 0x37, 0x13, 0, 0,
    ]);
    p[28..36].copy_from_slice(&[2, 0, 0xd4, 0x93, 127, 0, 0, 1]);
    let pf = r#""%pI4 %pI6c %pISpc %pI6", REC->a4, REC->a6, REC->sa, REC->a6"#;
    assert_eq!(
        run(&f, pf, &p),
        "127.0.0.1 ::ee30:0:9202:0:3713:0 127.0.0.1:54419 0000:0000:ee30:0000:9202:0000:3713:0000"
    );
    let cases: [(&[u8], &str); 4] = [
        (&[0; 16], "::"),
        (&[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1], "::1"),
        (
            &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127, 0, 0, 1],
            "::ffff:127.0.0.1",
        ),
        (
            &[0x20, 1, 0xd, 0xb8, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1],
            "2001:db8::1:0:0:1",
        ),
    ];
    for (b, want) in cases {
        p[12..28].copy_from_slice(b);
        assert_eq!(run(&f, r#""%pI6c", REC->a6"#, &p), want);
    }
    // sockaddr_in6 with the port.
    p[28..56].fill(0);
    p[28..32].copy_from_slice(&[10, 0, 0x1f, 0x90]);
    p[36 + 15] = 1;
    assert_eq!(run(&f, r#""%pISpc", REC->sa"#, &p), "[::1]:8080");
}

/// writeback's `__print_flags(REC->state, "|", {I_DIRTY_SYNC, ...}, ...)`: trace-cmd
/// prints `I_DIRTY_SYNC` for 0 (the first entry naming an unknown constant) and hex
/// for other values (net.txt).
#[test]
fn flags_of_zero_and_unknown_constants() {
    let f = fmt_with(&[("unsigned long", "state", 8, 8, false)]);
    let pf = r#""state=%s", __print_flags(REC->state, "|", {I_DIRTY_SYNC, "I_DIRTY_SYNC"}, {I_NEW, "I_NEW"})"#;
    assert_eq!(run(&f, pf, &payload(&[])), "state=I_DIRTY_SYNC");
    assert_eq!(
        run(&f, pf, &payload(&[(8, &0x70u64.to_le_bytes())])),
        "state=0x70"
    );
    let pf = r#""%s", __print_flags(REC->state, "|", {0, "NONE"}, {1, "A"})"#;
    assert_eq!(run(&f, pf, &payload(&[])), "");
    // `__builtin_expect(x, c)` is x.
    let pf = r#""%lx", __builtin_expect(!!(REC->state >= 5), 0) ? 1 : 2"#;
    assert_eq!(run(&f, pf, &payload(&[])), "2");
}

#[test]
fn get_sockaddr() {
    let f = fmt_with(&[("__data_loc __u8[]", "addr", 8, 4, false)]);
    let mut p = vec![0u8; 40];
    p[8..12].copy_from_slice(&(16u32 | 16 << 16).to_le_bytes());
    p[16..24].copy_from_slice(&[2, 0, 0, 80, 10, 0, 0, 7]);
    assert_eq!(
        run(&f, r#""%pISpc", __get_sockaddr(addr)"#, &p),
        "10.0.0.7:80"
    );
}

/// Text from a (hostile) trace file cannot end the line: string literals, table names,
/// delimiters and symbol names are escaped.
#[test]
fn file_text_is_escaped() {
    let f = fmt_with(&[("unsigned long", "v", 8, 8, false)]);
    let pf = "\"%s %s %s %s\", REC->v ? \"a\\nb\" : \"\", __print_symbolic(REC->v, { 3, \"x\\ny\" }), __print_flags(REC->v, \"\\n\", { 1, \"p\" }, { 2, \"q\" }), \"\\x\"";
    assert!(Program::compile(&f, pf, 8).is_err()); // `\x` is not an escape we take
    let pf = "\"%s %s %s %ps\", REC->v ? \"a\\nb\" : \"\", __print_symbolic(REC->v, { 3, \"x\\ty\" }), __print_flags(REC->v, \"\\n\", { 1, \"p\" }, { 2, \"q\" }), REC->v";
    let p = Program::compile(&f, pf, 8).unwrap();
    let mut k = KernelSymbols::new();
    k.parse_kallsyms(b"0000000000000001 T evil\x1b[2J\n");
    let mut s = String::new();
    p.run(&mut s, &payload(&[(8, &3u64.to_le_bytes())]), &k)
        .unwrap();
    assert_eq!(s, "a\\nb x\\ty p\\nq evil\\x1b[2J");
}
