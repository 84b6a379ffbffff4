//! Exit codes and the one way to say a line on stderr. The bottom of host/: every layer
//! may use it, it uses none. The mapping of a failure to its code lives with the error
//! types of each layer (`exit_code()`), and [`crate::cli`] turns the outcome of a
//! command into the process's exit status.

/// Success.
pub const EXIT_OK: i32 = 0;
/// A failure at run time (host side).
pub const EXIT_RUNTIME: i32 = 1;
/// Bad input or environment.
pub const EXIT_USAGE: i32 = 2;
/// The guest crashed.
pub const EXIT_CRASH: i32 = 3;
/// Aborted by a second Ctrl-C / SIGTERM (128 + SIGINT, what shells report).
pub const EXIT_ABORT: i32 = 130;

/// `eprintln!` that never panics: stderr may be a closed pipe (`2>&1 | head`).
macro_rules! note {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// `e`'s text followed by the text of each of its sources, `a: b: c`: how every error
/// reaches the user (one line). The convention of every error type of the workspace
/// (issue 26, the Rust API guidelines'): an error's own text does not include the source
/// it exposes through `source()`, so each cause is printed once, here. A source whose
/// text the line already carries (an I/O error's path its wrapper named, or a foreign
/// error that prints its own source) is not repeated. Keeps X1 (docs/design.md).
///
/// The line is [`printable`]: user and guest text an error echoes (a pattern, a path,
/// a guest's string) cannot end the line or drive the terminal.
pub fn chain(e: &dyn std::error::Error) -> String {
    printable(&hyptrace_output::error_chain(e)).into_owned()
}

/// User or guest text made safe for one line of a message: control characters (ESC,
/// newlines, C1, bidirectional controls) as C escapes (`\x1b`, `\n`, `\u{202e}`),
/// everything else as is (`hyptrace_output::escape_guest_str`, the one escaping of
/// text output and messages).
pub fn printable(s: &str) -> std::borrow::Cow<'_, str> {
    hyptrace_output::escape_guest_str(s)
}

#[cfg(test)]
mod tests {
    use super::chain;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot write {0}")]
    struct Write(String, #[source] Io);

    /// An I/O error naming its path, as `hyptrace_output::OutputError::Io` does.
    #[derive(Debug, thiserror::Error)]
    #[error("{0}")]
    struct Io(String, #[source] std::io::Error);

    /// A foreign error that prints its source itself.
    #[derive(Debug, thiserror::Error)]
    #[error("bad: {0}")]
    struct Loud(#[source] std::io::Error);

    fn enospc() -> std::io::Error {
        std::io::Error::from_raw_os_error(libc::ENOSPC)
    }

    /// Text an error echoes (a user's pattern with an ESC, a path with a newline) is
    /// escaped: the line stays one line and cannot drive the terminal.
    #[test]
    fn echoed_text_is_escaped() {
        let e = Write("\x1b[2J/a\nb".into(), Io("/b".into(), enospc()));
        assert_eq!(
            chain(&e),
            format!("cannot write \\x1b[2J/a\\nb: /b: {}", enospc())
        );
    }

    #[test]
    fn each_cause_once_in_order() {
        let e = Write("/dev/full".into(), Io("/dev/full".into(), enospc()));
        assert_eq!(chain(&e), format!("cannot write /dev/full: {}", enospc()));
        let e = Write("/a".into(), Io("/b".into(), enospc()));
        assert_eq!(chain(&e), format!("cannot write /a: /b: {}", enospc()));
    }

    #[test]
    fn a_cause_already_printed_is_not_repeated() {
        let e = Loud(enospc());
        assert_eq!(chain(&e), format!("bad: {}", enospc()));
        assert_eq!(chain(&enospc()), enospc().to_string());
    }
}
