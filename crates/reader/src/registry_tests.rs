//! Unit tests of the registration validator: tables built byte by byte (so every field
//! can be hostile), each bad entry rejected alone with its reason, the others accepted.
use super::*;
use hyptrace_abi::registry::{STATE_EMPTY, STATUS_PENDING};
use zerocopy::IntoBytes;

/// A raw entry: every number as the guest would write it.
#[derive(Clone)]
struct Raw {
    system: &'static str,
    name: &'static str,
    fmt: &'static str,
    fields: Vec<(&'static str, &'static str, u32, u32, u32)>,
    size: u32,
    slot: u32,
    req: u32,
}

fn ev(name: &'static str, slot: u32) -> Raw {
    Raw {
        system: "sys",
        name,
        fmt: "\"a=%llu b=%d\", REC->a, REC->b",
        fields: vec![("a", "u64", 8, 8, 0), ("b", "int", 16, 4, 1)],
        size: 20,
        slot,
        req: 0,
    }
}

/// Builds a READY table from `evs`; `patch` may then change any entry's raw words.
fn table(evs: &[Raw], patch: impl FnOnce(&mut Vec<EventEntry>, &mut Vec<FieldEntry>)) -> Vec<u8> {
    let mut strings = Vec::new();
    let mut put = |s: &str| {
        let r = StrRef {
            off: strings.len() as u32,
            len: s.len() as u32,
        };
        strings.extend_from_slice(s.as_bytes());
        r
    };
    let mut entries = Vec::new();
    let mut fields = Vec::new();
    for e in evs {
        let first = fields.len() as u32;
        for &(n, t, offset, size, signed) in &e.fields {
            fields.push(FieldEntry {
                name: put(n),
                ctype: put(t),
                offset,
                size,
                signed,
                reserved: 0,
            });
        }
        entries.push(EventEntry {
            system: put(e.system),
            name: put(e.name),
            print_fmt: put(e.fmt),
            first_field: first,
            nr_fields: e.fields.len() as u32,
            size: e.size,
            slot: e.slot,
            requested_id: e.req,
            ..EventEntry::default()
        });
    }
    patch(&mut entries, &mut fields);
    let entries_off = HEADER_SIZE;
    let fields_off = entries_off + entries.len() * ENTRY_SIZE;
    let strings_off = fields_off + fields.len() * FIELD_SIZE;
    let h = TableHeader {
        magic: TABLE_MAGIC,
        state: STATE_READY,
        version: TABLE_VERSION,
        header_size: HEADER_SIZE as u32,
        entry_size: ENTRY_SIZE as u32,
        field_size: FIELD_SIZE as u32,
        nr_events: entries.len() as u32,
        nr_fields: fields.len() as u32,
        entries_off: entries_off as u32,
        fields_off: fields_off as u32,
        strings_off: strings_off as u32,
        strings_size: strings.len() as u32,
        accepted: 0,
        reserved: 0,
    };
    let mut b = h.as_bytes().to_vec();
    for e in &entries {
        b.extend_from_slice(e.as_bytes());
    }
    for f in &fields {
        b.extend_from_slice(f.as_bytes());
    }
    b.extend_from_slice(&strings);
    b.resize(b.len().next_multiple_of(64) + 64, 0);
    b
}

fn reasons(r: &Registry) -> Vec<(u32, String)> {
    r.rejected
        .iter()
        .map(|x| (x.index, x.to_string()))
        .collect()
}

fn accepted(r: &Registry) -> Vec<String> {
    r.events.iter().map(Registration::full_name).collect()
}

