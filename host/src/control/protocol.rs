//! The control protocol's messages: one module for the server (`control.rs`, executed by
//! the run loop), the `hyptrace ctl` client and the live-attach consumer (`attach.rs`).
//!
//! On the wire every message is one JSON object on one line, both ways (docs/design.md,
//! "The control socket"). A request names the protocol version it speaks and an id of
//! the client's choosing; the reply repeats both, and a client trusts a reply only when
//! it names the request it answers (version, id, and for `get_reader` the CPU and page).
//!
//! ```text
//! {"v":2,"id":7,"cmd":"get_reader","token":3,"cpu":0,"page":12}
//! {"v":2,"id":7,"ok":{"kind":"reader","cpu":0,"page":12,"status":{"swapped":{"page":9,"lost":0}}}}
//! {"v":2,"id":8,"err":"get_reader: not the consumer (claim 3 ended)"}
//! ```

use serde::{Deserialize, Serialize};

/// The protocol version this build speaks (a request of another version is refused).
/// 1 was the word-per-line protocol before typed messages.
pub const VERSION: u32 = 2;

/// The longest word `hyptrace ctl` sends (an event pattern; names are at most 64
/// bytes, system and event).
pub const MAX_WORD: usize = 256;

/// A command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case")]
pub enum Command {
    /// Set the enable bit of the events `event` names (as `-e` takes them) on every vCPU.
    Enable {
        /// The pattern.
        event: String,
    },
    /// Clear it.
    Disable {
        /// The pattern.
        event: String,
    },
    /// The live per-CPU counters.
    Stats,
    /// The events and whether they are enabled.
    List,
    /// Claim the consumer role (live attach; one consumer at a time): the reply carries
    /// the claim's token and each CPU's position.
    Attach,
    /// Swap `cpu`'s reader page for the consumer holding `token`; `page` is the reader
    /// page the consumer has read (refused unless it is the VMM's current one).
    GetReader {
        /// The claim.
        token: u64,
        /// The CPU.
        cpu: u32,
        /// The consumer's reader page.
        page: u32,
    },
    /// End the claim `token`, saying where the consumer stopped reading on each CPU
    /// (the next consumer starts there: nothing is read twice).
    Detach {
        /// The claim.
        token: u64,
        /// Per CPU, the consumer's position.
        positions: Vec<ConsumerPosition>,
    },
}

impl Command {
    /// The command `hyptrace ctl` sends for its words (`enable EVENT`, `disable
    /// EVENT`, `stats`, `list`); the consumer's commands are not for a shell.
    pub fn from_words(words: &[String]) -> Result<Self, UsageError> {
        let w: Vec<&str> = words.iter().map(String::as_str).collect();
        if let Some(long) = w.iter().find(|x| x.len() > MAX_WORD) {
            return Err(UsageError(format!(
                "{:?}...: too long (at most {MAX_WORD} bytes a word)",
                truncate(long, 16)
            )));
        }
        match w.as_slice() {
            ["enable", e] => Ok(Self::Enable {
                event: (*e).to_string(),
            }),
            ["disable", e] => Ok(Self::Disable {
                event: (*e).to_string(),
            }),
            ["stats"] => Ok(Self::Stats),
            ["list"] => Ok(Self::List),
            ["enable" | "disable"] => Err(UsageError(format!("{}: missing EVENT", w[0]))),
            ["enable" | "disable", ..] => Err(UsageError(format!("{}: takes one EVENT", w[0]))),
            ["stats" | "list", ..] => Err(UsageError(format!("{}: takes no argument", w[0]))),
            [] => Err(UsageError("missing COMMAND".into())),
            [verb, ..] => Err(UsageError(format!(
                "unknown command {:?} (enable EVENT, disable EVENT, stats, list)",
                truncate(verb, 32)
            ))),
        }
    }
}

/// A `hyptrace ctl` command line that is not a command.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// At most `n` characters of `s`, for messages that quote hostile input.
pub fn truncate(s: &str, n: usize) -> &str {
    match s.char_indices().nth(n) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// Where a consumer stands on one CPU: its reader page, the data bytes of it consumed
/// and the index of the next event (C1 in docs/design.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsumerPosition {
    /// The CPU.
    pub cpu: u32,
    /// The reader page (a global page id).
    pub page: u32,
    /// Data bytes of it consumed (a record boundary).
    pub consumed: u64,
    /// The index of the next event.
    pub expected: u64,
    /// The consumer read the CPU to its end (the vCPU stopped and the consumer's final
    /// walk finished): the VMM counts the rest and writes none of it (C4).
    #[serde(default)]
    pub done: bool,
}

