//! The control protocol's messages: one module for the server (`control.rs`, executed by
//! the run loop), the `hyptrace ctl` client and the live-attach consumer (`attach.rs`).
//!
//! On the wire every message is one JSON object on one line, both ways (docs/design.md,
//! "The control socket"). A request names the protocol version it speaks and an id of
//! the client's choosing; the reply repeats both, and a client trusts a reply only when
//! it names the request it answers (version and id; a `fetch` answer's items name their
//! CPU and sequence number, and its bytes follow the line, as many as it says).
//!
//! ```text
//! {"v":3,"id":7,"cmd":"fetch","token":3,"acks":[{"cpu":0,"seq":12}],"max_bytes":1048576,"knots":1}
//! {"v":3,"id":7,"ok":{"kind":"pieces","items":[{"cpu":0,"seq":13,"item":{"piece":{"first":500,"events":170,"missed":0,"len":4096}}}],"knots":[],"bytes":4096}}
//! <4096 bytes>
//! {"v":3,"id":8,"err":"fetch: claim 3 is not the VMM's subscriber (ended, or never subscribed)"}
//! ```

use serde::{Deserialize, Serialize};

/// The protocol version this build speaks (a request of another version is refused).
/// 1 was the word-per-line protocol before typed messages; 2 had consumers read the
/// rings in place (`attach`, `get_reader`, positions in `detach`); 3 has the VMM read and
/// send what it read to one subscriber (`subscribe`, `fetch`, `detach`).
pub const VERSION: u32 = 3;

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
    /// Claim the subscriber role (live attach; one subscriber at a time): the reply
    /// carries the claim's token and what the subscriber needs to write the events (the
    /// geometry, the clock, the formats).
    Subscribe {
        /// Pieces of the page the writer is on, as far as it is committed (a text
        /// stream), rather than whole pages only.
        #[serde(default)]
        partial: bool,
    },
    /// Acknowledge what was taken and fetch what the VMM read since (C2).
    Fetch {
        /// The claim.
        token: u64,
        /// Per CPU, the last item taken (by sequence number; only numbers sent).
        #[serde(default)]
        acks: Vec<Ack>,
        /// Most bytes of pieces in the answer (the VMM caps it: [`MAX_FETCH_BYTES`]).
        max_bytes: u64,
        /// Knots of the clock map the subscriber has: the answer carries the rest.
        #[serde(default)]
        knots: u64,
    },
    /// Acknowledge what was taken and end the claim: the rest goes to the next
    /// subscriber or the VMM's own output (nothing is read twice).
    Detach {
        /// The claim.
        token: u64,
        /// Per CPU, the last item taken.
        #[serde(default)]
        acks: Vec<Ack>,
    },
}

/// Most bytes of pieces one `fetch` answer carries.
pub const MAX_FETCH_BYTES: u64 = 4 << 20;
/// Most items one `fetch` answer carries (its line stays far below the client's bound).
pub const MAX_FETCH_ITEMS: usize = 4096;

/// The fields each command may carry besides `v`, `id` and `cmd`: a request with any
/// other field is refused (a field this VMM does not know would be ignored silently).
fn command_fields(cmd: &str) -> Option<&'static [&'static str]> {
    Some(match cmd {
        "enable" | "disable" => &["event"],
        "stats" | "list" => &[],
        "subscribe" => &["partial"],
        "fetch" => &["token", "acks", "max_bytes", "knots"],
        "detach" => &["token", "acks"],
        _ => return None,
    })
}

/// The subscriber took `cpu`'s items through sequence number `seq`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ack {
    /// The CPU.
    pub cpu: u32,
    /// The last item taken.
    pub seq: u64,
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

