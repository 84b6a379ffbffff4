//! Every shell snippet of README.md is checked (issue 38): each `hyptrace` command in a
//! ```` ```sh ```` block parses as the CLI parses it (a renamed flag or command fails
//! here), every other program a snippet runs is one this test knows, and with /dev/kvm
//! the commands that run offline on their own (no background job, no running VM to talk
//! to, no external viewer; `--host-trace` as root where tracefs takes instances) run in
//! order, paths under /tmp and /dev/shm moved into a temporary directory, each exiting
//! 0. A command that reads what a skipped one would have written is skipped too. (The
//! Rust snippets of the crates' READMEs run as doc tests: each crate includes its
//! README.)

use std::path::Path;

use clap::Parser;
use hyptrace::env::{self, kvm_available, vm_lock, TempDir};

const BIN: &str = env!("CARGO_BIN_EXE_hyptrace");

/// Programs the README's snippets run besides `hyptrace`: tools the README tells the
/// reader to install or use (not run here).
const OTHER_PROGRAMS: &[&str] = &["cargo", "trace-cmd", "kernelshark", "less", "head"];

/// One command of a snippet: its words, and whether it runs in the background (`&`).
#[derive(Debug)]
struct Cmd {
    line: usize,
    words: Vec<String>,
    background: bool,
}

/// The lines of README.md's ```` ```sh ```` blocks, with their line numbers.
fn sh_lines(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut inside = false;
    for (i, l) in text.lines().enumerate() {
        let t = l.trim();
        if t.starts_with("```") {
            inside = !inside && t == "```sh";
            continue;
        }
        if inside {
            out.push((i + 1, l.to_string()));
        }
    }
    out
}

/// A shell line split into commands: words (quotes removed), `#` comments dropped,
/// `|`, `;`, `&&` and `&` ending a command, redirections (`> FILE`, `< FILE`) dropped.
fn commands(line: usize, text: &str) -> Vec<Cmd> {
    let mut cmds = Vec::new();
    let mut words: Vec<String> = Vec::new();
    let mut word: Option<String> = None;
    let mut chars = text.chars().peekable();
    let mut redirect = false;
    let end = |words: &mut Vec<String>, background: bool, cmds: &mut Vec<Cmd>| {
        if !words.is_empty() {
            cmds.push(Cmd {
                line,
                words: std::mem::take(words),
                background,
            });
        }
    };
    while let Some(c) = chars.next() {
        match c {
            '\'' | '"' => {
                let w = word.get_or_insert_with(String::new);
                for q in chars.by_ref() {
                    if q == c {
                        break;
                    }
                    w.push(q);
                }
                continue;
            }
            ' ' | '\t' | '|' | ';' | '&' | '>' | '<' | '#' => {
                if let Some(w) = word.take() {
                    if std::mem::take(&mut redirect) {
                        // the file of a redirection: not an argument
                    } else {
                        words.push(w);
                    }
                }
                match c {
                    '#' => break,
                    '>' | '<' => redirect = true,
                    '&' if chars.peek() == Some(&'&') => {
                        chars.next();
                        end(&mut words, false, &mut cmds);
                    }
                    '&' => end(&mut words, true, &mut cmds),
                    '|' | ';' => end(&mut words, false, &mut cmds),
                    _ => {}
                }
            }
            _ => word.get_or_insert_with(String::new).push(c),
        }
    }
    if let Some(w) = word.take() {
        if !redirect {
            words.push(w);
        }
    }
    end(&mut words, false, &mut cmds);
    cmds
}

fn readme_commands() -> Vec<Cmd> {
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md"))
        .expect("README.md");
    sh_lines(&text)
        .iter()
        .flat_map(|(n, l)| commands(*n, l))
        .collect()
}

