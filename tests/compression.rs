//! `record --format dat` compression of real guest runs (skipped without /dev/kvm unless
//! HYPTRACE_REQUIRE_KVM=1; trace-cmd checks skipped without it unless
//! HYPTRACE_REQUIRE_TRACE_CMD=1): zstd by default, at least 3× smaller than
//! `--compression none` on the default workloads (the record's own file where zstd kept
//! pace with the rings, and always the same pages converted), read by trace-cmd event for event with
//! the same lines as `hyptrace report`. Sizes are printed (docs/output.md).

use hyptrace::env::{self, kvm_available, vm_lock, TempDir};

const BIN: &str = env!("CARGO_BIN_EXE_hyptrace");
const KRATE: &str = env!("CARGO_CRATE_NAME");

/// A record's stats, and whether zstd fell behind the rings (the sink's note: chunks
/// stored at the catch-up level, which a loaded machine may need).
fn record(path: &str, stats: &str, args: &[&str]) -> (serde_json::Value, bool) {
    let mut all = vec!["record", "-o", path, "--stats", stats];
    all.extend_from_slice(args);
    let o = env::run(BIN, &all);
    assert_eq!(o.status.code(), Some(0), "{all:?}: {}", env::stderr(&o));
    let behind = env::stderr(&o).contains("stored nearly uncompressed: zstd fell behind");
    let stats = serde_json::from_str(&std::fs::read_to_string(stats).unwrap()).unwrap();
    (stats, behind)
}

fn report(prog: &str, args: &[&str]) -> String {
    let o = env::run(prog, args);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{prog} {args:?}: {}",
        env::stderr(&o)
    );
    assert!(o.stderr.is_empty(), "{prog} {args:?}: {}", env::stderr(&o));
    env::stdout(&o)
}

#[test]
fn zstd_by_default_3x_smaller_read_by_trace_cmd() {
    if !kvm_available(KRATE, "zstd_by_default_3x_smaller_read_by_trace_cmd") {
        return;
    }
    let tc = env::trace_cmd_available();
    let _vm = vm_lock();
    let dir = TempDir::new("compression");
    for workload in ["steady", "mixed"] {
        let z = dir.file(&format!("{workload}-zstd.dat"));
        let n = dir.file(&format!("{workload}-none.dat"));
        let (zs, behind) = record(&z, &dir.file("z.json"), &["--workload", workload]);
        let (ns, _) = record(
            &n,
            &dir.file("n.json"),
            &["--workload", workload, "--compression", "none"],
        );
        let (zl, nl) = (
            std::fs::metadata(&z).unwrap().len(),
            std::fs::metadata(&n).unwrap().len(),
        );
        // The ratio on the same run (two runs may lose different amounts): the pages the
        // zstd file holds, decompressed, against its size.
        let zf = hyptrace_output::TraceFile::open(&z).unwrap();
        assert_eq!(zf.compression.as_ref().map(|c| c.0.as_str()), Some("zstd"));
        let page_bytes = |f: &hyptrace_output::TraceFile| -> u64 {
            (0..f.cpus.len())
                .map(|i| {
                    let mut p = f.pages(i).expect("cpu pages");
                    let mut n = 0u64;
                    while let Some(page) = p.next_page().expect("page") {
                        n += page.len() as u64;
                    }
                    n
                })
                .sum()
        };
        let pages = page_bytes(&zf);
        let nf = hyptrace_output::TraceFile::open(&n).unwrap();
        assert_eq!(nf.compression.as_ref().map(|c| c.0.as_str()), Some("none"));
        let npages = page_bytes(&nf);
        assert!(nl >= npages, "{workload}: none {nl} < its pages {npages}");
        println!(
            "{workload}: zstd {zl} bytes for {pages} bytes of pages (ratio {:.2}); \
             --compression none run: {nl} bytes",
            pages as f64 / zl as f64
        );
        // Live, zstd keeps its level while it keeps pace; behind the rings (two CPU
        // hogs may do that) its chunks go at the catch-up level and the sink says so:
        // then the record's ratio is not the format's. The format's is checked on the
        // same pages converted (no pace to keep: every chunk at the default level).
        assert!(
            behind || zl * 3 <= pages,
            "{workload}: zstd {zl} bytes for {pages} of pages"
        );
        let c = dir.file(&format!("{workload}-converted.dat"));
        report(BIN, &["convert", "-i", &n, "-o", &c]);
        let cl = std::fs::metadata(&c).unwrap().len();
        println!(
            "{workload}: converted to zstd: {cl} bytes (zstd behind the rings live: {behind})"
        );
        assert!(
            cl * 3 <= npages,
            "{workload}: converted to zstd: {cl} bytes for {npages} of pages"
        );
        let read = |s: &serde_json::Value| -> u64 {
            s["cpus"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c["read"].as_u64().unwrap())
                .sum()
        };
        for (path, s) in [(&z, &zs), (&n, &ns)] {
            let ours = report(BIN, &["report", "-i", path]);
            assert_eq!(ours.lines().count() as u64, 1 + read(s), "{path}");
            if tc {
                let theirs = report("trace-cmd", &["report", "-t", "-i", path]);
                assert_eq!(theirs, ours, "{path}: trace-cmd vs hyptrace report");
            }
        }
        if tc {
            let dump = report("trace-cmd", &["dump", "--summary", "-i", &z]);
            assert!(dump.contains("zstd\t[Compression algorithm]"), "{dump}");
        }
    }
}

