//! The VMM's side of the consumer hand-off (live attach; docs/design.md, "The consumer
//! hand-off", C1–C4): who holds the claim, where the next consumer starts, which swaps a
//! consumer left pending, which CPUs a consumer read to their end. Generic over the
//! session's memory and callbacks, so the run loop (`run.rs`, `RunControl`) and the
//! deterministic model below run the same code.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use hyptrace_abi::SharedMem;
use hyptrace_reader::{Callbacks, ReadError, RingBuffer};

use crate::control::protocol::{AttachInfo, ConsumerPosition, ReaderStatus};
use crate::control::server::Refusal;
use crate::drain::session::Session;

/// How long a consumer may keep its claim after every vCPU stopped (C4) before the VMM
/// reads the rest itself.
pub const CONSUMER_GRACE: Duration = Duration::from_secs(10);

/// The consumer holding the claim: its connection and token (C2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Claim {
    conn: u64,
    token: u64,
}

/// What the attach reply says about the file (the run's).
#[derive(Clone, Debug)]
pub struct FileInfo {
    /// The trace memory file.
    pub trace_mem: PathBuf,
    /// Where its meta pages are.
    pub meta_off: u64,
}

/// The claim and what consumers handed back.
#[derive(Debug)]
pub struct Consumers {
    claim: Option<Claim>,
    next_token: u64,
    /// Per CPU: the consumer read it to its end (C4): the VMM's final walk only counts.
    delivered: Vec<bool>,
    /// Since when every vCPU stopped while a consumer held the claim (C4's bound).
    held_at_end: Option<Instant>,
}

impl Consumers {
    /// No consumer yet, `nr` CPUs.
    pub fn new(nr: u32) -> Self {
        Self {
            claim: None,
            next_token: 0,
            delivered: vec![false; nr as usize],
            held_at_end: None,
        }
    }

    /// Whether a consumer holds the claim.
    pub fn claimed(&self) -> bool {
        self.claim.is_some()
    }

    /// Whether a consumer read `cpu` to its end (C4).
    pub fn delivered(&self, cpu: u32) -> bool {
        self.delivered.get(cpu as usize) == Some(&true)
    }

    /// C2: `what` is only for the connection and token holding the claim, checked when
    /// the request executes.
    fn check(&self, conn: u64, token: u64, what: &str) -> Result<(), Refusal> {
        match self.claim {
            Some(c) if c.conn == conn && c.token == token => Ok(()),
            Some(c) if c.token == token => {
                Err(format!("{what}: claim {token} belongs to another connection").into())
            }
            _ => Err(format!(
                "{what}: claim {token} is not the VMM's consumer (ended, or never attached)"
            )
            .into()),
        }
    }

    /// `attach` for `conn`: one consumer at a time, and only once the last one's swaps
    /// are settled (C3); the reply carries where each live CPU's reading stands (C1).
    pub fn attach<M: SharedMem, C: Callbacks>(
        &mut self,
        s: &Session<M, C>,
        conn: u64,
        file: &FileInfo,
    ) -> Result<AttachInfo, Refusal> {
        if self.claim.is_some() {
            return Err("busy: another consumer is attached (one consumer at a time)".into());
        }
        let reader = s.reader();
        let nr = reader.nr_cpus();
        if let Some(cpu) = (0..nr).find(|&c| reader.request_in_flight(c)) {
            return Err(format!(
                "busy: settling the previous consumer's swap of cpu {cpu} (try again)"
            )
            .into());
        }
        let positions = (0..nr)
            .filter(|&cpu| s.is_live(cpu))
            .filter_map(|cpu| Some(ConsumerPosition::at(cpu, reader.position(cpu)?)))
            .collect();
        let l = reader.layout();
        self.next_token = self.next_token.wrapping_add(1).max(1);
        let token = self.next_token;
        self.claim = Some(Claim { conn, token });
        Ok(AttachInfo {
            token,
            trace_mem: file.trace_mem.clone(),
            nr_cpus: l.nr_cpus,
            page_size: u32::try_from(l.page_size).unwrap_or(u32::MAX),
            pages_per_cpu: l.pages_per_cpu,
            meta_off: file.meta_off,
            pid: std::process::id(),
            positions,
        })
    }

