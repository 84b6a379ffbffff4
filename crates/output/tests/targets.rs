//! Output destinations (`OutputTarget`): regular files are replaced atomically, symlinks
//! followed, devices/FIFOs/stdout written in place, directories refused up front, write
//! errors (ENOSPC) reported once with the path and leave no temporary or spill file.

mod common;

use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use hyptrace_output::*;

fn meta(nr: u32) -> TraceMeta {
    TraceMeta::guest(4096, nr, Clock::nanoseconds())
}

/// 2 CPUs × a few pages of markers.
fn pages(nr: u32, per_cpu: u64) -> Vec<(u32, Vec<u8>, Missed)> {
    let mut out = Vec::new();
    for cpu in 0..nr {
        let mut b = PageBuilder::new(4096);
        for i in 0..per_cpu {
            b.push(1_000 + i * 10, &marker(cpu, i, i));
        }
        out.extend(b.finish().into_iter().map(|(p, m)| (cpu, p, m)));
    }
    out
}

fn feed(sink: &mut dyn PageSink, pages: &[(u32, Vec<u8>, Missed)]) -> Result<(), OutputError> {
    for (c, p, m) in pages {
        sink.page(*c, p, *m)?;
    }
    Ok(())
}

fn ls(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// `mknod path c major minor`; false (after printing SKIP) if not permitted.
fn mknod(path: &Path, major: u32, minor: u32) -> bool {
    let ok = Command::new("mknod")
        .arg(path)
        .args(["c", &major.to_string(), &minor.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        println!("SKIP: mknod not permitted here");
    }
    ok
}

fn io_source(e: &OutputError) -> &std::io::Error {
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<std::io::Error>())
        .unwrap_or_else(|| panic!("no io::Error source in {e:?}"))
}

#[test]
fn device_node_written_in_place() {
    let dir = scratch_dir("target-dev");
    let spill = scratch_dir("target-dev-spill");
    let dev = dir.join("null");
    if !mknod(&dev, 1, 3) {
        return;
    }
    let t = OutputTarget::check(&dev)
        .unwrap()
        .with_spill_dir(spill.path());
    assert_eq!(t.kind(), TargetKind::Stream);
    let mut s = TraceDatSink::open(&t, meta(2), TraceDatVersion::V7).unwrap();
    feed(&mut s, &pages(2, 300)).unwrap();
    assert_eq!(ls(&spill).len(), 2, "spill files while running");
    Box::new(s).finish(&RunSummary::default()).unwrap();
    let m = std::fs::symlink_metadata(&dev).unwrap();
    assert!(m.file_type().is_char_device(), "device node kept");
    assert_eq!(ls(&dir), vec!["null".to_string()]);
    assert!(ls(&spill).is_empty());
    for fmt in ["text", "json", "raw"] {
        let mut s: Box<dyn PageSink> = match fmt {
            "text" => Box::new(TextSink::create(&dev, meta(2)).unwrap()),
            "json" => Box::new(JsonSink::create(&dev, meta(2)).unwrap()),
            _ => Box::new(RawSink::create(&dev, meta(2)).unwrap()),
        };
        feed(s.as_mut(), &pages(2, 50)).unwrap();
        s.finish(&RunSummary::default()).unwrap();
        assert!(std::fs::symlink_metadata(&dev)
            .unwrap()
            .file_type()
            .is_char_device());
        assert_eq!(ls(&dir), vec!["null".to_string()], "{fmt}");
    }
}

#[test]
fn full_device_reports_enospc_once_and_leaves_nothing() {
    let dir = scratch_dir("target-full");
    let spill = scratch_dir("target-full-spill");
    let dev = dir.join("full");
    if !mknod(&dev, 1, 7) {
        return;
    }
    let t = OutputTarget::check(&dev)
        .unwrap()
        .with_spill_dir(spill.path());
    // trace.dat: the error comes at finish (pages are spilled first).
    let mut s = TraceDatSink::open(&t, meta(2), TraceDatVersion::V6).unwrap();
    feed(&mut s, &pages(2, 300)).unwrap();
    let e = Box::new(s).finish(&RunSummary::default()).unwrap_err();
    assert_eq!(io_source(&e).raw_os_error(), Some(28), "{e}");
    assert!(e.to_string().contains(&dev.display().to_string()), "{e}");
    assert!(ls(&spill).is_empty(), "{:?}", ls(&spill));
    // Text: the error surfaces when the buffer is written; later calls say Closed.
    let mut s = TextSink::open(&t, meta(2)).unwrap();
    let many = pages(2, 20_000);
    let e = feed(&mut s, &many).unwrap_err();
    assert_eq!(io_source(&e).raw_os_error(), Some(28), "{e}");
    assert!(matches!(feed(&mut s, &many[..1]), Err(OutputError::Closed)));
    assert!(matches!(
        Box::new(s).finish(&RunSummary::default()),
        Err(OutputError::Closed)
    ));
    assert!(std::fs::symlink_metadata(&dev)
        .unwrap()
        .file_type()
        .is_char_device());
    assert_eq!(ls(&dir), vec!["full".to_string()]);
}

/// A 64 KiB tmpfs mounted on a scratch directory, unmounted when dropped (then the
/// directory is removed).
struct Tmpfs(ScratchDir);

impl Tmpfs {
    fn mount(name: &str) -> Option<Self> {
        let d = scratch_dir(name);
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=64k", "tmpfs"])
            .arg(d.path())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            println!("SKIP: cannot mount a tmpfs here");
            return None;
        }
        Some(Self(d))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.0.path()).status();
    }
}