/// `--compression` is for `--format dat`: with another format, or v6, a usage error
/// before the VM starts (no file).
#[test]
fn compression_only_for_dat() {
    let dir = TempDir::new("compression-args");
    for (fmt, c) in [
        ("json", "zstd"),
        ("dat6", "zstd"),
        ("text", "zstd"),
        ("raw", "zstd"),
    ] {
        let out = dir.file(&format!("x.{fmt}"));
        let o = env::run(
            BIN,
            &["record", "-o", &out, "--format", fmt, "--compression", c],
        );
        env::assert_usage_error(&o, fmt, "--compression zstd applies to --format dat only");
    }
    let o = env::run(BIN, &["record", "--compression", "lz4"]);
    env::assert_usage_error(&o, "lz4", "lz4");
    assert!(dir.entries().is_empty(), "{:?}", dir.entries());
}

/// `convert --compression` as `record`'s (issue 26): a v7 trace.dat is zstd unless
/// `none` is asked, both print the same lines; another format refuses it (exit 2, no
/// file).
#[test]
fn convert_takes_compression() {
    let dir = TempDir::new("convert-compression");
    let input = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/kernel/net-v6.dat"
    );
    let mut lines = Vec::new();
    for (c, want) in [
        (None, "zstd"),
        (Some("none"), "none"),
        (Some("zstd"), "zstd"),
    ] {
        let out = dir.file(&format!("{want}-{}.dat", c.is_some()));
        let mut args = vec!["convert", "-i", input, "-o", &out];
        args.extend(c.map(|c| ["--compression", c]).iter().flatten());
        let o = env::run(BIN, &args);
        assert_eq!(o.status.code(), Some(0), "{args:?}: {}", env::stderr(&o));
        let f = hyptrace_output::TraceFile::open(&out).unwrap();
        assert_eq!(
            f.compression.as_ref().map(|c| c.0.as_str()),
            Some(want),
            "{args:?}"
        );
        lines.push(report(BIN, &["report", "-i", &out]));
    }
    assert!(
        lines.iter().all(|l| *l == lines[0]),
        "the three files print alike"
    );
    let json = dir.file("x.json");
    let o = env::run(
        BIN,
        &["convert", "-i", input, "-o", &json, "--compression", "zstd"],
    );
    env::assert_usage_error(
        &o,
        "json",
        "--compression zstd applies to --format dat only",
    );
    assert!(!std::path::Path::new(&json).exists());
}