#[test]
fn the_splitter_splits_as_the_shell() {
    let c = commands(1, "a 'x y' \"z\" > f | b --p=1 2 & c && d # e f");
    let w: Vec<_> = c.iter().map(|c| c.words.join(",")).collect();
    assert_eq!(w, ["a,x y,z", "b,--p=1,2", "c", "d"]);
    assert_eq!(
        c.iter().map(|c| c.background).collect::<Vec<_>>(),
        [false, true, false, false]
    );
}

/// Every `hyptrace` command of the README parses; every other program is known.
#[test]
fn every_readme_command_parses() {
    let cmds = readme_commands();
    let mut parsed = 0;
    for c in &cmds {
        let prog = c.words[0].as_str();
        if prog == "hyptrace" {
            if let Err(e) = hyptrace_host::cli::Cli::try_parse_from(&c.words) {
                panic!("README.md:{}: {:?} does not parse:\n{e}", c.line, c.words);
            }
            parsed += 1;
        } else {
            assert!(
                OTHER_PROGRAMS.contains(&prog),
                "README.md:{}: `{prog}` is no program this test knows",
                c.line
            );
        }
    }
    // The tour has a dozen: a README that lost its blocks (or a splitter that finds
    // none) fails here.
    assert!(parsed >= 10, "only {parsed} hyptrace commands found");
}

/// Why a command is not run here, if it is not.
fn not_run(c: &Cmd) -> Option<&'static str> {
    let has = |w: &str| c.words.iter().any(|x| x == w);
    if c.words[0] != "hyptrace" {
        Some("another program")
    } else if c.background {
        Some("a background job")
    } else if has("--attach") || has("ctl") || has("collect") || has("--control") {
        Some("needs a running VM")
    } else if has("bench") {
        Some("a benchmark (tests/bench_smoke.rs)")
    } else if has("--host-trace") && !is_root() {
        Some("needs root")
    } else if has("--host-trace") && !env::tracefs_available("hyptrace", "readme_tour_runs") {
        // As every host-trace test: skipped where tracefs is not mounted or takes no
        // instance, a failure with HYPTRACE_REQUIRE_TRACEFS=1 (.ci/run sets it where it can).
        Some("needs tracefs instances")
    } else {
        None
    }
}

/// Whether this process runs as root (`--host-trace` needs it).
fn is_root() -> bool {
    std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        .unwrap_or(false)
}

/// The README's commands that run offline, run in order (paths moved into a temporary
/// directory), each exiting 0.
#[test]
fn readme_tour_runs() {
    if !kvm_available("hyptrace", "readme_tour_runs") {
        return;
    }
    let _vm = vm_lock();
    let dir = TempDir::new("readme");
    let moved = |w: &str| {
        ["/tmp/", "/dev/shm/"]
            .iter()
            .find_map(|p| w.strip_prefix(p))
            .map_or_else(|| w.to_string(), |rest| dir.file(rest))
    };
    let mut skipped_paths: Vec<String> = Vec::new();
    let mut ran = 0;
    for c in readme_commands() {
        let args: Vec<String> = c.words[1..].iter().map(|w| moved(w)).collect();
        let reads_skipped = args.iter().any(|a| skipped_paths.contains(a));
        if let Some(why) = not_run(&c).or(reads_skipped.then_some("reads a skipped command's file"))
        {
            println!("README.md:{}: not run ({why}): {:?}", c.line, c.words);
            // What a skipped hyptrace command would have written is missing for the
            // ones after it (other programs write nothing the tour reads).
            if c.words[0] == "hyptrace" {
                let ours = |a: &&String| Path::new(a.as_str()).starts_with(dir.path());
                skipped_paths.extend(args.iter().filter(ours).cloned());
            }
            continue;
        }
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = env::run(BIN, &refs);
        assert_eq!(
            out.status.code(),
            Some(0),
            "README.md:{}: {:?}\n{}",
            c.line,
            c.words,
            env::stderr(&out)
        );
        ran += 1;
    }
    // run, run | less, record, report at least.
    assert!(ran >= 4, "only {ran} README commands ran");
}