#[test]
fn enospc_on_a_small_file_system_leaves_nothing() {
    let Some(fs) = Tmpfs::mount("target-tmpfs") else {
        return;
    };
    let path = fs.0.join("x.dat");
    std::fs::write(&path, b"previous").unwrap();
    // trace.dat: the CPU data (one CPU straight into the output, the other into its
    // spill file) fills the file system.
    let mut s = TraceDatSink::create(&path, meta(2), TraceDatVersion::V7).unwrap();
    // More than the buffers (1 MiB each, up to three per file) hold: a full buffer may be
    // written on a thread of its own (where the file system takes O_DIRECT, as tmpfs
    // does) and its error come back when a later one is handed over — while feeding,
    // within a bounded number of rounds.
    let batch = pages(2, 40_000);
    let e = (0..16)
        .find_map(|_| feed(&mut s, &batch).err())
        .expect("the error comes while feeding");
    assert_eq!(io_source(&e).raw_os_error(), Some(28), "{e}");
    let named = e.to_string();
    assert!(
        named.contains(".cpu") || named.ends_with("x.dat"),
        "names the spill file or the output: {e}"
    );
    assert_eq!(
        ls(&fs.0),
        vec!["x.dat".to_string()],
        "spills removed at once"
    );
    assert!(matches!(
        feed(&mut s, &pages(2, 1)),
        Err(OutputError::Closed)
    ));
    drop(s);
    assert_eq!(std::fs::read(&path).unwrap(), b"previous");
    // Text and JSON: the temporary output file fills it.
    for fmt in ["text", "json"] {
        let mut s: Box<dyn PageSink> = match fmt {
            "text" => Box::new(TextSink::create(&path, meta(1)).unwrap()),
            _ => Box::new(JsonSink::create(&path, meta(1)).unwrap()),
        };
        let r = feed(s.as_mut(), &pages(1, 20_000)).and_then(|()| s.finish(&RunSummary::default()));
        let e = r.unwrap_err();
        assert_eq!(io_source(&e).raw_os_error(), Some(28), "{fmt}: {e}");
        assert!(e.to_string().contains("x.dat"), "{e}");
        assert_eq!(ls(&fs.0), vec!["x.dat".to_string()], "{fmt}");
        assert_eq!(std::fs::read(&path).unwrap(), b"previous");
    }
}

#[test]
fn symlink_target_is_written() {
    let dir = scratch_dir("target-link");
    let real = dir.join("real.dat");
    let link = dir.join("link.dat");
    std::os::unix::fs::symlink("real.dat", &link).unwrap(); // relative, dangling
    let t = OutputTarget::check(&link).unwrap();
    assert_eq!(t.kind(), TargetKind::File);
    assert_eq!(t.dest(), real.as_path());
    let mut s = TraceDatSink::open(&t, meta(2), TraceDatVersion::V7).unwrap();
    feed(&mut s, &pages(2, 100)).unwrap();
    Box::new(s).finish(&RunSummary::default()).unwrap();
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(TraceFile::open(&link).unwrap().event_count(), 200);
    // A chain of links to an existing file.
    let link2 = dir.join("link2.txt");
    std::os::unix::fs::symlink(&link, &link2).unwrap();
    let mut s = TextSink::create(&link2, meta(2)).unwrap();
    feed(&mut s, &pages(2, 3)).unwrap();
    Box::new(s).finish(&RunSummary::default()).unwrap();
    assert!(std::fs::read_to_string(&real)
        .unwrap()
        .starts_with("cpus=2\n"));
    assert_eq!(ls(&dir), vec!["link.dat", "link2.txt", "real.dat"]);
    // A loop is refused.
    let a = dir.join("a");
    let b = dir.join("b");
    std::os::unix::fs::symlink(&b, &a).unwrap();
    std::os::unix::fs::symlink(&a, &b).unwrap();
    assert!(OutputTarget::check(&a).is_err());
}