/// Why a request line is no request of this protocol.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// Not JSON, or not a request.
    #[error("not a request of protocol version {VERSION}")]
    Malformed(#[source] serde_json::Error),
    /// Another version (the id, if the line has one, for the reply).
    #[error("protocol version {got} (this VMM speaks {VERSION}): upgrade the client")]
    Version {
        /// The line's version.
        got: u64,
        /// The line's id.
        id: Option<u64>,
    },
    /// A field the command does not have (the id, for the reply).
    #[error("{cmd}: unknown field {field:?} (protocol version {VERSION})")]
    UnknownField {
        /// The command.
        cmd: String,
        /// The field, cut to 32 characters.
        field: String,
        /// The line's id.
        id: Option<u64>,
    },
}

impl RequestError {
    /// The id of the request the line was, if it names one.
    pub fn id(&self) -> Option<u64> {
        match self {
            Self::Malformed(_) => None,
            Self::Version { id, .. } | Self::UnknownField { id, .. } => *id,
        }
    }
}

impl Request {
    /// Parses a request line: a JSON object of this version whose fields are all the
    /// command's (any other is refused rather than ignored).
    pub fn parse(text: &str) -> Result<Self, RequestError> {
        let map: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(text).map_err(RequestError::Malformed)?;
        let id = map.get("id").and_then(serde_json::Value::as_u64);
        let v = map.get("v").and_then(serde_json::Value::as_u64);
        if let Some(got) = v.filter(|&v| v != u64::from(VERSION)) {
            return Err(RequestError::Version { got, id });
        }
        let cmd = map
            .get("cmd")
            .and_then(serde_json::Value::as_str)
            .unwrap_or("");
        if let Some(fields) = command_fields(cmd) {
            let unknown = map.keys().find(|k| {
                !["v", "id", "cmd"].contains(&k.as_str()) && !fields.contains(&k.as_str())
            });
            if let Some(field) = unknown {
                return Err(RequestError::UnknownField {
                    cmd: cmd.to_string(),
                    field: truncate(field, 32).to_string(),
                    id,
                });
            }
        }
        serde_json::from_value(serde_json::Value::Object(map)).map_err(RequestError::Malformed)
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
    /// `subscribe`: the claim.
    Subscribed(SubscribeInfo),
    /// `fetch`: what the VMM read since (pieces' bytes after the line).
    Pieces(PieceBatch),
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

/// The reply to `subscribe`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SubscribeInfo {
    /// The claim: every `fetch`/`detach` names it.
    pub token: u64,
    /// CPUs.
    pub nr_cpus: u32,
    /// Page size: every piece is at most this long.
    pub page_size: u32,
    /// The clock of the pieces' timestamps (the run's, with its map's knots so far).
    pub clock: WireClock,
    /// The event formats.
    pub formats: Vec<hyptrace_output::EventFormat>,
    /// The VMM's pid.
    pub pid: u32,
}

/// A run's clock as a subscriber rebuilds it: the conversion of the pages' raw
/// timestamps and the knots of the run's map onto the host clock (none: no map).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WireClock {
    /// The trace clock's name.
    pub name: String,
    /// Cycles to ns, if the timestamps are cycles.
    pub tsc: Option<hyptrace_output::TscConversion>,
    /// ns added after the conversion.
    pub offset_ns: i64,
    /// The map's knots (in order).
    pub knots: Vec<hyptrace_output::Knot>,
}

/// The answer to `fetch`: items in order per CPU; the pieces' bytes (`bytes` in all,
/// each piece `len` of them, in the items' order) follow the reply line on the socket.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PieceBatch {
    /// The items.
    pub items: Vec<WireItem>,
    /// The clock map's knots from the `knots_from`-th on (those the request said it
    /// lacked; a subscriber with a fetch in flight may get some twice).
    pub knots: Vec<hyptrace_output::Knot>,
    /// The index in the map of the first of `knots`.
    #[serde(default)]
    pub knots_from: u64,
    /// Bytes after the line.
    pub bytes: u64,
    /// Those bytes (not in the line), in the items' order: the VMM's are its outbox's
    /// pieces themselves (shared, written with the line in one vectored write: no copy
    /// into a batch); a subscriber's, the one buffer it read them into.
    #[serde(skip)]
    pub data: Vec<bytes::Bytes>,
}

