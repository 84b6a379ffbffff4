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

/// `e`'s text followed by every source whose text it does not already carry: how every
/// error reaches the user (one line; a cause an error's own text names is not repeated).
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut next = e.source();
    // Bounded: error chains are finite, but a cycle would not be.
    for _ in 0..16 {
        let Some(src) = next else { break };
        let s = src.to_string();
        if !text.contains(&s) {
            text.push_str(": ");
            text.push_str(&s);
        }
        next = src.source();
    }
    text
}
