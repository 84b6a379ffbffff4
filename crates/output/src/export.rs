//! The exported copy of a ring page that every sink writes.
//!
//! A ring page is `header (16) + data + private footer`. The exported copy keeps the
//! header and the committed data, zeroes everything after `16 + commit_len` (the footer
//! is ours, not Linux's), and, after a counted loss, sets `RB_MISSED_EVENTS |
//! RB_MISSED_STORED` in `commit` and stores the u64 count at `data + commit_len`, which is
//! where trace-cmd looks for it (`CPU:N [K EVENTS DROPPED]`); after a loss of unknown
//! count, `RB_MISSED_EVENTS` alone (`CPU:N [EVENTS DROPPED]`).

use crate::error::{MetaError, PageProblem};
use hyptrace_abi::page::{
    page_header, COMMIT_LEN_MASK, COMMIT_OFFSET, PAGE_HEADER_SIZE, RB_MISSED_EVENTS,
    RB_MISSED_STORED,
};

use crate::OutputError;

/// Smallest page size accepted (the kernel's and trace-cmd's minimum).
pub const MIN_PAGE_SIZE: usize = 4096;
/// Largest page size accepted (trace-cmd masks `commit` with 27 bits).
pub const MAX_PAGE_SIZE: usize = 1 << 26;

/// Checks that `page_size` is a power of two in `MIN_PAGE_SIZE..=MAX_PAGE_SIZE`.
pub fn check_page_size(page_size: usize) -> Result<(), OutputError> {
    if page_size.is_power_of_two() && (MIN_PAGE_SIZE..=MAX_PAGE_SIZE).contains(&page_size) {
        Ok(())
    } else {
        Err(OutputError::Meta(MetaError::PageSize(page_size)))
    }
}

/// Committed data length of a page (the `commit` word without its flags).
pub fn commit_len(page: &[u8]) -> Option<usize> {
    page_header(page).map(|(_, c)| (c & COMMIT_LEN_MASK) as usize)
}

/// Writes the exported copy of ring page `raw` into `out` (same length as `raw`).
///
/// `missed`: [`Missed::Count`] `(n)` with `n > 0` marks `n` events lost before this page
/// (both flags and the count); [`Missed::Unknown`] marks a loss of unknown count
/// (`RB_MISSED_EVENTS` alone, no count stored); [`Missed::None`] or `Count(0)`: no loss.
/// Fails if the page is shorter than its header, if the committed
/// data (plus the 8-byte count after a loss) runs past the page, or if `out` has another
/// length.
pub fn export_page_into(
    cpu: u32,
    raw: &[u8],
    missed: Missed,
    out: &mut [u8],
) -> Result<(), OutputError> {
    let bad = |problem: PageProblem| OutputError::BadPage { cpu, problem };
    if out.len() != raw.len() {
        return Err(bad(PageProblem::OutputSize {
            out: out.len(),
            len: raw.len(),
        }));
    }
    let (_, commit) = page_header(raw).ok_or_else(|| bad(PageProblem::Short(raw.len())))?;
    let len = (commit & COMMIT_LEN_MASK) as usize;
    let end = PAGE_HEADER_SIZE + len;
    let need = end + if missed.is_counted() { 8 } else { 0 };
    if need > raw.len() {
        return Err(bad(PageProblem::CommitPast {
            commit: len,
            len: raw.len(),
        }));
    }
    out[..end].copy_from_slice(&raw[..end]);
    out[end..].fill(0);
    let mut word = len as u64;
    match missed {
        Missed::Count(n) if n > 0 => {
            word |= RB_MISSED_EVENTS | RB_MISSED_STORED;
            out[end..end + 8].copy_from_slice(&n.to_le_bytes());
        }
        Missed::Unknown => word |= RB_MISSED_EVENTS,
        Missed::Count(_) | Missed::None => {}
    }
    out[COMMIT_OFFSET..COMMIT_OFFSET + 8].copy_from_slice(&word.to_le_bytes());
    Ok(())
}

/// Returns the exported copy of ring page `raw` (see [`export_page_into`]).
pub fn export_page(cpu: u32, raw: &[u8], missed: Missed) -> Result<Vec<u8>, OutputError> {
    let mut out = vec![0u8; raw.len()];
    export_page_into(cpu, raw, missed, &mut out)?;
    Ok(out)
}

/// What an exported (or trace.dat) page says about losses before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Missed {
    /// No loss.
    None,
    /// Events were lost, count unknown (`RB_MISSED_EVENTS` only).
    Unknown,
    /// This many events were lost.
    Count(u64),
}

