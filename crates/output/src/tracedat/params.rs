//! What a trace.dat is written with: its version, its compression, and the sizes of its
//! zstd chunks and of the batches of chunks a worker takes (the metadata's, the CPU
//! data's and the compression workers' one choice).

/// Which trace.dat version to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceDatVersion {
    /// Version 6 (flat metadata, flyrecord table).
    V6,
    /// Version 7 (sections and options; written uncompressed).
    V7,
}

/// How the CPU data and the metadata sections of a v7 trace.dat are stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Compression {
    /// Uncompressed (pages copied verbatim, page aligned).
    None,
    /// zstd, as `trace-cmd record` writes by default: each CPU's pages in chunks of
    /// [`ZSTD_CHUNK_PAGES`] pages (one zstd frame each), the metadata sections (headers,
    /// formats, kallsyms, printk, cmdlines, strings) compressed; options uncompressed.
    /// Version 6 has no compression: a v6 file is always written uncompressed.
    #[default]
    Zstd,
}

/// Pages per compressed chunk (trace-cmd's own chunk: `PAGES_IN_CHUNK`, 10 pages).
pub const ZSTD_CHUNK_PAGES: usize = 10;

/// zstd chunks a CPU gathers before they go to a worker together (one hand-over, one
/// wake-up, one turn at the CPU's data for all of them).
pub(super) const BATCH_CHUNKS: usize = 4;
/// Bytes of one zstd chunk: trace-cmd's 10 pages of 4 KiB. Larger pages make chunks of
/// fewer pages (at least one), and batches of fewer chunks, so that the memory a sink
/// holds in flight does not follow the page size (64 MiB pages: issue 36's bound).
pub(super) const ZSTD_CHUNK_BYTES: usize = ZSTD_CHUNK_PAGES * 4096;

/// Pages of one zstd chunk for pages of `page_size` bytes.
pub(super) fn chunk_pages(page_size: usize) -> usize {
    (ZSTD_CHUNK_BYTES / page_size.max(1)).clamp(1, ZSTD_CHUNK_PAGES)
}

/// Chunks of one batch for chunks of `chunk` bytes.
pub(super) fn batch_chunks(chunk: usize) -> usize {
    (BATCH_CHUNKS * ZSTD_CHUNK_BYTES / chunk.max(1)).clamp(1, BATCH_CHUNKS)
}
