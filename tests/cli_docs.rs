//! The command-line reference in docs/ is what the code's clap definition makes
//! (`hyptrace_host::cli::docs`): docs/cli.md and docs/man/*.1 are compared byte for byte
//! with a fresh rendering, so a changed flag or help text without the docs regenerated
//! fails here. `HYPTRACE_BLESS=1 cargo test --release --test cli_docs` rewrites them.
//! The man pages render with `man -l` where man is installed; the completion scripts
//! come out of the binary and bash's parse them.

use std::path::{Path, PathBuf};
use std::process::Command;

use hyptrace_host::cli::docs;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

fn bless() -> bool {
    std::env::var_os("HYPTRACE_BLESS").is_some_and(|v| v == "1")
}

/// `path` holds `want`, or (blessing) is made to.
fn check(path: &Path, want: &[u8], stale: &mut Vec<String>) {
    if bless() {
        std::fs::create_dir_all(path.parent().expect("a parent")).expect("mkdir");
        std::fs::write(path, want).expect("write");
        return;
    }
    if std::fs::read(path).ok().as_deref() != Some(want) {
        stale.push(path.display().to_string());
    }
}

#[test]
fn reference_and_man_pages_match_the_code() {
    let mut stale = Vec::new();
    check(
        &root().join("docs/cli.md"),
        docs::reference_markdown().as_bytes(),
        &mut stale,
    );
    let man = root().join("docs/man");
    let pages = docs::man_pages();
    for (name, roff) in &pages {
        check(&man.join(name), roff, &mut stale);
    }
    // No page of a command that is gone.
    let names: Vec<&str> = pages.iter().map(|(n, _)| n.as_str()).collect();
    for e in std::fs::read_dir(&man).expect("docs/man") {
        let n = e.expect("entry").file_name().to_string_lossy().into_owned();
        // Only man pages (`*.1`): anything else there is not ours to judge or remove.
        if n.ends_with(".1") && !names.contains(&n.as_str()) {
            if bless() {
                std::fs::remove_file(man.join(&n)).expect("rm");
            } else {
                stale.push(format!("docs/man/{n} (no such command)"));
            }
        }
    }
    assert!(
        stale.is_empty(),
        "out of step with the code (run HYPTRACE_BLESS=1 cargo test --release --test cli_docs): {stale:?}"
    );
    for cmd in [
        "record",
        "report",
        "dump",
        "convert",
        "bench",
        "ctl",
        "completions",
    ] {
        assert!(
            names.contains(&format!("hyptrace-{cmd}.1").as_str()),
            "{names:?}"
        );
        assert!(
            docs::reference_markdown().contains(&format!("\n### hyptrace {cmd}\n")),
            "{cmd}"
        );
    }
}

/// `man -l docs/man/hyptrace-record.1` renders (where man is installed): the page's name,
/// its synopsis and an option.
#[test]
fn man_page_renders() {
    let page = root().join("docs/man/hyptrace-record.1");
    let o = match Command::new("man")
        .arg("-l")
        .arg(&page)
        .env("MANPAGER", "cat")
        .env("MANWIDTH", "100")
        .output()
    {
        Ok(o) => o,
        Err(_) => {
            eprintln!("SKIP: no man");
            return;
        }
    };
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for needle in ["hyptrace-record", "SYNOPSIS", "--output"] {
        assert!(text.contains(needle), "{needle} not in {text}");
    }
}

/// `hyptrace completions SHELL` prints a script; bash parses bash's.
#[test]
fn completions_come_out_of_the_binary() {
    let bin = env!("CARGO_BIN_EXE_hyptrace");
    for (shell, needle) in [
        ("bash", "_hyptrace()"),
        ("zsh", "#compdef hyptrace"),
        ("fish", "complete -c hyptrace"),
    ] {
        let o = Command::new(bin)
            .args(["completions", shell])
            .output()
            .expect("run");
        assert!(o.status.success(), "{shell}");
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(text.contains(needle), "{shell}: {needle} not in the script");
        assert!(text.contains("record"), "{shell}: no subcommand");
    }
    let o = Command::new(bin)
        .args(["completions", "bash"])
        .output()
        .expect("run");
    let path = std::env::temp_dir().join(format!("hyptrace-compl-{}.bash", std::process::id()));
    std::fs::write(&path, &o.stdout).expect("write");
    let parsed = Command::new("bash").arg("-n").arg(&path).status();
    let _ = std::fs::remove_file(&path);
    assert!(
        parsed.expect("bash").success(),
        "bash -n rejects the script"
    );
    let bad = Command::new(bin)
        .args(["completions", "tcsh"])
        .output()
        .expect("run");
    assert_eq!(bad.status.code(), Some(2));
}

/// The Markdown files a user follows: README, docs/, the guest template's README.
fn user_docs() -> Vec<PathBuf> {
    let mut v = vec![
        root().join("README.md"),
        root().join("guest/template/README.md"),
    ];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("docs/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    v.extend(docs);
    v
}

/// Issue 39, frictions 1, 2, 3 and 8: the README's set-up commands are the ones that
/// work (`cargo install --locked`, the tests with `--no-fail-fast`); no doc names a
/// path of one machine (a home or work directory), and every exported
/// `CARGO_TARGET_DIR` is absolute from the checkout (`$PWD/...`: criterion writes below
/// it, where `bench --criterion` then reads).
#[test]
fn docs_work_from_any_checkout() {
    let readme = std::fs::read_to_string(root().join("README.md")).expect("README");
    assert!(
        readme.contains("cargo install --locked --path ."),
        "README install"
    );
    assert!(
        readme.contains("cargo test --workspace --release --no-fail-fast"),
        "README test command"
    );
    let mut bad = Vec::new();
    for path in user_docs() {
        let text = std::fs::read_to_string(&path).expect("a doc");
        for (n, line) in text.lines().enumerate() {
            let at = format!("{}:{}: {line}", path.display(), n + 1);
            if ["/work/", "/home/", "/root/", "~/src/"]
                .iter()
                .any(|p| line.contains(p))
            {
                bad.push(at.clone());
            }
            if let Some(v) = line.split("export CARGO_TARGET_DIR=").nth(1) {
                if !v.trim_start_matches('"').starts_with("$PWD/") {
                    bad.push(at);
                }
            }
        }
    }
    assert!(bad.is_empty(), "paths of one machine:\n{}", bad.join("\n"));
}