impl Missed {
    /// A stored count: `Count(n)` with `n > 0` (`n` events lost).
    pub fn is_counted(self) -> bool {
        matches!(self, Missed::Count(n) if n > 0)
    }

    /// Some loss, counted (`n > 0`) or not.
    pub fn is_loss(self) -> bool {
        self == Missed::Unknown || self.is_counted()
    }

    /// `Count(n)` for `n > 0`, else `None` (the reader's drain counts losses).
    pub fn count(n: u64) -> Self {
        if n > 0 {
            Missed::Count(n)
        } else {
            Missed::None
        }
    }

    /// The counted events (`Unknown` and `None`: 0; say an unknown loss elsewhere).
    pub fn counted(self) -> u64 {
        match self {
            Missed::Count(n) => n,
            Missed::Unknown | Missed::None => 0,
        }
    }
}

/// Reads the loss information of an exported page: flags in `commit`, count at
/// `data + commit_len` (`Unknown` if the count would run past the page).
pub fn page_missed(page: &[u8]) -> Missed {
    let Some((_, commit)) = page_header(page) else {
        return Missed::None;
    };
    if commit & RB_MISSED_EVENTS == 0 {
        return Missed::None;
    }
    if commit & RB_MISSED_STORED == 0 {
        return Missed::Unknown;
    }
    let at = PAGE_HEADER_SIZE + (commit & COMMIT_LEN_MASK) as usize;
    match page.get(at..at + 8) {
        Some(b) => {
            let mut w = [0u8; 8];
            w.copy_from_slice(b);
            Missed::Count(u64::from_le_bytes(w))
        }
        None => Missed::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring_page(size: usize, commit: usize) -> Vec<u8> {
        let mut p = vec![0xAAu8; size];
        p[..8].copy_from_slice(&77u64.to_le_bytes());
        p[8..16].copy_from_slice(&(commit as u64).to_le_bytes());
        p
    }

    #[test]
    fn zeroes_tail_and_stores_missed() {
        let raw = ring_page(4096, 100);
        let e = export_page(0, &raw, Missed::None).unwrap();
        assert_eq!(&e[..116], &raw[..116]);
        assert!(e[116..].iter().all(|&b| b == 0));
        assert_eq!(page_missed(&e), Missed::None);
        let e = export_page(0, &raw, Missed::Count(42)).unwrap();
        assert_eq!(
            u64::from_le_bytes(e[8..16].try_into().unwrap()),
            100 | RB_MISSED_EVENTS | RB_MISSED_STORED
        );
        assert_eq!(u64::from_le_bytes(e[116..124].try_into().unwrap()), 42);
        assert!(e[124..].iter().all(|&b| b == 0));
        assert_eq!(page_missed(&e), Missed::Count(42));
        // Unknown: the flag alone, no count stored after the data.
        let e = export_page(0, &raw, Missed::Unknown).unwrap();
        assert_eq!(
            u64::from_le_bytes(e[8..16].try_into().unwrap()),
            100 | RB_MISSED_EVENTS
        );
        assert!(e[116..].iter().all(|&b| b == 0));
        assert_eq!(page_missed(&e), Missed::Unknown);
        assert_eq!(
            export_page(0, &raw, Missed::Count(0)).unwrap(),
            export_page(0, &raw, Missed::None).unwrap()
        );
    }

    #[test]
    fn rejects_bad_pages() {
        assert!(export_page(0, &[0u8; 8], Missed::None).is_err());
        assert!(export_page(0, &ring_page(4096, 4081), Missed::None).is_err());
        assert!(export_page(0, &ring_page(4096, 4080), Missed::None).is_ok());
        assert!(export_page(0, &ring_page(4096, 4080), Missed::Count(1)).is_err());
        assert!(export_page(0, &ring_page(4096, 4072), Missed::Count(1)).is_ok());
        // An unknown count stores nothing: a full page can carry it.
        assert!(export_page(0, &ring_page(4096, 4080), Missed::Unknown).is_ok());
        // Flags in the ring's commit word are dropped; only the length is kept.
        let mut raw = ring_page(4096, 8);
        raw[8..16].copy_from_slice(&(8 | RB_MISSED_EVENTS).to_le_bytes());
        let e = export_page(0, &raw, Missed::None).unwrap();
        assert_eq!(u64::from_le_bytes(e[8..16].try_into().unwrap()), 8);
        assert!(check_page_size(4096).is_ok() && check_page_size(16384).is_ok());
        assert!(check_page_size(2048).is_err() && check_page_size(5000).is_err());
    }
}