#[test]
fn valid_table_is_accepted_with_requested_and_dynamic_ids() {
    let mut a = ev("a", 0);
    a.req = 1000;
    let b = ev("b", 1);
    let mut c = ev("c", 5);
    c.req = 1000; // taken by a: gets a dynamic id
    let r = parse_table(&table(&[a, b, c], |_, _| {})).unwrap();
    assert!(r.rejected.is_empty(), "{:?}", reasons(&r));
    let ids: Vec<(String, u16, u32)> = r
        .events
        .iter()
        .map(|e| (e.full_name(), e.id, e.slot))
        .collect();
    assert_eq!(
        ids,
        [
            ("sys:a".into(), 1000, 0),
            ("sys:b".into(), FIRST_DYNAMIC_ID, 1),
            ("sys:c".into(), FIRST_DYNAMIC_ID + 1, 5)
        ]
    );
    assert_eq!(r.events[0].fields[1].ctype, "int");
    assert!(r.events[0].fields[1].signed);
    assert_eq!(
        r.result_word(0),
        EventEntry::result_word(1000, STATUS_ACCEPTED)
    );
}

/// Ids of the host's own events (the host kernel's, `--host-trace`, and the VMM's) are
/// not granted to a guest that requests them: it gets a dynamic id.
#[test]
fn host_id_ranges_are_not_granted() {
    let mut a = ev("a", 0);
    a.req = u32::from(hyptrace_abi::registry::FIRST_HOST_KERNEL_ID);
    let mut b = ev("b", 1);
    b.req = u32::from(hyptrace_abi::registry::FIRST_VMM_ID) - 1;
    let mut c = ev("c", 2);
    c.req = u32::from(hyptrace_abi::registry::FIRST_VMM_ID);
    let mut d = ev("d", 3);
    d.req = u32::from(hyptrace_abi::registry::FIRST_HOST_KERNEL_ID) - 1;
    let r = parse_table(&table(&[a, b, c, d], |_, _| {})).unwrap();
    let ids: Vec<u16> = r.events.iter().map(|e| e.id).collect();
    assert_eq!(
        ids,
        [
            FIRST_DYNAMIC_ID,
            FIRST_DYNAMIC_ID + 1,
            FIRST_DYNAMIC_ID + 2,
            hyptrace_abi::registry::FIRST_HOST_KERNEL_ID - 1
        ]
    );
}

