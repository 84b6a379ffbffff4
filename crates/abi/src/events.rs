//! The built-in guest events (system `guest`) and the common trace-event header.
//!
//! Every payload starts with the 8-byte common header that trace-cmd format files
//! describe (`common_type`, `common_flags`, `common_preempt_count`, `common_pid`),
//! followed by the event's own fields, little-endian, at the offsets below. The
//! output crate generates the `format` files from the same constants.

/// Name of the trace-event system the built-in guest events belong to.
pub const SYSTEM: &str = "guest";

/// Size of the common header at the start of every payload.
pub const COMMON_HEADER_SIZE: usize = 8;

/// `guest:marker` — `{ u64 seq @8, u64 value @16 }`, payload 24 bytes.
pub const MARKER_ID: u16 = 1000;
/// `guest:span` — `{ u64 seq @8, u64 id @16, u64 dur @24 }`, payload 32 bytes.
pub const SPAN_ID: u16 = 1001;
/// `guest:text` — `{ u64 seq @8, __data_loc char[] msg @16 }` then the string bytes
/// (NUL-terminated) at offset 20. The `__data_loc` word is `offset | (len << 16)`,
/// where `len` counts the terminating NUL.
pub const TEXT_ID: u16 = 1002;

/// Payload size of `guest:marker`.
pub const MARKER_SIZE: usize = 24;
/// Payload size of `guest:span`.
pub const SPAN_SIZE: usize = 32;
/// Offset of the string bytes in `guest:text`.
pub const TEXT_STR_OFFSET: usize = 20;
/// Longest message a `guest:text` event carries (bytes, without the NUL).
pub const TEXT_MAX_MSG: usize = 240;

/// Slot of each built-in event in the per-CPU enable word (bit number).
pub const MARKER_SLOT: u32 = 0;
/// Enable-word bit of `guest:span`.
pub const SPAN_SLOT: u32 = 1;
/// Enable-word bit of `guest:text`.
pub const TEXT_SLOT: u32 = 2;

/// The pid recorded for events of vCPU `cpu` (never 0: trace-cmd prints pid 0 as `<idle>`).
pub const fn vcpu_pid(cpu: u32) -> i32 {
    cpu as i32 + 1
}

/// The common header of a trace event (first 8 bytes of every payload).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommonHeader {
    /// Event id (`common_type`).
    pub common_type: u16,
    /// `common_flags` (irq flags in the kernel; 0 here).
    pub flags: u8,
    /// `common_preempt_count` (0 here).
    pub preempt_count: u8,
    /// `common_pid`.
    pub pid: i32,
}

impl CommonHeader {
    /// Encodes the header into its 8 little-endian bytes.
    pub const fn to_bytes(&self) -> [u8; 8] {
        let t = self.common_type.to_le_bytes();
        let p = self.pid.to_le_bytes();
        [
            t[0],
            t[1],
            self.flags,
            self.preempt_count,
            p[0],
            p[1],
            p[2],
            p[3],
        ]
    }

    /// Decodes the header from the start of a payload; `None` if it is shorter than 8 bytes.
    pub fn parse(payload: &[u8]) -> Option<Self> {
        let b = payload.get(..COMMON_HEADER_SIZE)?;
        Some(Self {
            common_type: u16::from_le_bytes([b[0], b[1]]),
            flags: b[2],
            preempt_count: b[3],
            pid: i32::from_le_bytes([b[4], b[5], b[6], b[7]]),
        })
    }
}

/// Builds a `guest:marker` payload.
pub fn marker(pid: i32, seq: u64, value: u64) -> [u8; MARKER_SIZE] {
    let mut p = [0u8; MARKER_SIZE];
    p[..8].copy_from_slice(&header(MARKER_ID, pid));
    p[8..16].copy_from_slice(&seq.to_le_bytes());
    p[16..24].copy_from_slice(&value.to_le_bytes());
    p
}

/// Builds a `guest:span` payload.
pub fn span(pid: i32, seq: u64, id: u64, dur: u64) -> [u8; SPAN_SIZE] {
    let mut p = [0u8; SPAN_SIZE];
    p[..8].copy_from_slice(&header(SPAN_ID, pid));
    p[8..16].copy_from_slice(&seq.to_le_bytes());
    p[16..24].copy_from_slice(&id.to_le_bytes());
    p[24..32].copy_from_slice(&dur.to_le_bytes());
    p
}

/// Builds a `guest:text` payload into `out`, returning its length, or `None` if `out`
/// is too small or `msg` is longer than [`TEXT_MAX_MSG`]. `msg` must not contain NUL.
pub fn text(out: &mut [u8], pid: i32, seq: u64, msg: &[u8]) -> Option<usize> {
    if msg.len() > TEXT_MAX_MSG {
        return None;
    }
    let len = TEXT_STR_OFFSET + msg.len() + 1;
    let out = out.get_mut(..len)?;
    out[..8].copy_from_slice(&header(TEXT_ID, pid));
    out[8..16].copy_from_slice(&seq.to_le_bytes());
    let loc = (TEXT_STR_OFFSET as u32) | (((msg.len() + 1) as u32) << 16);
    out[16..20].copy_from_slice(&loc.to_le_bytes());
    out[TEXT_STR_OFFSET..len - 1].copy_from_slice(msg);
    out[len - 1] = 0;
    Some(len)
}

const fn header(id: u16, pid: i32) -> [u8; 8] {
    CommonHeader {
        common_type: id,
        flags: 0,
        preempt_count: 0,
        pid,
    }
    .to_bytes()
}