impl PieceBatch {
    /// The bytes after the line as one slice: a received batch's buffer as it is
    /// (one chunk); a batch of several pieces (the VMM's side, in the models) joined.
    pub fn payload(&self) -> std::borrow::Cow<'_, [u8]> {
        match self.data.as_slice() {
            [] => std::borrow::Cow::Borrowed(&[]),
            [one] => std::borrow::Cow::Borrowed(one),
            many => std::borrow::Cow::Owned(many.concat()),
        }
    }
}

/// One item of a [`PieceBatch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireItem {
    /// The CPU.
    pub cpu: u32,
    /// Its sequence number (per CPU, from 1 up).
    pub seq: u64,
    /// A piece or the CPU's end.
    pub item: crate::drain::outbox::BatchItem,
}

/// The `stats` answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LiveStats {
    /// Seconds since the vCPUs started.
    pub elapsed_s: f64,
    /// Why the run is stopping, if it is.
    pub stopping: Option<String>,
    /// A subscriber holds the claim (live attach).
    #[serde(default)]
    pub subscribed: bool,
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
    /// The server refused the connection or the line itself, naming no request
    /// (`busy: too many clients`, `line too long`, `idle: disconnected`, `timeout`).
    #[error("the VMM refused: {0}")]
    Refused(String),
    /// It answers another request.
    #[error("a reply to request {got:?} while waiting for {want}")]
    NotOurs {
        /// The reply's id.
        got: Option<u64>,
        /// Ours.
        want: u64,
    },
}

/// A `fetch` answer as it is on the wire (`{"v":..,"id":..,"ok":{"kind":"pieces",..}}`),
/// read without the buffering that [`Reply`]'s flattened, internally tagged outcome
/// costs (serde keeps a generic copy of the whole line first: a third of a subscriber's
/// time in a reply of 256 items). The same format: [`parse_reply`] tries it first.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PiecesReply {
    v: u32,
    id: Option<u64>,
    ok: PiecesOk,
}

/// The `ok` of a [`PiecesReply`]: the [`PieceBatch`] with its tag.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PiecesOk {
    /// `"pieces"` (a string, as the general parse reads the tag; anything else goes
    /// the general way).
    kind: String,
    items: Vec<WireItem>,
    knots: Vec<hyptrace_output::Knot>,
    #[serde(default)]
    knots_from: u64,
    bytes: u64,
}

