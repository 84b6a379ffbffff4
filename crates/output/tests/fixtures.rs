//! Real kernel trace.dat fixtures (see fixtures/README.md): our reader against the
//! `trace-cmd report -t` output recorded with them, line for line.

use std::path::PathBuf;

use hyptrace_output::printfmt::{check_guest_format, GuestFormatError};
use hyptrace_output::*;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn check(file: &str) {
    let f = TraceFile::open(fixture(file)).unwrap();
    let expected = std::fs::read_to_string(fixture(&format!(
        "{}.report-t.txt",
        file.trim_end_matches(".dat")
    )))
    .unwrap();
    let ours = f.report();
    let exp: Vec<&str> = expected.lines().collect();
    let got: Vec<&str> = ours.lines().collect();
    assert_eq!(got.len(), exp.len(), "{file}: line count");
    // Line-identical, fields included (print fmts and the sched plugin's output).
    let differing: Vec<_> = got
        .iter()
        .zip(&exp)
        .enumerate()
        .filter(|(_, (g, e))| g != e)
        .collect();
    assert!(
        differing.is_empty(),
        "{file}: {} lines differ, first: {:?}",
        differing.len(),
        differing.first()
    );
}

#[test]
fn kernel_v6() {
    check("kernel-v6.dat");
}

#[test]
fn kernel_v7() {
    check("kernel-v7.dat");
}

#[test]
fn kernel_v7_zstd() {
    let f = TraceFile::open(fixture("kernel-v7-zstd.dat")).unwrap();
    assert_eq!(f.compression.as_ref().map(|c| c.0.as_str()), Some("zstd"));
    check("kernel-v7-zstd.dat");
}

#[test]
fn kernel_metadata() {
    let f = TraceFile::open(fixture("kernel-v6.dat")).unwrap();
    assert_eq!((f.version, f.page_size, f.nr_cpus), (6, 4096, 2));
    assert_eq!(f.clock.as_deref(), Some("local"));
    assert_eq!(f.event_count(), 340);
    let exec = f
        .formats
        .iter()
        .find(|x| x.name == "sched_process_exec")
        .unwrap();
    assert_eq!(exec.system, "sched");
    assert!(exec.field("filename").unwrap().is_data_loc());
    assert_eq!(f.cmdlines.get(&15).map(String::as_str), Some("rcu_preempt"));
    let stat = std::fs::read_to_string(fixture("kernel.stat.txt")).unwrap();
    assert!(stat.contains(&f.stat_text()), "{}", f.stat_text());
    let mut drops = Vec::new();
    let mut recs = f.records();
    while let Some(i) = recs.next_item() {
        if let TraceItem::Dropped {
            cpu,
            instance,
            missed,
        } = i
        {
            drops.push(TraceItem::Dropped {
                cpu,
                instance,
                missed,
            });
        }
    }
    assert!(recs.error().is_none());
    assert_eq!(
        drops,
        vec![
            TraceItem::Dropped {
                cpu: 0,
                instance: 0,
                missed: Missed::Count(81)
            },
            TraceItem::Dropped {
                cpu: 1,
                instance: 0,
                missed: Missed::Count(79)
            }
        ]
    );
}

/// The guest subset (G1, `printfmt::check_guest_format`) over every kernel format of the
/// fixtures: each format either passes or is refused for one of the subset's deliberate
/// exclusions (a `%pS`, a helper or identifier outside the whitelist, a division by a
/// field...), never because the parser trips on it; the plain kernel formats
/// (`sched_switch`, `sched_wakeup`, `irq_handler_entry`...) pass.
#[test]
fn guest_subset_over_the_kernel_fixtures() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/kernel");
    let mut passed = std::collections::BTreeSet::new();
    let mut refused = std::collections::BTreeMap::<String, usize>::new();
    for name in ["kernel-v6.dat", "kmem-v6.dat"] {
        let f = TraceFile::open(dir.join(name)).unwrap();
        for fmt in &f.formats {
            if Program::compile(fmt, &fmt.print_fmt, f.long_size).is_err() {
                continue; // the host prints these raw; not a guest's concern
            }
            match check_guest_format(fmt) {
                Ok(()) => {
                    passed.insert(format!("{}:{}", fmt.system, fmt.name));
                }
                Err(GuestFormatError::Parse(e)) => {
                    panic!("{}:{}: {e}: {}", fmt.system, fmt.name, fmt.print_fmt)
                }
                Err(e) => {
                    let k = e.to_string();
                    *refused.entry(k).or_default() += 1;
                }
            }
        }
    }
    eprintln!("passed {}: {passed:?}\nrefused: {refused:#?}", passed.len());
    for want in [
        "sched:sched_switch",
        "sched:sched_wakeup",
        "irq:irq_handler_entry",
    ] {
        assert!(passed.contains(want), "{want} refused");
    }
}
