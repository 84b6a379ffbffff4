//! The one budget of what a trace.dat may make the reader allocate or decompress
//! (docs/output.md "Hostile input"): nothing the reader allocates follows a number in
//! the file unchecked.
//!
//! - **Metadata** ([`Budget`], [`METADATA_BUDGET`]): every byte of metadata read into
//!   memory or decompressed (options sections, headers, formats, kallsyms, printk,
//!   cmdlines) counts once, and what is kept of it (the options the reader uses, formats
//!   and their printers, cmdlines, symbols) counts again at its estimated size in memory
//!   (the `*_cost` functions, measured). Past the budget a section or item is not read:
//!   noted as damage, the rest of the file is read.
//! - **CPU data** ([`READ_BUDGET`]): the read buffers of all CPUs together: a batch of
//!   pages per CPU (uncompressed) or one decompressed chunk per CPU ([`max_chunk`], at
//!   most [`MAX_CHUNK`] whatever the page size). A file whose CPUs cannot each hold one
//!   page within it is refused at `open`.
//! - **Decompression** ([`unzstd_into`]): a block (a chunk or a section) decompresses to
//!   exactly the size it declares, which is at most its cap and at most [`MAX_RATIO`]
//!   times its compressed size.

use crate::error::{BlockProblem, BudgetOver, DatProblem, UnsupportedDat};
use crate::DatError;

/// Metadata read, decompressed and kept, all sections and items of a file together.
pub const METADATA_BUDGET: u64 = 128 << 20;
/// The part of [`METADATA_BUDGET`] the options sections may take (their bytes read or
/// decompressed): real ones hold a few KiB (a buffer option of 65536 CPUs 1.3 MB), and
/// read first, they must not leave the formats nothing.
pub const OPTIONS_SHARE: u64 = 32 << 20;
/// Read buffers of all CPUs together (see [`max_chunk`]; uncompressed data is read a
/// batch of whole pages at a time, 1 MiB for all CPUs together).
pub const READ_BUDGET: u64 = 256 << 20;
/// The largest decompressed chunk of CPU data accepted, whatever the page size: ten
/// pages of 16 MiB (the largest ring page hyptrace records), trace-cmd's chunk of such
/// pages.
pub const MAX_CHUNK: usize = 160 << 20;
/// Most a zstd block may decompress to per byte of its compressed size. Real trace
/// data is far below it: trace-cmd kernel traces 4–12×, hyptrace marker pages 6–9×,
/// metadata 4–10×, and ten 4 KiB pages holding one event each (the sparsest pages a
/// live read takes) about 230×; a chunk of zero pages reaches 1700× (ten 4 KiB pages)
/// to 29000× (16 MiB).
pub const MAX_RATIO: u64 = 1024;
/// Largest decompressed metadata section accepted.
pub(super) const MAX_SECTION: usize = 64 << 20;
/// Bytes of uncompressed CPU data read at a time, for all CPUs together (each CPU reads
/// at least one page at a time).
const PLAIN_BATCHES: usize = 1 << 20;
/// Most bytes a CPU reads at a time.
pub(super) const MAX_BATCH: usize = 128 << 10;

/// What the metadata of one file has taken of [`METADATA_BUDGET`].
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Budget {
    used: u64,
    /// Taken by options sections (at most [`OPTIONS_SHARE`]).
    options: u64,
}

impl Budget {
    /// Takes `n` bytes; false, taking nothing, when they do not fit.
    pub(super) fn take(&mut self, n: u64) -> bool {
        match self.used.checked_add(n) {
            Some(u) if u <= METADATA_BUDGET => {
                self.used = u;
                true
            }
            _ => false,
        }
    }

    /// Takes `n` bytes of an options section, within [`OPTIONS_SHARE`] too.
    pub(super) fn take_options(&mut self, n: u64) -> bool {
        let fits = self
            .options
            .checked_add(n)
            .is_some_and(|o| o <= OPTIONS_SHARE);
        fits && self.take(n) && {
            self.options += n;
            true
        }
    }

    /// `n` bytes that did not fit, with the budget (the end of a damage note).
    pub(super) fn over(&self, n: u64) -> BudgetOver {
        BudgetOver {
            bytes: n,
            budget_mib: METADATA_BUDGET >> 20,
            options_mib: OPTIONS_SHARE >> 20,
            used_mib: self.used >> 20,
            options_used_mib: self.options >> 20,
        }
    }
}

/// Memory of a kept option of `len` bytes of data.
pub(super) fn option_cost(len: usize) -> u64 {
    64 + len as u64
}

/// Memory of an event format parsed from a text of `len` bytes, with its printer
/// (measured: 480 bytes for a 37-byte format, 7.9× the text for real ones).
pub(super) fn format_cost(len: usize) -> u64 {
    640 + 10 * len as u64
}

/// Memory of a saved cmdline (measured: 90 bytes with a short comm).
pub(super) fn cmdline_cost(comm: usize) -> u64 {
    96 + comm as u64
}

/// Memory of a kallsyms or printk line of `len` bytes (measured: 56 and 84 bytes for
/// 26-byte lines).
pub(super) fn symbol_cost(len: usize) -> u64 {
    96 + len as u64
}

