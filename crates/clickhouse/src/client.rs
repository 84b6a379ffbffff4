//! The HTTP client: one query per request (ClickHouse's HTTP interface, port 8123 by
//! default), a connection kept alive between requests. Every request is a POST, which
//! ureq never re-sends by itself (only idempotent requests without a body): each
//! re-send is the sink's decision, after its check.
//!
//! The server is a peer, not an authority: only `200 OK` is success (no redirect is
//! followed: a 3xx is an error), at most 64 KiB of an answer is read, every request
//! ends within its deadline whatever the server sends (or trickles), and an INSERT is
//! only taken as stored when its answer is empty, as ClickHouse's is.

use std::io::Read;
use std::time::Duration;

use crate::error::{sanitise, ClickHouseError};
use crate::url::ClickHouseUrl;

/// Longest answer read (counts, `Ok.`, error messages): more is never needed.
const MAX_ANSWER: u64 = 64 * 1024;

/// How long a request may take.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Timeouts {
    /// Time to connect.
    pub connect: Duration,
    /// Time for the whole request, answer read included (a server that trickles its
    /// answer ends here too).
    pub total: Duration,
}

impl Default for Timeouts {
    /// 3 s to connect, 30 s for a request (a batch insert of 64 k rows, 32 MiB at
    /// most, takes well under a second on a healthy server).
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(3),
            total: Duration::from_secs(30),
        }
    }
}

/// A client of one server.
#[derive(Clone)]
pub struct Client {
    agent: ureq::Agent,
    base: String,
    addr: String,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("addr", &self.addr).finish()
    }
}

impl Client {
    /// A client of the server `url` names (nothing is sent yet).
    pub fn new(url: &ClickHouseUrl) -> Self {
        Self::with_timeouts(url, Timeouts::default())
    }

    pub(crate) fn with_timeouts(url: &ClickHouseUrl, t: Timeouts) -> Self {
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(t.connect)
            .timeout(t.total)
            .redirects(0)
            .build();
        Self {
            agent,
            base: format!("http://{}/", url.addr()),
            addr: url.addr(),
        }
    }

    /// `HOST:PORT`.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Runs `sql` (sent as the request body), returns the answer (at most
    /// 64 KiB).
    pub fn query(&self, sql: &str) -> Result<String, ClickHouseError> {
        let r = self.agent.post(&self.base).send_string(sql);
        self.answer(r)
    }

    /// Runs `sql`, a statement that answers nothing (`CREATE ...`): an answer with a
    /// body is not ClickHouse's, an error.
    pub fn execute(&self, sql: &str) -> Result<(), ClickHouseError> {
        let r = self.agent.post(&self.base).send_string(sql);
        self.nothing(r, "a statement")
    }

    /// `INSERT ... FORMAT RowBinary` (`sql`) with `data` as the body, under the query
    /// id `query_id` (the server refuses a second query with an id that is still
    /// running: a retry can never overlap the attempt before it). Stored only when the
    /// answer is `200` and empty (ClickHouse's answer to an INSERT); any other answer
    /// leaves the outcome unknown (an error: the sink checks).
    pub fn insert(&self, sql: &str, query_id: &str, data: &[u8]) -> Result<(), ClickHouseError> {
        let r = self
            .agent
            .post(&self.base)
            .query("query", sql)
            .query("query_id", query_id)
            .send_bytes(data);
        self.nothing(r, "an INSERT")
    }

    /// The answer `r` to `what`, which must be empty.
    fn nothing(
        &self,
        r: Result<ureq::Response, ureq::Error>,
        what: &'static str,
    ) -> Result<(), ClickHouseError> {
        let a = self.answer(r)?;
        if a.is_empty() {
            Ok(())
        } else {
            Err(self.unexpected(what, &a))
        }
    }

    /// An answer that is not what `what` gives.
    pub(crate) fn unexpected(&self, what: &'static str, answer: &str) -> ClickHouseError {
        ClickHouseError::Answer {
            addr: self.addr.clone(),
            what,
            text: sanitise(answer.as_bytes()),
        }
    }

    fn answer(&self, r: Result<ureq::Response, ureq::Error>) -> Result<String, ClickHouseError> {
        let read = |resp: ureq::Response| {
            let mut b = Vec::new();
            resp.into_reader()
                .take(MAX_ANSWER)
                .read_to_end(&mut b)
                .map(|_| b)
        };
        match r {
            Ok(resp) if resp.status() == 200 => read(resp)
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .map_err(|source| ClickHouseError::Read {
                    addr: self.addr.clone(),
                    source,
                }),
            Ok(resp) | Err(ureq::Error::Status(_, resp)) => Err(ClickHouseError::Status {
                addr: self.addr.clone(),
                status: resp.status(),
                text: sanitise(&read(resp).unwrap_or_default()),
            }),
            Err(ureq::Error::Transport(t)) => Err(ClickHouseError::Unreachable {
                addr: self.addr.clone(),
                kind: t.kind().to_string(),
                source: std::error::Error::source(&t).map(|e| e.to_string().into()),
            }),
        }
    }
}
