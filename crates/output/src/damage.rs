//! What a reader of damaged input skipped (its constructors are the trace.dat reader's,
//! `tracedat::read`; the type is here, below both that reader and the errors that
//! carry it).

/// A damaged part of a trace.dat that reading went past (docs/output.md "Damaged
/// files"): a section that could not be read, a compressed chunk that did not
/// decompress, CPU data cut short by the end of the file, a page that did not decode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Damage {
    /// The CPU whose data it is (`None`: metadata).
    pub cpu: Option<u32>,
    /// File offset where it was found (`None`: not known, e.g. a page of a
    /// decompressed chunk).
    pub offset: Option<u64>,
    /// What is damaged and what was skipped.
    pub what: String,
}

impl std::fmt::Display for Damage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(cpu) = self.cpu {
            write!(f, "cpu {cpu}: ")?;
        }
        if let Some(at) = self.offset {
            write!(f, "offset {at}: ")?;
        }
        f.write_str(&self.what)
    }
}