impl ConsumerPosition {
    /// The position `p` of `cpu` (a reader's, [`hyptrace_reader::RingBuffer::position`]),
    /// not done.
    pub fn at(cpu: u32, p: hyptrace_reader::postmortem::Position) -> Self {
        Self {
            cpu,
            page: p.reader,
            consumed: p.consumed,
            expected: p.expected,
            done: false,
        }
    }
}

/// A request: version, the client's id for it, the command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// [`VERSION`].
    pub v: u32,
    /// Chosen by the client; the reply repeats it.
    pub id: u64,
    /// The command.
    #[serde(flatten)]
    pub cmd: Command,
}

/// A reply: version, the id of the request it answers (none for a line that was no
/// request), the outcome.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reply {
    /// [`VERSION`].
    pub v: u32,
    /// The request's id.
    pub id: Option<u64>,
    /// The outcome.
    #[serde(flatten)]
    pub outcome: Outcome,
}

/// The outcome of a request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Done: what it answers.
    Ok(Answer),
    /// Refused: why (one line).
    Err(String),
}

/// What a command answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Answer {
    /// `enable`/`disable`: the events switched.
    Switched {
        /// Their full names.
        events: Vec<String>,
        /// On or off.
        enabled: bool,
    },
    /// `stats`.
    Stats(LiveStats),
    /// `list`.
    Events {
        /// The registered events.
        events: Vec<EventEntry>,
    },
    /// `attach`: the claim.
    Attached(AttachInfo),
    /// `get_reader`: for `cpu` and the consumer's `page`, what happened.
    Reader {
        /// The CPU asked for.
        cpu: u32,
        /// The page the consumer named.
        page: u32,
        /// What happened.
        status: ReaderStatus,
    },
    /// `detach`: the claim ended.
    Detached,
}

impl Answer {
    /// What `hyptrace ctl` prints for it: the events switched (`guest:marker enabled`),
    /// or the answer as JSON (`stats`: `{"elapsed_s":…,"cpus":[…]}`; `list`:
    /// `{"events":[…]}`).
    pub fn text(&self) -> String {
        let json =
            |v: serde_json::Result<String>| v.unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"));
        match self {
            Self::Switched { events, enabled } => format!(
                "{} {}",
                events.join(","),
                if *enabled { "enabled" } else { "disabled" }
            ),
            Self::Stats(s) => json(serde_json::to_string(s)),
            Self::Events { events } => json(serde_json::to_string(
                &serde_json::json!({ "events": events }),
            )),
            a => json(serde_json::to_string(a)),
        }
    }
}

/// The outcome of a `get_reader`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReaderStatus {
    /// The reader page was swapped: `page` is the new one, `lost` events were lost
    /// before it (counted once, here).
    Swapped {
        /// The new reader page.
        page: u32,
        /// Events lost before it.
        lost: u64,
    },
    /// The writer is still on the reader page, or the swap lost a race: ask again.
    Busy,
    /// A guest swap was requested and not answered yet: ask again (same page).
    Pending,
    /// The vCPU stopped: the consumer's final walk is next.
    Ended,
}

/// The reply to `attach`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachInfo {
    /// The claim: every `get_reader`/`detach` names it.
    pub token: u64,
    /// The trace memory file.
    pub trace_mem: std::path::PathBuf,
    /// CPUs.
    pub nr_cpus: u32,
    /// Page size.
    pub page_size: u32,
    /// Pages per CPU.
    pub pages_per_cpu: u32,
    /// Where the meta pages are in the file.
    pub meta_off: u64,
    /// The VMM's pid.
    pub pid: u32,
    /// Where each CPU's reading stands: the consumer starts there (the VMM's word,
    /// never the guest's).
    pub positions: Vec<ConsumerPosition>,
}

/// The `stats` answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LiveStats {
    /// Seconds since the vCPUs started.
    pub elapsed_s: f64,
    /// Why the run is stopping, if it is.
    pub stopping: Option<String>,
    /// Per CPU.
    pub cpus: Vec<CpuLive>,
}

/// One CPU's live counters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuLive {
    /// The CPU.
    pub cpu: u32,
    /// Its vCPU still runs.
    pub running: bool,
    /// Events the guest attempted, as its writer published them (invariant R3).
    pub attempted: u64,
    /// Of those, events skipped (disabled), as published.
    pub skipped: u64,
    /// Why the published attempted/skipped cannot be true, if they cannot (R3).
    pub attempts_problem: Option<String>,
    /// The counters (README, "What it prints").
    pub written: u64,
    /// Read.
    pub read: u64,
    /// Lost.
    pub lost: u64,
    /// Overwritten.
    pub overrun: u64,
    /// Dropped (stop mode).
    pub dropped: u64,
    /// Bytes read.
    pub bytes: u64,
    /// Pages the writer moved onto.
    pub pages_touched: u64,
    /// Reader swaps.
    pub swaps: u64,
    /// Why reading it stopped, if it did.
    pub error: Option<String>,
}

