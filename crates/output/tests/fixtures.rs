//! Real kernel trace.dat fixtures (see fixtures/README.md): our reader against the
//! `trace-cmd report -t` output recorded with them.

use std::path::PathBuf;

use hyptrace_output::*;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// Events trace-cmd prints through a plugin instead of their print fmt.
const PLUGIN_EVENTS: &[&str] = &["sched_switch", "sched_wakeup", "sched_wakeup_new"];

/// Splits a report line into (cpu, timestamp, event name, fields).
fn split(line: &str) -> Option<(String, String, String, String)> {
    let open = line.find(" [")?;
    let close = open + line[open..].find("] ")?;
    let cpu = line[open + 2..close].to_string();
    let rest = &line[close + 2..];
    let (ts, rest) = rest.trim_start().split_once(": ")?;
    let (name, fields) = rest.split_once(':')?;
    Some((
        cpu,
        ts.to_string(),
        name.to_string(),
        fields.split_whitespace().collect::<Vec<_>>().join(" "),
    ))
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
    assert_eq!(got[0], exp[0]);
    let mut compared_fields = 0;
    for (i, (g, e)) in got.iter().zip(&exp).enumerate().skip(1) {
        if e.starts_with("CPU:") {
            assert_eq!(g, e, "{file}:{i}");
            continue;
        }
        let (gc, gt, gn, gf) = split(g).unwrap_or_else(|| panic!("{file}:{i}: {g}"));
        let (ec, et, en, ef) = split(e).unwrap_or_else(|| panic!("{file}:{i}: {e}"));
        assert_eq!((&gc, &gt, &gn), (&ec, &et, &en), "{file}:{i}");
        // Same comm-pid column too.
        assert_eq!(
            g.split(" [").next().unwrap().trim(),
            e.split(" [").next().unwrap().trim(),
            "{file}:{i}"
        );
        let id = f.formats.iter().find(|x| x.name == gn).unwrap().id;
        if !PLUGIN_EVENTS.contains(&gn.as_str()) && f.printer(id).unwrap().print_fmt_supported() {
            assert_eq!(gf, ef, "{file}:{i}");
            compared_fields += 1;
        }
    }
    assert!(
        compared_fields >= 50,
        "{file}: only {compared_fields} lines with fields compared"
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
        if let TraceItem::Dropped { cpu, missed } = i {
            drops.push(TraceItem::Dropped { cpu, missed });
        }
    }
    assert!(recs.error().is_none());
    assert_eq!(
        drops,
        vec![
            TraceItem::Dropped {
                cpu: 0,
                missed: Missed::Count(81)
            },
            TraceItem::Dropped {
                cpu: 1,
                missed: Missed::Count(79)
            }
        ]
    );
}