#[test]
fn fifo_is_streamed() {
    let dir = scratch_dir("target-fifo");
    let fifo = dir.join("pipe");
    if !Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .is_ok_and(|s| s.success())
    {
        println!("SKIP: mkfifo failed");
        return;
    }
    let spill = scratch_dir("target-fifo-spill");
    // No reader yet: still a valid target (open waits for the reader).
    let t = OutputTarget::check(&fifo)
        .unwrap()
        .with_spill_dir(spill.path());
    assert_eq!(t.kind(), TargetKind::Stream);
    // The read side opened first (non-blocking), so opening the write side never waits.
    let mut reader = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(0o4000)
        .open(&fifo)
        .unwrap();
    let got = std::thread::scope(|sc| {
        let h = sc.spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(60);
            let mut got = Vec::new();
            let mut buf = vec![0u8; 1 << 16];
            let mut seen_data = false;
            loop {
                assert!(Instant::now() < deadline, "fifo reader timed out");
                match reader.read(&mut buf) {
                    Ok(0) if seen_data => break,
                    Ok(0) => std::thread::sleep(Duration::from_millis(1)),
                    Ok(n) => {
                        seen_data = true;
                        got.extend_from_slice(&buf[..n]);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(1))
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            got
        });
        let mut s = TraceDatSink::open(&t, meta(2), TraceDatVersion::V6).unwrap();
        feed(&mut s, &pages(2, 400)).unwrap();
        Box::new(s).finish(&RunSummary::default()).unwrap();
        h.join().unwrap()
    });
    let f = TraceFile::parse(&got).unwrap();
    assert_eq!(f.event_count(), 800);
    assert!(std::fs::symlink_metadata(&fifo)
        .unwrap()
        .file_type()
        .is_fifo());
    assert_eq!(ls(&dir), vec!["pipe".to_string()]);
    assert!(ls(&spill).is_empty());
}

#[test]
fn directories_and_missing_dirs_refused_up_front() {
    let dir = scratch_dir("target-dir");
    let e = OutputTarget::check(&dir).unwrap_err();
    assert_eq!(io_source(&e).kind(), std::io::ErrorKind::IsADirectory);
    assert!(e.to_string().contains(&dir.display().to_string()), "{e}");
    assert!(TraceDatSink::create(&dir, meta(1), TraceDatVersion::V7).is_err());
    assert!(TextSink::create(&dir, meta(1)).is_err());
    let e = OutputTarget::check(dir.join("missing/x.dat")).unwrap_err();
    assert_eq!(io_source(&e).kind(), std::io::ErrorKind::NotFound);
    // A symlink to a directory is a directory.
    let l = dir.join("l");
    std::os::unix::fs::symlink(&dir, &l).unwrap();
    assert!(OutputTarget::check(&l).is_err());
    assert!(OutputTarget::check("").is_err());
    // check() leaves nothing behind.
    assert_eq!(ls(&dir), vec!["l".to_string()]);
    assert!(OutputTarget::check(dir.join("new.dat")).is_ok());
    assert_eq!(ls(&dir), vec!["l".to_string()]);
}

#[test]
fn dash_is_stdout() {
    let t = OutputTarget::check("-").unwrap();
    assert_eq!(t.kind(), TargetKind::Stdout);
    if std::env::var_os("HYPTRACE_TARGET_CHILD").is_some() {
        // The child: a text trace on stdout.
        let mut s = TextSink::create("-", meta(1)).unwrap();
        feed(&mut s, &pages(1, 2)).unwrap();
        Box::new(s).finish(&RunSummary::default()).unwrap();
        return;
    }
    let dir = scratch_dir("target-dash");
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "dash_is_stdout",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("HYPTRACE_TARGET_CHILD", "1")
        .current_dir(&dir)
        .output()
        .unwrap();
    assert!(out.status.success());
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(s.contains("cpus=1\n"), "{s}");
    assert_eq!(s.matches("marker:").count(), 2, "{s}");
    assert!(ls(&dir).is_empty(), "no file named -: {:?}", ls(&dir));
}