/// One registered event (`list`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventEntry {
    /// `system:name`.
    pub name: String,
    /// Its id in the trace.
    pub id: u32,
    /// Its enable bit.
    pub slot: u32,
    /// Enabled on every vCPU.
    pub enabled: bool,
    /// Its fields.
    pub fields: Vec<FieldEntry>,
}

/// One field of a registered event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FieldEntry {
    /// Name.
    pub name: String,
    /// C type.
    #[serde(rename = "type")]
    pub ctype: String,
    /// Offset in the payload.
    pub offset: u32,
    /// Size.
    pub size: u32,
    /// Signed.
    pub signed: bool,
}

impl Reply {
    /// A reply to request `id`.
    pub fn to(id: Option<u64>, outcome: Outcome) -> Self {
        Self {
            v: VERSION,
            id,
            outcome,
        }
    }

    /// The reply line (newline included; JSON escapes every control character).
    pub fn line(&self) -> String {
        let mut s = serde_json::to_string(self).unwrap_or_else(|e| {
            format!(r#"{{"v":{VERSION},"id":null,"err":"unserialisable reply: {e}"}}"#)
        });
        s.push('\n');
        s
    }
}

/// Why a reply line cannot be trusted as the answer to a request.
#[derive(Debug, thiserror::Error)]
pub enum ReplyError {
    /// Not a reply of this protocol.
    #[error("not a protocol reply")]
    Malformed(#[source] serde_json::Error),
    /// Another version.
    #[error("protocol version {got} (this hyptrace speaks {VERSION})")]
    Version {
        /// The reply's.
        got: u32,
    },
    /// It answers another request.
    #[error("a reply to request {got:?} while waiting for {want}")]
    NotOurs {
        /// The reply's id.
        got: Option<u64>,
        /// Ours.
        want: u64,
    },
}

/// Parses `line` as the reply to request `id`.
pub fn parse_reply(line: &str, id: u64) -> Result<Outcome, ReplyError> {
    let r: Reply = serde_json::from_str(line).map_err(ReplyError::Malformed)?;
    if r.v != VERSION {
        return Err(ReplyError::Version { got: r.v });
    }
    if r.id != Some(id) {
        return Err(ReplyError::NotOurs {
            got: r.id,
            want: id,
        });
    }
    Ok(r.outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn ctl_words() {
        assert_eq!(
            Command::from_words(&words("enable guest:marker")),
            Ok(Command::Enable {
                event: "guest:marker".into()
            })
        );
        assert_eq!(Command::from_words(&words("stats")), Ok(Command::Stats));
        for bad in [
            "",
            "enable",
            "enable a b",
            "stats x",
            "frobnicate",
            "attach",
        ] {
            assert!(Command::from_words(&words(bad)).is_err(), "{bad:?}");
        }
        let e = Command::from_words(&[("x".repeat(10_000))]).expect_err("unknown");
        assert!(e.0.len() < 200, "{e}");
    }

    #[test]
    fn wire_round_trip() {
        let req = Request {
            v: VERSION,
            id: 7,
            cmd: Command::GetReader {
                token: 3,
                cpu: 0,
                page: 12,
            },
        };
        let line = serde_json::to_string(&req).expect("ser");
        assert_eq!(
            line,
            r#"{"v":2,"id":7,"cmd":"get_reader","token":3,"cpu":0,"page":12}"#
        );
        assert_eq!(serde_json::from_str::<Request>(&line).expect("de"), req);
        let reply = Reply::to(
            Some(7),
            Outcome::Ok(Answer::Reader {
                cpu: 0,
                page: 12,
                status: ReaderStatus::Swapped { page: 9, lost: 0 },
            }),
        );
        let l = reply.line();
        assert!(l.ends_with('\n') && !l[..l.len() - 1].contains('\n'));
        assert_eq!(parse_reply(&l, 7).expect("ours"), reply.outcome);
        assert!(matches!(
            parse_reply(&l, 8),
            Err(ReplyError::NotOurs {
                got: Some(7),
                want: 8
            })
        ));
        let err = Reply::to(None, Outcome::Err("a\nb".into())).line();
        assert_eq!(err.matches('\n').count(), 1, "{err}");
        assert!(matches!(
            parse_reply(&err, 1),
            Err(ReplyError::NotOurs { got: None, .. })
        ));
        assert!(parse_reply("ok swapped 1 0", 1).is_err());
    }
}
