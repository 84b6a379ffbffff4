//! Errors of the ClickHouse output.

pub use crate::url::UrlError;

/// Everything that can go wrong talking to ClickHouse.
#[derive(Debug, thiserror::Error)]
pub enum ClickHouseError {
    /// The `clickhouse://` URL is bad (the user's: exit 2).
    #[error(transparent)]
    Url(#[from] UrlError),
    /// No HTTP answer: refused, reset, timed out, name not resolved.
    #[error("ClickHouse at {addr} is unreachable ({kind})")]
    Unreachable {
        /// `HOST:PORT`.
        addr: String,
        /// What failed (`Connection Failed`, `Network Error`, `Dns Failed`...).
        kind: String,
        /// The OS error under it, if any (the transport error without the request's
        /// URL, which repeats the query).
        #[source]
        source: Option<Box<dyn std::error::Error + Send + Sync>>,
    },
    /// The server answered an HTTP error; `text` is the start of its answer (bounded,
    /// made printable).
    #[error("ClickHouse at {addr} answered HTTP {status}: {text}")]
    Status {
        /// `HOST:PORT`.
        addr: String,
        /// HTTP status.
        status: u16,
        /// The server's message.
        text: String,
    },
    /// Reading an answer failed.
    #[error("ClickHouse at {addr}: reading the answer")]
    Read {
        /// `HOST:PORT`.
        addr: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// An answer that is not what the query gives (e.g. a count that is no number).
    #[error("ClickHouse at {addr}: unexpected answer `{text}` to {what}")]
    Answer {
        /// `HOST:PORT`.
        addr: String,
        /// Which query.
        what: &'static str,
        /// The answer (bounded, printable).
        text: String,
    },
    /// A batch is in the table with another row count than was sent (an INSERT of one
    /// block is atomic, so this is another writer's doing): nothing is re-sent.
    #[error("ClickHouse at {addr}: {table} batch {batch} of run {run} holds {found} rows, {sent} were sent")]
    Partial {
        /// `HOST:PORT`.
        addr: String,
        /// `events` or `losses`.
        table: &'static str,
        /// The run id.
        run: String,
        /// The batch number.
        batch: u64,
        /// Rows found.
        found: u64,
        /// Rows sent.
        sent: u64,
    },
    /// A batch could not be stored within the retry time.
    #[error("ClickHouse at {addr}: {table} batch {batch} not stored after {secs} s of retries")]
    GaveUp {
        /// `HOST:PORT`.
        addr: String,
        /// `events` or `losses`.
        table: &'static str,
        /// The batch number.
        batch: u64,
        /// How long it was retried.
        secs: u64,
        /// The last attempt's error.
        #[source]
        last: Box<ClickHouseError>,
    },
    /// A table of the database exists without the columns rows carry (another
    /// program's table, or an old schema): the URL names the wrong database (exit 2).
    #[error("ClickHouse at {addr}: {table} exists without the columns hyptrace writes ({missing}); name another database")]
    Schema {
        /// `HOST:PORT`.
        addr: String,
        /// `DATABASE.TABLE`.
        table: String,
        /// The columns missing or of another type (`name type`, bounded).
        missing: String,
    },
    /// The run was abandoned (a second Ctrl-C) while a batch was being retried.
    #[error("ClickHouse at {addr}: retrying abandoned")]
    Cancelled {
        /// `HOST:PORT`.
        addr: String,
    },
}

impl ClickHouseError {
    /// Whether the user's input is at fault (exit 2) rather than the server (exit 1).
    pub fn is_usage(&self) -> bool {
        matches!(self, Self::Url(_) | Self::Schema { .. })
    }
}

impl From<ClickHouseError> for hyptrace_output::OutputError {
    fn from(e: ClickHouseError) -> Self {
        Self::Sink(Box::new(e))
    }
}

/// Longest part of a server's answer put in a message.
pub(crate) const MAX_TEXT: usize = 400;

/// The first [`MAX_TEXT`] bytes of `b`, as printable text on one line (the server's
/// answers can quote what it was sent: guest bytes).
pub(crate) fn sanitise(b: &[u8]) -> String {
    let b = &b[..b.len().min(MAX_TEXT)];
    let s = String::from_utf8_lossy(b);
    hyptrace_output::escape_guest_str(s.trim_end()).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_bounded_and_printable() {
        let mut b = b"Code: 62, e.displayText() = \x1b[2J\nboom".to_vec();
        b.extend(std::iter::repeat_n(b'x', 10_000));
        let s = sanitise(&b);
        assert!(s.len() < MAX_TEXT + 40, "{}", s.len());
        assert!(!s.contains('\n') && !s.contains('\x1b'), "{s}");
        assert!(s.starts_with("Code: 62"));
    }
}
