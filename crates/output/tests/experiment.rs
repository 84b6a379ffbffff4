//! Scratch experiments (ignored): writes files to /tmp/hx for manual trace-cmd runs.
mod common;
use common::*;
use hyptrace_output::*;

#[test]
#[ignore]
fn gen() {
    let dir = std::path::Path::new("/tmp/hx");
    std::fs::create_dir_all(dir).unwrap();
    for (name, clock) in [
        ("tsc", Clock::guest_tsc(2_500_000).unwrap()),
        ("ns", Clock::nanoseconds()),
        (
            "tsc-off",
            Clock {
                name: "x86-tsc".into(),
                tsc: Some(TscConversion {
                    mult: 1 << 31,
                    shift: 30,
                    offset: 1000,
                }),
            },
        ),
        (
            "local-tsc",
            Clock {
                name: "local".into(),
                tsc: Some(TscConversion {
                    mult: 1 << 30,
                    shift: 29,
                    offset: 0,
                }),
            },
        ),
        (
            "tsc-off2",
            Clock {
                name: "x86-tsc".into(),
                tsc: Some(TscConversion {
                    mult: 1 << 30,
                    shift: 29,
                    offset: 1000,
                }),
            },
        ),
        (
            "local-off2",
            Clock {
                name: "local".into(),
                tsc: Some(TscConversion {
                    mult: 1 << 30,
                    shift: 29,
                    offset: 1000,
                }),
            },
        ),
    ] {
        let mut b0 = PageBuilder::new(4096);
        let mut b1 = PageBuilder::new(4096);
        b0.push(1_000_000_000, &marker(0, 1, 10));
        b1.push(1_000_000_000, &marker(1, 1, 11));
        b0.push(1_000_000_001, &span(0, 2, 5, 2500));
        b0.push(12_345_678_901_234, &text(0, 3, "hello \"world\""));
        b1.lose(7);
        b1.push(12_345_678_901_235, &marker(1, 2, 12));
        let mut pages = Vec::new();
        for (cpu, b) in [(0u32, b0), (1, b1)] {
            for (p, m) in b.finish() {
                pages.push((cpu, p, m));
            }
        }
        for (v, ver) in [("v6", TraceDatVersion::V6), ("v7", TraceDatVersion::V7)] {
            let mut meta = TraceMeta::guest(4096, 2, clock.clone());
            meta.cmdlines.insert(2, "averyveryverylongcommname".into());
            write_trace_dat(
                dir.join(format!("{name}-{v}.dat")),
                meta,
                ver,
                pages.iter().map(|(c, p, m)| (*c, p.as_slice(), *m)),
                &RunSummary::default(),
            )
            .unwrap();
        }
    }
}

#[test]
#[ignore]
fn names() {
    let dir = std::path::Path::new("/tmp/hx");
    std::fs::create_dir_all(dir).unwrap();
    let mut formats = Vec::new();
    let mut b0 = PageBuilder::new(4096);
    for (i, n) in [19usize, 20, 21, 22, 25].iter().enumerate() {
        let mut f = guest_formats()[0].clone();
        f.name = "e".repeat(*n);
        f.id = 2000 + i as u16;
        formats.push(f);
        let mut p = marker(0, i as u64, 1);
        p[..2].copy_from_slice(&(2000 + i as u16).to_le_bytes());
        p[4..8].copy_from_slice(&(123456 + i as i32).to_le_bytes());
        b0.push(1000 + i as u64, &p);
    }
    let mut meta = TraceMeta::guest(4096, 1200, Clock::nanoseconds());
    meta.formats = formats;
    let mut pages = Vec::new();
    for (p, m) in b0.finish() {
        pages.push((0u32, p.clone(), m));
        pages.push((1100u32, p, m));
    }
    write_trace_dat(
        dir.join("names.dat"),
        meta,
        TraceDatVersion::V6,
        pages.iter().map(|(c, p, m)| (*c, p.as_slice(), *m)),
        &RunSummary::default(),
    )
    .unwrap();
}

#[test]
#[ignore]
fn report() {
    for f in std::env::var("HX_FILES").unwrap().split(',') {
        let t = TraceFile::open(f).unwrap();
        print!("{}", t.report());
    }
}
