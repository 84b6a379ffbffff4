//! The command line's reference, made from its clap definition (so it cannot drift from
//! the code; `tests/cli_docs.rs` compares the files in docs/ with what this makes):
//! docs/cli.md, one man page per command in docs/man/ (clap_mangen), and the shell
//! completion scripts of `hyptrace completions SHELL` (clap_complete).

use std::fmt::Write as _;

use clap::{Arg, ArgAction, Command, CommandFactory};

use super::Cli;

/// The command tree, named as installed (`hyptrace`).
fn tree() -> Command {
    let mut c = Cli::command();
    c.build();
    c
}

/// Every man page: `hyptrace.1`, then `hyptrace-SUB.1` per subcommand (and
/// `hyptrace-SUB-SUBSUB.1` below it), as (file name, roff text).
pub fn man_pages() -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    man_of(&tree(), "hyptrace", &mut out);
    out
}

fn man_of(c: &Command, name: &str, out: &mut Vec<(String, Vec<u8>)>) {
    let page = c.clone().name(name.to_string());
    let mut roff = Vec::new();
    // Writing into a Vec cannot fail.
    let _ = clap_mangen::Man::new(page).render(&mut roff);
    out.push((format!("{name}.1"), roff));
    for sub in c.get_subcommands().filter(|s| !s.is_hide_set()) {
        if sub.get_name() == "help" {
            continue;
        }
        man_of(sub, &format!("{name}-{}", sub.get_name()), out);
    }
}

/// The shell completion script of `shell` for the installed name `hyptrace`.
pub fn completions(shell: clap_complete::Shell) -> Vec<u8> {
    let mut c = Cli::command();
    let mut out = Vec::new();
    clap_complete::generate(shell, &mut c, "hyptrace", &mut out);
    out
}

/// docs/cli.md: every command with its description, usage and options.
pub fn reference_markdown() -> String {
    let mut s = String::from(
        "# hyptrace command-line reference\n\n\
         Generated from the command line's definition (`host/src/cli/docs.rs`; \
         `HYPTRACE_BLESS=1 cargo test --release --test cli_docs` rewrites it and \
         docs/man/). The same text is `hyptrace COMMAND --help`; man pages: \
         `man -l docs/man/hyptrace-record.1`; shell completions: \
         `hyptrace completions bash|zsh|fish|elvish|powershell`.\n",
    );
    let top = tree();
    let _ = writeln!(s, "\n## Commands\n");
    for sub in visible(&top) {
        let about = sub.get_about().map(|a| a.to_string()).unwrap_or_default();
        let first = first_sentence(&about);
        let _ = writeln!(
            s,
            "- [`hyptrace {0}`](#hyptrace-{0}): {first}",
            sub.get_name()
        );
    }
    command_md(&mut s, &top, "hyptrace", 2);
    s
}

/// The text up to its first full stop (not one of "e.g." or "i.e.").
fn first_sentence(text: &str) -> &str {
    let mut from = 0;
    while let Some(i) = text[from..].find(". ").map(|i| i + from) {
        if !(text[..i].ends_with("e.g") || text[..i].ends_with("i.e")) {
            return &text[..i];
        }
        from = i + 2;
    }
    text.trim_end_matches('.')
}

/// Subcommands a user sees (not `help`, not hidden).
fn visible(c: &Command) -> impl Iterator<Item = &Command> {
    c.get_subcommands()
        .filter(|s| !s.is_hide_set() && s.get_name() != "help")
}

fn command_md(s: &mut String, c: &Command, name: &str, depth: usize) {
    let _ = writeln!(s, "\n{} {name}\n", "#".repeat(depth));
    let about = c.get_long_about().or_else(|| c.get_about());
    if let Some(a) = about {
        let _ = writeln!(s, "{}\n", a.to_string().trim_end());
    }
    let usage = c.clone().bin_name(name).render_usage().to_string();
    let usage = usage.trim_start_matches("Usage: ");
    let _ = writeln!(s, "```\n{usage}\n```\n");
    let args: Vec<&Arg> = c
        .get_arguments()
        .filter(|a| !a.is_hide_set() && !matches!(a.get_id().as_str(), "help" | "version"))
        .collect();
    if !args.is_empty() {
        for a in args {
            let _ = writeln!(s, "- {}", arg_md(a));
        }
        let _ = writeln!(s);
    }
    if let Some(after) = c.get_after_long_help().or_else(|| c.get_after_help()) {
        let _ = writeln!(s, "```text\n{}\n```\n", after.to_string().trim_end());
    }
    for sub in visible(c) {
        command_md(s, sub, &format!("{name} {}", sub.get_name()), depth + 1);
    }
}

/// One option or argument: its spelling, value, help, default and values.
fn arg_md(a: &Arg) -> String {
    let takes = matches!(a.get_action(), ArgAction::Set | ArgAction::Append);
    let value = a
        .get_value_names()
        .map(|v| {
            v.iter()
                .map(|n| format!("<{n}>"))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .filter(|_| takes)
        .unwrap_or_default();
    let mut names = Vec::new();
    if let Some(c) = a.get_short() {
        names.push(format!("-{c}"));
    }
    if let Some(l) = a.get_long() {
        names.push(format!("--{l}"));
    }
    let spelled = if names.is_empty() {
        value.clone()
    } else if value.is_empty() {
        names.join(", ")
    } else {
        format!("{} {value}", names.join(", "))
    };
    let help = a
        .get_long_help()
        .or_else(|| a.get_help())
        .map(|h| h.to_string().replace('\n', " "))
        .unwrap_or_default();
    let mut line = format!("`{spelled}`: {help}");
    // A flag's or a counter's default (false, 0) says nothing.
    let flag = matches!(
        a.get_action(),
        ArgAction::SetTrue | ArgAction::SetFalse | ArgAction::Count
    );
    let defaults: Vec<String> = a
        .get_default_values()
        .iter()
        .map(|d| d.to_string_lossy().into_owned())
        .collect();
    if !defaults.is_empty() && !flag && !a.is_hide_default_value_set() {
        let _ = write!(line, " (default: `{}`).", defaults.join(","));
    }
    let values: Vec<String> = a
        .get_possible_values()
        .iter()
        .filter(|v| !v.is_hide_set())
        .map(|v| match v.get_help() {
            Some(h) => format!("`{}` ({h})", v.get_name()),
            None => format!("`{}`", v.get_name()),
        })
        .collect();
    if !values.is_empty() && !flag {
        let _ = write!(line, " Values: {}.", values.join(", "));
    }
    line
}
