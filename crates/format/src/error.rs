//! Errors of the format crate.

/// A `format` or `header_page` text that cannot be parsed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    /// An event `format` file is malformed.
    #[error("event format ({system}): {reason}")]
    Event {
        /// The system the file was stored under.
        system: String,
        /// What is wrong (`bad ID`, `bad field line`, `no name`, `no ID`).
        reason: &'static str,
    },
    /// A `header_page` text lacks a field every page has.
    #[error("header_page has no {0} field")]
    HeaderPage(&'static str),
}
