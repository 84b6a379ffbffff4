//! Buffer instances (`hyptrace collect`'s files, trace-cmd's `record -B`): every
//! instance's events merged by time, each line named as `trace-cmd report` names it, and
//! hostile instance tables.

use std::path::{Path, PathBuf};

use super::*;
use crate::sink::TraceMeta;
use crate::tracedat::multi::tests::{part, part_with};
use crate::tracedat::{write_buffers, BufferPart, Compression};
use crate::OutputTarget;

/// `vm-a` (1 CPU, 30 pages) and `vm-bb` (2 CPUs, 7 pages, 5 events lost before page 3
/// of its CPU 1) in `dir/all.dat`.
fn two(dir: &Path, z: Compression) -> PathBuf {
    let meta = TraceMeta::guest(4096, 2, crate::Clock::nanoseconds());
    let drop = |cpu: u32, i: u64| crate::Missed::count(if (cpu, i) == (1, 3) { 5 } else { 0 });
    let parts = vec![
        part(dir, "vm-a", 1, 30, z),
        part_with(dir, "vm-bb", meta.clone(), 7, z, &drop),
    ];
    write_all(dir, &parts)
}

fn write_all(dir: &Path, parts: &[BufferPart]) -> PathBuf {
    let out = dir.join("all.dat");
    let meta = TraceMeta::guest(4096, 2, crate::Clock::nanoseconds());
    write_buffers(&OutputTarget::check(&out).unwrap(), meta, parts).unwrap();
    out
}

fn report_with(f: &TraceFile, filter: &ReportFilter) -> String {
    let mut v = Vec::new();
    f.write_report(&mut v, filter).unwrap();
    String::from_utf8(v).unwrap()
}

/// Every instance's events, merged by time, each line after its instance's name
/// (right-aligned); the event after a drop marker shares the marker's name; the
/// formatting threads print what one thread prints.
#[test]
fn report_reads_every_instance() {
    for z in [Compression::None, Compression::Zstd] {
        let dir = tempfile::tempdir().unwrap();
        let f = TraceFile::open(two(dir.path(), z)).unwrap();
        assert!(f.damage.is_empty(), "{:?}", f.damage);
        assert_eq!(f.event_count(), 44);
        let text = f.report();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "cpus=2");
        let named = |p: &str| lines.iter().filter(|l| l.starts_with(p)).count();
        // 30 + 14 events and the drop line (its event has no name of its own).
        assert_eq!((named(" vm-a: "), named("vm-bb: ")), (30, 14), "{text}");
        let drop = lines
            .iter()
            .position(|l| l.contains("EVENTS DROPPED"))
            .unwrap();
        assert_eq!(lines[drop], "vm-bb: CPU:1 [5 EVENTS DROPPED]");
        assert!(lines[drop + 1].contains("[001]") && lines[drop + 1].starts_with(' '));
        let one = ReportFilter {
            threads: 1,
            ..Default::default()
        };
        let many = ReportFilter {
            threads: 4,
            ..Default::default()
        };
        assert_eq!(report_with(&f, &one), report_with(&f, &many));
        // In time order across the instances.
        let ts: Vec<f64> = lines[1..]
            .iter()
            .filter_map(|l| l.split(": marker").next()?.rsplit(' ').next()?.parse().ok())
            .collect();
        assert_eq!(ts.len(), 44);
        assert!(ts.windows(2).all(|w| w[0] <= w[1]), "{text}");
        // --cpu selects that CPU in every instance.
        let cpu1 = ReportFilter {
            cpus: Some([1].into()),
            ..Default::default()
        };
        assert_eq!(report_with(&f, &cpu1).matches("[001]").count(), 7);
    }
}