#[test]
fn dropped_sinks_remove_temporary_and_spill_files() {
    let dir = scratch_dir("target-drop");
    let spill = scratch_dir("target-drop-spill");
    let path = dir.join("t.dat");
    let t = OutputTarget::check(&path)
        .unwrap()
        .with_spill_dir(spill.path());
    let mut s = TraceDatSink::open(&t, meta(3), TraceDatVersion::V7).unwrap();
    feed(&mut s, &pages(3, 100)).unwrap();
    assert_eq!(ls(&spill).len(), 3);
    assert_eq!(ls(&dir).len(), 1, "the temporary output");
    drop(s);
    assert!(ls(&spill).is_empty() && ls(&dir).is_empty());
    for fmt in ["text", "json", "raw"] {
        let mut s: Box<dyn PageSink> = match fmt {
            "text" => Box::new(TextSink::open(&t, meta(3)).unwrap()),
            "json" => Box::new(JsonSink::open(&t, meta(3)).unwrap()),
            _ => Box::new(RawSink::open(&t, meta(3)).unwrap()),
        };
        feed(s.as_mut(), &pages(3, 10)).unwrap();
        drop(s);
        assert!(ls(&dir).is_empty(), "{fmt}: {:?}", ls(&dir));
    }
    // The file a finished sink writes is owner-only (it holds trace data), in every
    // format, spill files too; `with_mode` asks for another mode (less the umask).
    use std::os::unix::fs::PermissionsExt;
    let mode_of = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    for fmt in ["dat", "text", "json", "raw"] {
        let mut s: Box<dyn PageSink> = match fmt {
            "dat" => Box::new(TraceDatSink::open(&t, meta(1), TraceDatVersion::V7).unwrap()),
            "text" => Box::new(TextSink::open(&t, meta(1)).unwrap()),
            "json" => Box::new(JsonSink::open(&t, meta(1)).unwrap()),
            _ => Box::new(RawSink::open(&t, meta(1)).unwrap()),
        };
        feed(s.as_mut(), &pages(1, 1)).unwrap();
        assert_eq!(ls(&spill).is_empty(), fmt != "dat", "{fmt}: spill files");
        for f in ls(&spill) {
            assert_eq!(mode_of(&spill.path().join(&f)), 0o600, "{fmt}: spill {f}");
        }
        s.finish(&RunSummary::default()).unwrap();
        assert_eq!(mode_of(&path), OutputTarget::PRIVATE, "{fmt}");
    }
    let umask = std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("Umask:"))
        .and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
        .unwrap();
    let mut s = TextSink::open(&t.clone().with_mode(0o644), meta(1)).unwrap();
    feed(&mut s, &pages(1, 1)).unwrap();
    Box::new(s).finish(&RunSummary::default()).unwrap();
    assert_eq!(mode_of(&path), 0o644 & !umask);
}

/// `--direct-io` (whole blocks past the page cache, docs/output.md) writes the same
/// bytes as the page cache does, for every file sink: trace.dat with one CPU written
/// straight into the output and the other spilled and copied (uncompressed, zstd, v6),
/// the raw stream and text; each CPU's data larger than a direct block (4 MiB), so
/// whole blocks, blocks written while others are in flight and the tails all happen
/// (the unaligned start of a stream: `blockwrite`'s own tests).
#[test]
fn direct_io_writes_the_same_bytes() {
    let dir = scratch_dir("direct-io");
    // Markers compress well: zstd's input is larger, for data past one block.
    let (small, large) = (pages(2, 220_000), pages(2, 2_200_000));
    type Open = fn(&OutputTarget) -> Box<dyn PageSink>;
    let sinks: [(&str, Open); 5] = [
        ("dat-none", |t| {
            Box::new(TraceDatSink::open(t, meta(2), TraceDatVersion::V7).unwrap())
        }),
        ("dat-zstd", |t| {
            Box::new(
                TraceDatSink::open_with(t, meta(2), TraceDatVersion::V7, Compression::Zstd)
                    .unwrap(),
            )
        }),
        ("dat-v6", |t| {
            Box::new(TraceDatSink::open(t, meta(2), TraceDatVersion::V6).unwrap())
        }),
        ("raw", |t| Box::new(RawSink::open(t, meta(2)).unwrap())),
        ("text", |t| Box::new(TextSink::open(t, meta(2)).unwrap())),
    ];
    for (name, open) in sinks {
        let input = if name == "dat-zstd" { &large } else { &small };
        let mut files = Vec::new();
        for direct in [false, true] {
            let path = dir.join(format!("{name}-{direct}"));
            let mut t = OutputTarget::check(&path).unwrap();
            if direct {
                t = t.with_direct_io();
            }
            assert_eq!(t.is_direct_io(), direct);
            let mut s = open(&t);
            feed(s.as_mut(), input).unwrap();
            s.finish(&RunSummary::default()).unwrap();
            files.push(std::fs::read(&path).unwrap());
        }
        assert!(files[0].len() > 8 << 20, "{name}: {} bytes", files[0].len());
        assert!(files[0] == files[1], "{name}: the files differ");
    }
    assert_eq!(ls(&dir).len(), 10, "no temporary or spill file left");
}