/// Parses `line` as the reply to request `id`.
pub fn parse_reply(line: &str, id: u64) -> Result<Outcome, ReplyError> {
    let r: Reply = match serde_json::from_str::<PiecesReply>(line) {
        Ok(p) if p.ok.kind == "pieces" => Reply {
            v: p.v,
            id: p.id,
            outcome: Outcome::Ok(Answer::Pieces(PieceBatch {
                items: p.ok.items,
                knots: p.ok.knots,
                knots_from: p.ok.knots_from,
                bytes: p.ok.bytes,
                data: Vec::new(),
            })),
        },
        _ => serde_json::from_str(line).map_err(ReplyError::Malformed)?,
    };
    if r.v != VERSION {
        return Err(ReplyError::Version { got: r.v });
    }
    if let (None, Outcome::Err(why)) = (r.id, &r.outcome) {
        return Err(ReplyError::Refused(why.clone()));
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
            cmd: Command::Fetch {
                token: 3,
                acks: vec![Ack { cpu: 0, seq: 12 }],
                max_bytes: 1 << 20,
                knots: 1,
            },
        };
        let line = serde_json::to_string(&req).expect("ser");
        assert_eq!(
            line,
            r#"{"v":3,"id":7,"cmd":"fetch","token":3,"acks":[{"cpu":0,"seq":12}],"max_bytes":1048576,"knots":1}"#
        );
        assert_eq!(Request::parse(&line).expect("de"), req);
        let reply = Reply::to(
            Some(7),
            Outcome::Ok(Answer::Pieces(PieceBatch {
                items: vec![WireItem {
                    cpu: 0,
                    seq: 13,
                    item: crate::drain::outbox::BatchItem::Piece {
                        first: 500,
                        events: 170,
                        missed: 0,
                        len: 4096,
                    },
                }],
                knots: Vec::new(),
                knots_from: 0,
                bytes: 4096,
                data: vec![vec![1; 4096].into()],
            })),
        );
        let l = reply.line();
        assert!(l.ends_with('\n') && !l[..l.len() - 1].contains('\n'));
        assert!(l.len() < 300, "the bytes are not in the line: {l}");
        let Outcome::Ok(Answer::Pieces(b)) = parse_reply(&l, 7).expect("ours") else {
            panic!("not pieces");
        };
        assert_eq!((b.items.len(), b.bytes, b.data.len()), (1, 4096, 0));
        // The fast path (`PiecesReply`) reads what the general one reads, and only that:
        // another answer, or a pieces answer with a field too many, goes the general way.
        let general: Reply = serde_json::from_str(&l).expect("general");
        assert_eq!(general.outcome, Outcome::Ok(Answer::Pieces(b)));
        assert!(serde_json::from_str::<PiecesReply>(&l).is_ok());
        let extra = l.replacen("\"bytes\":", "\"x\":1,\"bytes\":", 1);
        assert!(serde_json::from_str::<PiecesReply>(&extra).is_err());
        assert!(matches!(
            parse_reply(&extra, 7),
            Ok(Outcome::Ok(Answer::Pieces(_)))
        ));
        // The tag as a map (`{"pieces":null}`), which an enum would take: refused by both.
        let map_tag = l.replacen("\"kind\":\"pieces\"", "\"kind\":{\"pieces\":null}", 1);
        assert_ne!(map_tag, l);
        assert!(parse_reply(&map_tag, 7).is_err());
        let other = Reply::to(Some(7), Outcome::Ok(Answer::Detached)).line();
        assert!(serde_json::from_str::<PiecesReply>(&other).is_err());
        assert_eq!(
            parse_reply(&other, 7).expect("detached"),
            Outcome::Ok(Answer::Detached)
        );
        assert!(matches!(
            parse_reply(&l, 8),
            Err(ReplyError::NotOurs {
                got: Some(7),
                want: 8
            })
        ));
        let err = Reply::to(None, Outcome::Err("a\nb".into())).line();
        assert_eq!(err.matches('\n').count(), 1, "{err}");
        assert!(matches!(parse_reply(&err, 1), Err(ReplyError::Refused(_))));
        assert!(parse_reply("ok swapped 1 0", 1).is_err());
    }

    /// A field the command does not have is refused, not ignored: a version-2 `detach`
    /// saying `done` (it counted the rest as read) is no detach of this protocol.
    #[test]
    fn unknown_fields_and_versions_are_refused() {
        let done = r#"{"v":3,"id":4,"cmd":"detach","token":1,"acks":[],"done":true}"#;
        let e = Request::parse(done).expect_err("accepted");
        assert!(matches!(e, RequestError::UnknownField { .. }), "{e}");
        assert_eq!(e.id(), Some(4));
        let v2 = r#"{"v":2,"id":5,"cmd":"attach"}"#;
        assert!(matches!(
            Request::parse(v2),
            Err(RequestError::Version {
                got: 2,
                id: Some(5)
            })
        ));
        assert!(Request::parse(r#"{"v":3,"id":6,"cmd":"frob"}"#).is_err());
        assert!(Request::parse(r#"{"v":3,"id":6,"cmd":"stats"}"#).is_ok());
        assert!(Request::parse(r#"{"v":3,"id":6,"cmd":"subscribe","partial":true}"#).is_ok());
    }
}