/// The largest decompressed chunk each of `readers` CPUs may hold: an equal share of
/// [`READ_BUDGET`], at most [`MAX_CHUNK`] (4096 CPUs: 64 KiB each, trace-cmd writes 10
/// pages, 40 KiB of 4 KiB pages).
pub fn max_chunk(readers: usize) -> usize {
    let share = READ_BUDGET / readers.max(1) as u64;
    share.min(MAX_CHUNK as u64) as usize
}

/// Bytes of uncompressed CPU data read at a time when `readers` CPUs are read: whole
/// pages, at least one, at most [`MAX_BATCH`], 1 MiB for all CPUs together.
pub(super) fn plain_batch(readers: usize, page_size: usize) -> usize {
    let pages = (PLAIN_BATCHES / readers.max(1)).min(MAX_BATCH) / page_size.max(1);
    pages.max(1) * page_size
}

/// Why `readers` CPUs of `page_size`-byte pages cannot be read within [`READ_BUDGET`]
/// (each needs at least one page), or `None`.
pub(super) fn check_read_memory(readers: usize, page_size: usize) -> Option<UnsupportedDat> {
    let need = (readers as u64).saturating_mul(page_size as u64);
    (need > READ_BUDGET).then_some(UnsupportedDat::ReadMemory {
        readers,
        page_size,
        need_mib: need >> 20,
        budget_mib: READ_BUDGET >> 20,
    })
}

/// The most a zstd frame of `n` bytes of content takes (zstd's ZSTD_COMPRESSBOUND,
/// rounded up).
fn zstd_bound(n: usize) -> usize {
    n.saturating_add(n >> 8).saturating_add(64 << 10)
}

/// Why a zstd block declaring `us` bytes from `cs` compressed bytes is refused (more
/// than `cap`, a ratio above [`MAX_RATIO`], or more compressed bytes than any frame of
/// `us` bytes takes), or `None`.
pub(super) fn check_block(cs: usize, us: usize, cap: usize) -> Option<BlockProblem> {
    if cs > zstd_bound(us) {
        Some(BlockProblem::Bound { cs, us })
    } else if us > cap {
        Some(BlockProblem::Cap { us, cap })
    } else if us as u64 > (cs as u64).saturating_mul(MAX_RATIO) {
        Some(BlockProblem::Ratio {
            us,
            cs,
            ratio: MAX_RATIO,
        })
    } else {
        None
    }
}

/// zstd-decompresses `input` into `out` (resized to exactly `size` bytes, which
/// [`check_block`] accepted): libzstd's one-shot decompression into a fixed buffer (no
/// window allocated; a frame that would need more than `size` bytes is an error).
pub(super) fn unzstd_into(
    dec: &mut zstd::bulk::Decompressor<'static>,
    input: &[u8],
    size: usize,
    out: &mut Vec<u8>,
    at: u64,
) -> Result<(), DatError> {
    out.clear();
    out.resize(size, 0);
    let n = dec
        .decompress_to_buffer(input, out.as_mut_slice())
        .map_err(|e| DatError::format(at, DatProblem::Zstd(e)))?;
    if n != size {
        return Err(DatError::format(
            at,
            DatProblem::ZstdSize { got: n, want: size },
        ));
    }
    Ok(())
}

/// A zstd decompression context.
pub(super) fn decompressor(at: u64) -> Result<zstd::bulk::Decompressor<'static>, DatError> {
    zstd::bulk::Decompressor::new().map_err(|e| DatError::format(at, DatProblem::Zstd(e)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_takes_what_fits() {
        let mut b = Budget::default();
        assert!(b.take(METADATA_BUDGET - 10));
        assert!(!b.take(11));
        assert!(!b.take(u64::MAX));
        assert!(b.take(10));
        assert!(!b.take(1));
        assert!(b.take(0));
        // Options sections: within their share and the whole budget.
        let mut b = Budget::default();
        assert!(b.take_options(OPTIONS_SHARE - 1));
        assert!(!b.take_options(2));
        assert!(b.take(METADATA_BUDGET - OPTIONS_SHARE + 1));
        assert!(!b.take_options(1));
    }

    /// Chunk caps do not grow with the page size.
    #[test]
    fn chunk_caps() {
        assert_eq!(max_chunk(1), MAX_CHUNK);
        assert_eq!(max_chunk(0), MAX_CHUNK);
        assert_eq!(max_chunk(64), 4 << 20);
        assert_eq!(max_chunk(4096), 64 << 10);
        assert!(check_read_memory(4096, 4096).is_none());
        assert!(check_read_memory(65536, 4096).is_none());
        assert!(check_read_memory(65536, 8192).is_some());
        assert!(check_read_memory(4, 1 << 26).is_none());
        assert!(check_read_memory(5, 1 << 26).is_some());
    }

    #[test]
    fn blocks_past_their_cap_or_ratio_are_refused() {
        assert!(check_block(100, 1024 * 100, 1 << 20).is_none());
        assert!(check_block(100, 1024 * 100 + 1, 1 << 20).is_some());
        assert!(check_block(1 << 20, (1 << 20) + 1, 1 << 20).is_some());
        assert!(check_block(0, 1, 1 << 20).is_some());
        assert!(check_block(0, 0, 0).is_none());
        assert!(check_block(zstd_bound(4096), 4096, 1 << 20).is_none());
        assert!(check_block(zstd_bound(4096) + 1, 4096, 1 << 20).is_some());
    }
}