/// Every kind of bad entry, each next to valid ones: each is rejected alone, naming
/// the entry and the reason; the valid ones are accepted.
#[test]
fn malformed_entries_are_rejected_one_by_one() {
    let good0 = ev("good0", 0);
    let mut overlap = ev("overlap", 1);
    overlap.fields[1].2 = 12; // b at 12..16 overlaps a at 8..16
    let mut badsize = ev("badsize", 2);
    badsize.fields[1].3 = 8; // int is 4 bytes
    let mut badsign = ev("badsign", 3);
    badsign.fields[0].4 = 1; // u64 is unsigned
    let mut outside = ev("outside", 4);
    outside.fields[1].2 = 18; // 18..22 > size 20
    let mut header = ev("header", 5);
    header.fields[0].2 = 4; // inside the common header
    let mut unknown = ev("unknown", 6);
    unknown.fields[0].1 = "struct foo";
    let slot64 = ev("slot64", 64);
    let dupslot = ev("dupslot", 0);
    let dupname = ev("good0", 9);
    let mut dupfield = ev("dupfield", 10);
    dupfield.fields[1].0 = "a";
    let mut badname = ev("bad-name", 11);
    badname.system = "sys";
    let mut bigrec = ev("bigrec", 12);
    bigrec.size = MAX_RECORD as u32 + 1;
    let mut smallrec = ev("smallrec", 13);
    smallrec.size = 4;
    smallrec.fields.clear();
    let mut badfmt = ev("badfmt", 14);
    badfmt.fmt = "no quotes";
    let mut common = ev("common", 15);
    common.fields[0].0 = "common_pid";
    let mut badreq = ev("badreq", 16);
    badreq.req = 70000;
    let mut arr = ev("arr", 17);
    arr.fields = vec![("s", "char[16]", 8, 16, 1), ("d", DATA_LOC_STR, 24, 4, 0)];
    arr.size = 28;
    arr.fmt = "\"s=%s d=%s\", REC->s, __get_str(d)";
    let mut badarr = ev("badarr", 18);
    badarr.fields = vec![("s", "char[16]", 8, 15, 1)];
    let good1 = ev("good1", 63);
    let mut reserved = ev("trailing_lost", 20);
    reserved.system = "hyptrace";
    let evs = [
        good0, overlap, badsize, badsign, outside, header, unknown, slot64, dupslot, dupname,
        dupfield, badname, bigrec, smallrec, badfmt, common, badreq, arr, badarr, good1, reserved,
    ];
    let r = parse_table(&table(&evs, |_, _| {})).unwrap();
    assert_eq!(accepted(&r), ["sys:good0", "sys:arr", "sys:good1"]);
    let want: &[(u32, &str)] = &[
        (1, "event 1 (sys:overlap) rejected: field 1 (b): bytes 12..16 overlap field 0 (a)"),
        (2, "event 2 (sys:badsize) rejected: field 1 (b): size 8 does not match int (4 bytes)"),
        (3, "event 3 (sys:badsign) rejected: field 0 (a): signed 1 does not match u64 (0)"),
        (4, "event 4 (sys:outside) rejected: field 1 (b): bytes 18..22 lie outside the record's fields (8..20)"),
        (5, "event 5 (sys:header) rejected: field 0 (a): bytes 4..12 lie outside the record's fields (8..20)"),
        (6, "event 6 (sys:unknown) rejected: field 0 (a): unknown C type \"struct foo\""),
        (7, "event 7 (sys:slot64) rejected: enable bit 64 is out of range (0..64)"),
        (8, "event 8 (sys:dupslot) rejected: enable bit 0 is already used by event 0"),
        (9, "event 9 (sys:good0) rejected: sys:good0 is already registered by event 0"),
        (10, "event 10 (sys:dupfield) rejected: field 1 (a): same name as field 0"),
        (11, "event 11 (?) rejected: name \"bad-name\" is not an identifier ([A-Za-z_][A-Za-z0-9_]*)"),
        (12, "event 12 (sys:bigrec) rejected: record size 4097 is not in 8..=4096"),
        (13, "event 13 (sys:smallrec) rejected: record size 4 is not in 8..=4096"),
        (14, "event 14 (sys:badfmt) rejected: print fmt does not start with a quoted format string"),
        (15, "event 15 (sys:common) rejected: field 0 (common_pid): names starting with common_ are the common header's"),
        (16, "event 16 (sys:badreq) rejected: requested id 70000 is not a 16-bit id"),
        (18, "event 18 (sys:badarr) rejected: field 0 (s): size 15 does not match char[16] (16 bytes)"),
        (20, "event 20 (hyptrace:trailing_lost) rejected: system hyptrace is reserved for the VMM's own events"),
    ];
    let got = reasons(&r);
    for (w, g) in want.iter().zip(&got) {
        assert_eq!((w.0, w.1), (g.0, g.1.as_str()));
    }
    assert_eq!(got.len(), want.len(), "{got:#?}");
    // The guest reads back: accepted entries their ids, the others REJECTED.
    assert_eq!(
        EventEntry::split_result(r.result_word(1)).1,
        STATUS_REJECTED
    );
    assert_eq!(
        EventEntry::split_result(r.result_word(17)).1,
        STATUS_ACCEPTED
    );
}

