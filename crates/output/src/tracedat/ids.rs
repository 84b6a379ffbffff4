//! The numbers of the trace.dat format both the writer and the reader use: the magic
//! and the option and section ids.

/// The magic at the start of every trace.dat: `17 08 44 "tracing"`.
pub const MAGIC: &[u8; 10] = b"\x17\x08\x44tracing";

/// Option / section ids (trace-cmd's `TRACECMD_OPTION_*`).
pub mod option {
    /// End of an options block (v7: u64 offset of the next options section, or 0).
    pub const DONE: u16 = 0;
    /// Date offset.
    pub const DATE: u16 = 1;
    /// Per-CPU stats text.
    pub const CPUSTAT: u16 = 2;
    /// A buffer (v6: instance; v7: flyrecord data of a buffer).
    pub const BUFFER: u16 = 3;
    /// Trace clock text.
    pub const TRACECLOCK: u16 = 4;
    /// `uname` text.
    pub const UNAME: u16 = 5;
    /// Hook.
    pub const HOOK: u16 = 6;
    /// Timestamp offset.
    pub const OFFSET: u16 = 7;
    /// CPU count (u32).
    pub const CPUCOUNT: u16 = 8;
    /// trace-cmd version text.
    pub const VERSION: u16 = 9;
    /// Process maps.
    pub const PROCMAPS: u16 = 10;
    /// Trace id (u64).
    pub const TRACEID: u16 = 11;
    /// Time shift (host/guest).
    pub const TIME_SHIFT: u16 = 12;
    /// Guest info.
    pub const GUEST: u16 = 13;
    /// TSC → ns conversion: u32 mult, u32 shift, u64 offset.
    pub const TSC2NSEC: u16 = 14;
    /// v7 strings section.
    pub const STRINGS: u16 = 15;
    /// v7 header_page + header_event section.
    pub const HEADER_INFO: u16 = 16;
    /// v7 ftrace event formats section.
    pub const FTRACE_EVENTS: u16 = 17;
    /// v7 event formats section.
    pub const EVENT_FORMATS: u16 = 18;
    /// v7 kallsyms section.
    pub const KALLSYMS: u16 = 19;
    /// v7 printk formats section.
    pub const PRINTK: u16 = 20;
    /// v7 saved cmdlines section.
    pub const CMDLINES: u16 = 21;
    /// v7 latency text buffer.
    pub const BUFFER_TEXT: u16 = 22;
}
