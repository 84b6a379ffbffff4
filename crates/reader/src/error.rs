//! The reader's errors.

use std::time::Duration;

use hyptrace_abi::layout::LayoutError;
use hyptrace_abi::page;

/// Errors of the reader. Most mean the shared region is inconsistent: the writer is
/// buggy, crashed mid-operation, or hostile.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ReadError {
    /// The pack or layout is invalid (why: the source).
    #[error("trace region")]
    RingGeometry(#[source] LayoutError),
    /// A writer-domain operation failed.
    #[error("cpu {cpu}: {err}")]
    Ring {
        /// The CPU.
        cpu: u32,
        /// What went wrong.
        err: hyptrace_writer::RingError,
    },
    /// No such CPU.
    #[error("cpu {0} out of range")]
    BadCpu(u32),
    /// A page id read from the region is not one of the CPU's pages.
    #[error("cpu {cpu}: page id {id} outside its pages")]
    BadPageId {
        /// The CPU.
        cpu: u32,
        /// The id.
        id: u64,
    },
    /// A page's commit is past its data area or went backwards.
    #[error("cpu {cpu}: page {page}: bad commit {commit:#x} (had {had} bytes)")]
    BadCommit {
        /// The CPU.
        cpu: u32,
        /// The page.
        page: u32,
        /// The commit word.
        commit: u64,
        /// Bytes already seen.
        had: usize,
    },
    /// Event data did not decode.
    #[error("cpu {cpu}: page {page}: {err}")]
    Decode {
        /// The CPU.
        cpu: u32,
        /// The page.
        page: u32,
        /// The decoder's error.
        err: page::DecodeError,
    },
    /// A page's first event index is before events already read.
    #[error("cpu {cpu}: page {page} starts at event {first}, before {expected}")]
    IndexBackwards {
        /// The CPU.
        cpu: u32,
        /// The page.
        page: u32,
        /// Its first index.
        first: u64,
        /// Index expected.
        expected: u64,
    },
    /// Released pages: the link of a page the writer left is not one it moved along (a
    /// flagged link, or one naming the page itself).
    #[error("cpu {cpu}: page {page} was left by the writer through link {link:#x}, which no writer of ours leaves")]
    BadLink {
        /// The CPU.
        cpu: u32,
        /// The page the writer left.
        page: u32,
        /// Its link word.
        link: u64,
    },
    /// Released pages: a reader attached to a ring another reader has released pages of
    /// (where that reader stood is not in the ring: it would read pages the writer may
    /// rewrite).
    #[error("cpu {cpu}: another reader released pages of this ring up to page_seq {released}; a reader with released pages can only start on a fresh ring")]
    AlreadyReleased {
        /// The CPU.
        cpu: u32,
        /// The control block's `released`.
        released: u64,
    },
    /// A swap reported success but the reader page did not change.
    #[error("cpu {cpu}: swap reported success but reader page stayed {page}")]
    SwapNoProgress {
        /// The CPU.
        cpu: u32,
        /// The reader page.
        page: u32,
    },
    /// A footer counter went backwards.
    #[error("cpu {cpu}: footer counter {what} went backwards ({old} -> {new})")]
    CounterBackwards {
        /// The CPU.
        cpu: u32,
        /// Which counter.
        what: &'static str,
        /// Previous value.
        old: u64,
        /// New value.
        new: u64,
    },
    /// A footer is not ours (magic or id).
    #[error("cpu {cpu}: page {page}: bad footer")]
    BadFooter {
        /// The CPU.
        cpu: u32,
        /// The page.
        page: u32,
    },
    /// Two pages claim the same sequence number in the final walk.
    #[error("cpu {cpu}: pages {a} and {b} have the same sequence number")]
    DuplicateSeq {
        /// The CPU.
        cpu: u32,
        /// One page.
        a: u32,
        /// The other.
        b: u32,
    },
    /// The writer did not answer a mailbox request in time.
    #[error(
        "cpu {cpu}: the guest writer did not answer the mailbox within {timeout:?} (stuck writer?)"
    )]
    MailboxTimeout {
        /// The CPU.
        cpu: u32,
        /// The timeout.
        timeout: Duration,
    },
    /// The writer has finished (it serves no more mailbox requests): read the rest with
    /// [`RingBuffer::finalize`](crate::RingBuffer::finalize).
    #[error("cpu {cpu}: the writer has finished")]
    WriterStopped {
        /// The CPU.
        cpu: u32,
    },
    /// The writer answered a mailbox request with a failure.
    #[error("cpu {cpu}: the guest writer failed a mailbox request (status {status})")]
    MailboxFailed {
        /// The CPU.
        cpu: u32,
        /// The status.
        status: u64,
    },
    /// A configuration value is invalid.
    #[error("{0}")]
    Config(String),
}

impl From<LayoutError> for ReadError {
    fn from(e: LayoutError) -> Self {
        Self::RingGeometry(e)
    }
}