#[test]
fn strings_and_field_ranges_outside_the_table_are_rejected() {
    let evs = [ev("a", 0), ev("b", 1), ev("c", 2), ev("d", 3), ev("e", 4)];
    let r = parse_table(&table(&evs, |e, f| {
        e[0].name.off = 1 << 20; // name outside the string area
        e[1].print_fmt.len = u32::MAX; // off + len overflows
        e[2].first_field = 9; // fields 9..11 of 10
        e[3].nr_fields = MAX_FIELDS_PER_EVENT as u32 + 1;
        f[8].ctype.off = u32::MAX; // event e's first field's type
    }))
    .unwrap();
    assert!(r.events.is_empty(), "{:?}", accepted(&r));
    let got = reasons(&r);
    assert_eq!(got.len(), 5, "{got:#?}");
    assert!(
        got[0].1.contains("event 0 (?)") && got[0].1.contains("outside the"),
        "{got:?}"
    );
    assert!(got[1].1.contains("print fmt length 4294967295"), "{got:?}");
    assert!(
        got[2]
            .1
            .contains("fields 9..+2 lie outside the table's 10 field entries"),
        "{got:?}"
    );
    assert!(
        got[3].1.contains("33 fields is over the limit of 32"),
        "{got:?}"
    );
    assert!(
        got[4].1.contains("field 0 (a): C type") && got[4].1.contains("outside"),
        "{got:?}"
    );
}

#[test]
fn too_many_events_rejects_the_excess_with_one_message() {
    let evs: Vec<Raw> = (0..MAX_EVENTS as u32 + 6)
        .map(|i| {
            let mut e = ev("x", i % 64);
            e.name = Box::leak(format!("e{i}").into_boxed_str());
            e
        })
        .collect();
    let r = parse_table(&table(&evs, |_, _| {})).unwrap();
    assert_eq!(r.events.len(), MAX_EVENTS);
    assert_eq!(r.nr_entries, MAX_EVENTS as u32);
    assert_eq!(
        reasons(&r),
        [(
            64,
            "event 64 (?) rejected: this entry and the 5 after it: more than 64 events".into()
        )]
    );
}

#[test]
fn bad_headers_refuse_the_table() {
    let good = table(&[ev("a", 0)], |_, _| {});
    let patched = |off: usize, v: u32| {
        let mut b = good.clone();
        b[off..off + 4].copy_from_slice(&v.to_le_bytes());
        b
    };
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (good[..40].to_vec(), "shorter than the header"),
        (patched(0, 0), "bad magic"),
        (patched(8, STATE_EMPTY as u32), "not ready"),
        (patched(16, 2), "version 2"),
        (patched(24, 32), "entry/field sizes"),
        (patched(32, u32::MAX), "entries (64 x 64 bytes"),
        (patched(36, MAX_FIELDS as u32 + 1), "1025 fields"),
        (patched(40, 4), "not 8-aligned"),
        (patched(40, 0), "inside the"),
        (patched(48, u32::MAX), "strings"),
        (patched(52, u32::MAX), "strings"),
        (vec![0u8; MAX_TABLE_SIZE + 64], "over the"),
    ];
    for (bytes, want) in cases {
        let e = parse_table(&bytes).unwrap_err().to_string();
        assert!(e.contains(want), "{e:?} should contain {want:?}");
    }
    assert!(parse_table(&good).is_ok());
}

/// The host's answer in shared memory is what the guest writer reads back.
#[test]
fn answer_round_trip_with_the_writer() {
    use hyptrace_abi::layout::Mode;
    use hyptrace_abi::registry::DEFAULT_TABLE_SIZE;
    use hyptrace_abi::HeapMem;
    use hyptrace_writer::events::{read_answer, write_table, Event, Field};
    static F: &[Field<'static>] = &[Field {
        name: "v",
        ctype: "u64",
        offset: 8,
        size: 8,
        signed: false,
    }];
    static BAD: &[Field<'static>] = &[Field {
        name: "v",
        ctype: "u64",
        offset: 8,
        size: 4,
        signed: false,
    }];
    static A: Event<'static> = Event::new("s", "a", F, "\"%llu\", REC->v", 16, 0, 1000);
    static B: Event<'static> = Event::new("s", "b", BAD, "\"%llu\", REC->v", 16, 1, 0);
    static C: Event<'static> = Event::new("s", "c", F, "\"%llu\", REC->v", 16, 2, 0);
    let l = RingGeometry::new(1, 3, 4096, Mode::Stop, false)
        .unwrap()
        .with_events(DEFAULT_TABLE_SIZE)
        .unwrap();
    let m = HeapMem::new(l.region_size);
    l.init_region(&m, 0, 1);
    assert_eq!(read_table(&m, &l), Err(TableError::NotReady(STATE_EMPTY)));
    let evs = [&A, &B, &C];
    write_table(&m, &evs).unwrap();
    let reg = read_table(&m, &l).unwrap().unwrap();
    assert_eq!(accepted(&reg), ["s:a", "s:c"]);
    assert_eq!(reg.rejected.len(), 1);
    assert_eq!(EventEntry::split_result(B.result()).1, STATUS_PENDING);
    answer(&m, &l, &reg);
    assert_eq!(read_answer(&m, &evs), Ok(2));
    assert_eq!(
        (A.id(), B.id(), C.id()),
        (Some(1000), None, Some(FIRST_DYNAMIC_ID))
    );
}

