//! What the guest workloads write (a replay of guest/src/workload.rs), so that every
//! field of every event can be checked.

use hyptrace_abi::guest::WorkloadRng as Rng;

/// The seed `hyptrace run` passes (`hyptrace_host::vmm::vm::DEFAULT_SEED`).
pub const DEFAULT_SEED: u64 = hyptrace_host::vmm::vm::DEFAULT_SEED;
/// Longest `guest:text` message (`hyptrace_abi::events::TEXT_MAX_MSG`).
pub const TEXT_MAX_MSG: usize = 240;

/// `fill_text` of guest/src/workload.rs: "vcpu C event I " then a letter pattern, cut
/// to `len` bytes.
pub fn text_message(cpu: u32, i: u64, len: usize) -> String {
    let mut s = format!("vcpu {cpu} event {i} ");
    let mut k = 0u8;
    while s.len() < len {
        s.push((b'a' + k % 26) as char);
        k = k.wrapping_add(1);
    }
    s.truncate(len);
    s
}

/// One expected event: its name and its fields as `trace-cmd report` prints them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    /// `marker`, `span` or `text`.
    pub name: &'static str,
    /// `seq=.. value=..` etc.
    pub fields: String,
}

/// The events one vCPU writes, by `seq` (the index of the event on its vCPU).
#[derive(Debug, Clone)]
pub enum Model {
    /// steady / burst / panic / fault: `marker` with `value == seq`.
    Markers,
    /// mixed: markers, spans and texts picked by the guest's RNG.
    Mixed {
        /// The vCPU.
        cpu: u32,
        /// The RNG, positioned before event `next`.
        rng: Box<RngState>,
        /// The next index the RNG will produce.
        next: u64,
    },
}

/// Opaque RNG state of [`Model::Mixed`].
#[derive(Debug, Clone)]
pub struct RngState(Rng);

impl Model {
    /// The model of `workload` (`steady`, `mixed`, `burst`, `panic`, `fault`) on `cpu`
    /// with the default seed.
    pub fn new(workload: &str, cpu: u32) -> Self {
        match workload {
            "mixed" => Self::Mixed {
                cpu,
                rng: Box::new(RngState(Rng::new(DEFAULT_SEED, cpu))),
                next: 0,
            },
            _ => Self::Markers,
        }
    }

    /// Event `seq`. Calls must come with non-decreasing `seq` (the RNG only goes
    /// forward).
    pub fn at(&mut self, seq: u64) -> Expected {
        match self {
            Self::Markers => Expected {
                name: "marker",
                fields: format!("seq={seq} value={seq}"),
            },
            Self::Mixed { cpu, rng, next } => {
                assert!(seq >= *next, "model asked for seq {seq} after {next}");
                let mut r = 0;
                while *next <= seq {
                    r = rng.0.next();
                    *next += 1;
                }
                match r % 8 {
                    0..=3 => Expected {
                        name: "marker",
                        fields: format!("seq={seq} value={}", r >> 8),
                    },
                    4 | 5 => Expected {
                        name: "span",
                        fields: format!(
                            "seq={seq} id={} dur={}",
                            (r >> 16) & 0xffff,
                            (r >> 32) & 0xf_ffff
                        ),
                    },
                    _ => {
                        let len = 1 + ((r >> 24) as usize) % TEXT_MAX_MSG;
                        Expected {
                            name: "text",
                            fields: format!("seq={seq} msg={}", text_message(*cpu, seq, len)),
                        }
                    }
                }
            }
        }
    }
}