/// `report` of a multi-buffer file is `trace-cmd report -t`, line for line (a drop
/// marker among the lines); `--cpu` and `-F`, which trace-cmd applies to the top level
/// only, select in every instance (skipped without trace-cmd unless
/// HYPTRACE_REQUIRE_TRACE_CMD=1).
#[test]
fn report_is_trace_cmds() {
    if std::process::Command::new("trace-cmd")
        .arg("--help")
        .output()
        .is_err()
    {
        assert!(
            std::env::var_os("HYPTRACE_REQUIRE_TRACE_CMD").is_none(),
            "trace-cmd not installed"
        );
        println!("SKIP: trace-cmd not installed");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = two(dir.path(), Compression::Zstd);
    let f = TraceFile::open(&out).unwrap();
    let theirs = |args: &[&str]| {
        let t = std::process::Command::new("trace-cmd")
            .args(["report", "-t", "-i"])
            .arg(&out)
            .args(args)
            .output()
            .unwrap();
        let text = String::from_utf8(t.stdout).unwrap();
        assert!(t.status.success(), "{args:?}: {:?} {text}", t.status);
        text
    };
    let all = theirs(&[]);
    assert_eq!(all.lines().count(), 1 + 44 + 1, "{all}");
    assert_eq!(report_with(&f, &ReportFilter::default()), all);
    // trace-cmd 3.1.6 applies `--cpu` and `-F` to the top level only: of a file whose
    // events are all in instances it prints no event with `--cpu`, every event with
    // `-F`. Ours applies both to every instance (docs/output.md "Reading buffer
    // instances"); these checks say when trace-cmd changes.
    assert_eq!(theirs(&["--cpu", "1"]), "cpus=2\n");
    assert_eq!(theirs(&["-F", "marker: seq > 4"]), all);
    let cpu1 = ReportFilter {
        cpus: Some([1].into()),
        ..Default::default()
    };
    let ours = report_with(&f, &cpu1);
    let want: Vec<&str> = all.lines().filter(|l| l.contains("[001]")).collect();
    assert_eq!(ours.matches("[001]").count(), want.len());
    let seq = ReportFilter {
        events: vec!["marker: seq > 4".into()],
        ..Default::default()
    };
    // Lines for seq 5..29 of vm-a (25), 5 and 6 of vm-bb's two CPUs (4).
    assert_eq!(report_with(&f, &seq).matches(": marker:").count(), 29);
}

/// Where the CPU table of instance `name`'s BUFFER option starts in an uncompressed
/// file (after its name, clock, page size and CPU count).
fn table_of(d: &[u8], name: &str) -> usize {
    let key = format!("{name}\0");
    let at = d
        .windows(key.len())
        .position(|w| w == key.as_bytes())
        .unwrap();
    let clock = at + key.len();
    let end = clock + d[clock..].iter().position(|&b| b == 0).unwrap();
    end + 1 + 8
}

/// An instance whose CPU data lies past the end of the file: noted as damage, the
/// other instance read whole; nothing panics.
#[test]
fn instance_data_outside_the_file_is_damage() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = std::fs::read(two(dir.path(), Compression::None)).unwrap();
    let t = table_of(&d, "vm-a");
    let past = (d.len() as u64 + 4096).to_le_bytes();
    d[t + 4..t + 12].copy_from_slice(&past);
    let f = TraceFile::parse(&d).unwrap();
    assert!(!f.damage.is_empty());
    assert_eq!(f.event_count(), 14);
    // A size running past the end: the pages before it are read.
    let mut d = std::fs::read(dir.path().join("all.dat")).unwrap();
    let t = table_of(&d, "vm-a");
    d[t + 12..t + 20].copy_from_slice(&u64::MAX.to_le_bytes());
    let f = TraceFile::parse(&d).unwrap();
    assert!(!f.damage.is_empty());
    assert!(f.event_count() >= 14);
}

/// An instance whose CPU table names another instance's data does not read it again
/// (noted); the first instance is read whole.
#[test]
fn shared_data_is_read_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = std::fs::read(two(dir.path(), Compression::None)).unwrap();
    let (a, b) = (table_of(&d, "vm-a"), table_of(&d, "vm-bb"));
    let a_off: [u8; 8] = d[a + 4..a + 12].try_into().unwrap();
    for cpu in 0..2 {
        let at = b + cpu * 20 + 4;
        d[at..at + 8].copy_from_slice(&a_off);
    }
    let f = TraceFile::parse(&d).unwrap();
    assert!(
        f.damage.iter().any(|x| x.what.contains("read before")),
        "{:?}",
        f.damage
    );
    assert_eq!(f.event_count(), 30);
}

/// A second instance of the same name is not read (noted); a cut BUFFER option leaves
/// its instance out.
#[test]
fn duplicate_and_cut_instances_are_left_out() {
    let dir = tempfile::tempdir().unwrap();
    let parts = vec![
        part(dir.path(), "vm-a", 1, 3, Compression::None),
        part(dir.path(), "vm-b", 1, 5, Compression::None),
    ];
    let d = std::fs::read(write_all(dir.path(), &parts)).unwrap();
    let mut dup = d.clone();
    let at = dup.windows(5).position(|w| w == b"vm-b\0").unwrap();
    dup[at..at + 4].copy_from_slice(b"vm-a");
    let f = TraceFile::parse(&dup).unwrap();
    assert_eq!(f.instances.len(), 1);
    assert!(
        f.damage
            .iter()
            .any(|x| x.what.contains("1 buffer instances of a name")),
        "{:?}",
        f.damage
    );
    assert_eq!(f.event_count(), 3);
    // The CPU count of vm-b's table says 1000 CPUs: its option is too short for them.
    let mut cut = d;
    let t = table_of(&cut, "vm-b");
    cut[t - 4..t].copy_from_slice(&1000u32.to_le_bytes());
    let f = TraceFile::parse(&cut).unwrap();
    assert_eq!(f.instances.len(), 1);
    assert_eq!(f.event_count(), 3);
}

/// More than [`MAX_INSTANCES`] instances: the first ones are read, the rest noted.
#[test]
fn too_many_instances_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let parts: Vec<BufferPart> = (0..=MAX_INSTANCES)
        .map(|i| part(dir.path(), &format!("v{i}"), 1, 1, Compression::None))
        .collect();
    let f = TraceFile::open(write_all(dir.path(), &parts)).unwrap();
    assert_eq!(f.instances.len(), MAX_INSTANCES);
    assert!(
        f.damage
            .iter()
            .any(|x| x.what.starts_with("1 buffer instances past")),
        "{:?}",
        f.damage
    );
    assert_eq!(f.event_count(), MAX_INSTANCES);
}