/// An entry with integer, char array and `__data_loc` string fields and print fmt `fmt`.
fn rich(name: &'static str, slot: u32, fmt: &'static str) -> Raw {
    Raw {
        system: "sys",
        name,
        fmt,
        fields: vec![
            ("a", "u64", 8, 8, 0),
            ("b", "int", 16, 4, 1),
            ("s", "char[16]", 20, 16, 1),
            ("d", DATA_LOC_STR, 36, 4, 0),
        ],
        size: 40,
        slot,
        req: 0,
    }
}

/// Print fmts the guests in the tree register (guest/src, guest/examples/c,
/// tests/support/c) and the subset's other forms are accepted (G1).
#[test]
fn legitimate_print_fmts_are_accepted() {
    let fmts: &[&'static str] = &[
        "\"a=%llu b=%d\", REC->a, REC->b",
        "\"seq=%llu msg=%s\", REC->a, __get_str(d)",
        "\"seq=%llu cpu=%u delta=%d tag=%s\", REC->a, REC->b, REC->b, REC->s",
        "\"%-20s|%08llx|%.4s|%64d\", REC->s, REC->a, \"abcdef\", REC->b",
        "\"q=\\\"%llu\\\" \\\\ 100%%\", REC->a / 1000 % 7",
        "\"%d %llu\", REC->b ? (int)REC->a : -1, (REC->a >> 3) & 0xff",
        "\"%s %s\", __print_symbolic(REC->b, { 0, \"zero\" }, { 1, \"one\" }), __print_flags(REC->a, \"|\", { 1, \"A\" }, { 2, \"B\" })",
        "\"%s %s %s\", __print_hex(REC->s, 16), __print_hex_str(REC->s, 4), __print_array(REC->s, 4, 4)",
        "\"%p %lu %d\", REC->a, sizeof(u64), REC->common_pid",
    ];
    let evs: Vec<Raw> = fmts
        .iter()
        .enumerate()
        .map(|(i, f)| rich("ok", i as u32, f))
        .enumerate()
        .map(|(i, mut r)| {
            r.name = ["a", "b", "c", "d", "e", "f", "g", "h", "i"][i];
            r
        })
        .collect();
    let r = parse_table(&table(&evs, |_, _| {})).unwrap();
    assert!(r.rejected.is_empty(), "{:#?}", reasons(&r));
    assert_eq!(r.events.len(), fmts.len());
}