    /// `get_reader` of the claim `token` for `cpu`, whose consumer has read `page`:
    /// swapped only when `page` is the VMM's reader page of that CPU (C1). Returns the
    /// status and, after a swap, the new page and the events lost before it.
    pub fn get_reader<M: SharedMem, C: Callbacks>(
        &mut self,
        s: &mut Session<M, C>,
        (conn, token): (u64, u64),
        (cpu, page): (u32, u32),
        vcpu_finished: bool,
    ) -> Result<ReaderStatus, Refusal> {
        self.check(conn, token, "get_reader")?;
        let nr = s.reader().nr_cpus();
        if cpu >= nr {
            return Err(format!("get_reader: no CPU {cpu} (the VM has {nr})").into());
        }
        if !s.is_live(cpu) || vcpu_finished {
            return Ok(ReaderStatus::Ended);
        }
        let current = s.reader().position(cpu).map(|p| p.reader);
        if current != Some(page) {
            return Err(format!(
                "get_reader {cpu}: page {page} is not the reader page ({current:?}): the consumer is out of step"
            )
            .into());
        }
        let swapped = s
            .swap_external(cpu)
            .map_err(|e| format!("get_reader {cpu}: {e}"))?;
        Ok(match swapped {
            Some((page, lost)) => ReaderStatus::Swapped { page, lost },
            None if s.reader().request_in_flight(cpu) => ReaderStatus::Pending,
            None => ReaderStatus::Busy,
        })
    }

    /// `detach` of the claim `token`: the claim ends; where the consumer stopped on each
    /// CPU is counted as read here (C1), each position checked against this reader's own
    /// view; `done` (the consumer read the CPU to its end) only for a stopped vCPU (C4).
    /// A position that does not check is refused (the claim ends all the same: the next
    /// consumer starts where this reader stands).
    pub fn detach<M: SharedMem, C: Callbacks>(
        &mut self,
        s: &mut Session<M, C>,
        (conn, token): (u64, u64),
        positions: &[ConsumerPosition],
        vcpu_finished: &dyn Fn(u32) -> bool,
    ) -> Result<(), Refusal> {
        self.check(conn, token, "detach")?;
        self.claim = None;
        let nr = s.reader().nr_cpus();
        if positions.len() > nr as usize {
            return Err(format!("detach: {} positions for {nr} CPUs", positions.len()).into());
        }
        let mut bad = Vec::new();
        for p in positions {
            if !s.is_live(p.cpu) {
                continue;
            }
            if p.done {
                match self.delivered.get_mut(p.cpu as usize) {
                    Some(d) if vcpu_finished(p.cpu) => *d = true,
                    _ => bad.push(format!("cpu {}: done while its vCPU runs", p.cpu)),
                }
                continue;
            }
            #[cfg(not(hyptrace_seeded_bug_detach_ignored))]
            if let Err(e) = s.consumed_externally(p.cpu, p.page, p.consumed, p.expected) {
                bad.push(crate::exit::chain(&e));
            }
        }
        if bad.is_empty() {
            Ok(())
        } else {
            Err(format!("detach: {}", bad.join("; ")).into())
        }
    }

    /// The client `conn` went away: its claim, if it held it, ends (C2).
    pub fn gone(&mut self, conn: u64) -> bool {
        if self.claim.is_some_and(|c| c.conn == conn) {
            self.claim = None;
            return true;
        }
        false
    }

    /// C3: with no claim, completes the swaps the last consumer left in flight (the
    /// reader moves onto the new page and counts its losses, so the next consumer starts
    /// there). Returns each settled swap: CPU, new page, events lost before it.
    pub fn settle<M: SharedMem, C: Callbacks>(
        &mut self,
        s: &mut Session<M, C>,
    ) -> Vec<(u32, u32, u64)> {
        let mut settled = Vec::new();
        if self.claim.is_some() {
            return settled;
        }
        for cpu in 0..s.reader().nr_cpus() {
            if !s.reader().request_in_flight(cpu) || !s.is_live(cpu) {
                continue;
            }
            match s.swap_external(cpu) {
                Ok(Some((page, lost))) => settled.push((cpu, page, lost)),
                Ok(None) => {}
                Err(e) => {
                    log::debug!("cpu {cpu}: settling the last consumer's swap: {e}");
                    s.fail_cpu(cpu, &e.into());
                }
            }
        }
        settled
    }

    /// C4's bound: with every vCPU stopped (`all_done`), a claim held
    /// [`CONSUMER_GRACE`] ends. Returns true when it took the claim away now.
    pub fn end_if_late(&mut self, all_done: bool, now: Instant) -> bool {
        if self.claim.is_none() || !all_done {
            self.held_at_end = None;
            return false;
        }
        let since = *self.held_at_end.get_or_insert(now);
        if now.saturating_duration_since(since) >= CONSUMER_GRACE {
            self.claim = None;
            return true;
        }
        false
    }
}

/// C1, the consumer's side: starts each CPU of `reader` where the attach reply `info`
/// says the reading stands ([`RingBuffer::resume`]) — the VMM's word, never the
/// guest-written `reader_page` [`RingBuffer::attach`] starts at.
pub fn start<M: SharedMem, C: Callbacks>(
    reader: &mut RingBuffer<M, C>,
    info: &AttachInfo,
) -> Result<(), ReadError> {
    if cfg!(hyptrace_seeded_bug_guest_position) {
        return Ok(());
    }
    for p in &info.positions {
        reader.resume(p.cpu, p.page, p.consumed, p.expected)?;
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod model;
