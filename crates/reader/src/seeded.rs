//! Seeded bugs of the one-reader design (docs/fuzzing.md): each is a line of product code
//! that does the wrong thing when its bug is selected. Compiled in only with `--cfg
//! hyptrace_seeded_bug_consumer` (one build for all of them; the model selects each in
//! turn, `HYPTRACE_SEEDED_BUG` selects one for a whole process); in every other build
//! [`on`] is `false` and its branches compile away.

/// The seeded bugs the subscriber model must catch (`host/src/control/consumer/model.rs`).
pub const CONSUMER_BUGS: [&str; 4] = [
    "piece_from_start",
    "ack_unchecked",
    "unsend_dropped",
    "end_too_early",
];

#[cfg(hyptrace_seeded_bug_consumer)]
static SELECTED: std::sync::Mutex<Option<&'static str>> = std::sync::Mutex::new(None);

/// Selects `bug` (one of [`CONSUMER_BUGS`]) for this process, until the next call.
#[cfg(hyptrace_seeded_bug_consumer)]
pub fn select(bug: &'static str) {
    *SELECTED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(bug);
}

/// Whether the seeded bug `bug` is on.
#[cfg(hyptrace_seeded_bug_consumer)]
pub fn on(bug: &str) -> bool {
    let selected = *SELECTED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    match selected {
        Some(b) => b == bug,
        None => std::env::var("HYPTRACE_SEEDED_BUG").is_ok_and(|v| v == bug),
    }
}

/// Whether the seeded bug `bug` is on: never in this build.
#[cfg(not(hyptrace_seeded_bug_consumer))]
#[inline(always)]
pub const fn on(_bug: &str) -> bool {
    false
}