/// Each hostile print fmt (measured to crash, hang or fool trace-cmd 3.1.6, or in a
/// class that could) is rejected alone with its reason; the good entry next to them
/// is accepted.
#[test]
fn hostile_print_fmts_are_rejected_with_their_reason() {
    let cases: &[(&'static str, &str)] = &[
        (
            "\"%llu\", REC->a / 0",
            "divides by something other than a literal",
        ),
        ("\"%llu\", REC->a % 0", "divides by"),
        ("\"%llu\", REC->a / REC->b", "divides by"),
        ("\"%lld\", REC->a / -1", "divides by"),
        (
            "\"%s\", __print_symbolic(REC->a, { 1/0, \"x\" })",
            "divides by",
        ),
        ("\"%999999999d\", REC->b", "does not parse"),
        ("\"%65d\", REC->b", "width or precision of 65"),
        ("\"%.100s\", REC->s", "width or precision of 100"),
        ("\"%*d\", REC->b, REC->b", "`*` width"),
        ("\"%.*s\", REC->b, REC->s", "`*` width"),
        ("\"%s\", __print_hex(REC->a, 99999999)", "fixed array field"),
        (
            "\"%s\", __print_hex(REC->s, 17)",
            "reads 17 bytes of a 16-byte field",
        ),
        ("\"%s\", __print_hex(REC->s, REC->b)", "literal length"),
        ("\"%s\", __print_array(REC->s, 5, 4)", "reads 20 bytes"),
        ("\"%s\", __print_array(REC->s, 2, 3)", "element size"),
        ("\"x\\n<idle>-0 [001] 1.0: forged\"", "escape \\n"),
        ("\"x\\r\"", "escape \\r"),
        ("\"x\\e[2J\"", "escape \\e"),
        ("\"x\\033[2J\"", "escape \\0"),
        ("\"x\\x1b\"", "escape \\x"),
        ("\"x\\t\"", "escape \\t"),
        ("\"%c\", REC->b", "conversion %c"),
        ("\"%c\", '\\n'", "character literal"),
        ("\"%pS\", REC->a", "conversion %pS"),
        ("\"%pM\", REC->s", "conversion %pI/%pM"),
        ("\"%n\", REC->a", "does not parse"),
        ("\"%s\", REC->a", "a %s argument"),
        ("\"%d\", REC->s", "integer conversion's argument"),
        ("\"%llu\", REC->nope", "REC-> names no field"),
        ("\"%s\", __get_str(nope)", "__get_str names no field"),
        ("\"%s\", __get_str(s)", "a %s argument"),
        (
            "\"%llu\", some_kernel_symbol",
            "uses \"some_kernel_symbol\"",
        ),
        ("\"%s\", __get_bitmask(d)", "uses \"__get_bitmask\""),
        (
            "\"%llu\", __builtin_expect(REC->a, 1)",
            "uses \"__builtin_expect\"",
        ),
        (
            "\"%s\", __print_symbolic(REC->a, { 1, \"\\n\" })",
            "escape \\n",
        ),
        ("\"%d %d\", REC->b", "does not parse"),
        ("\"%d\", REC->b, REC->b", "does not parse"),
    ];
    let names = [
        "h00", "h01", "h02", "h03", "h04", "h05", "h06", "h07", "h08", "h09", "h10", "h11", "h12",
        "h13", "h14", "h15", "h16", "h17", "h18", "h19", "h20", "h21", "h22", "h23", "h24", "h25",
        "h26", "h27", "h28", "h29", "h30", "h31", "h32", "h33", "h34", "h35", "h36", "h37",
    ];
    assert!(cases.len() < names.len() && cases.len() < 63);
    let mut evs: Vec<Raw> = cases
        .iter()
        .enumerate()
        .map(|(i, (f, _))| rich(names[i], i as u32, f))
        .collect();
    evs.push(rich("good", 63, "\"a=%llu s=%s\", REC->a, REC->s"));
    let r = parse_table(&table(&evs, |_, _| {})).unwrap();
    assert_eq!(accepted(&r), ["sys:good"]);
    let got = reasons(&r);
    assert_eq!(got.len(), cases.len(), "{got:#?}");
    for ((i, reason), (fmt, want)) in got.iter().zip(cases) {
        assert!(
            reason.starts_with(&format!(
                "event {i} (sys:{}) rejected: print fmt",
                names[*i as usize]
            )) && reason.contains(want),
            "{fmt}: {reason} (want {want:?})"
        );
    }
}
