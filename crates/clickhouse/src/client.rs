//! The HTTP client: one query per request (ClickHouse's HTTP interface, port 8123 by
//! default), a connection kept alive between requests. Every request is a POST, which
//! ureq never re-sends by itself (only idempotent requests without a body): each
//! re-send is the sink's decision, after its check.

use std::io::Read;
use std::time::Duration;

use crate::error::{sanitise, ClickHouseError};
use crate::url::ClickHouseUrl;

/// Longest answer read (counts, `Ok.`, error messages): more is never needed.
const MAX_ANSWER: u64 = 64 * 1024;
/// Time to connect.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Time for one read or write on the connection (a batch insert of 64 k rows takes
/// well under a second on a healthy server).
const IO_TIMEOUT: Duration = Duration::from_secs(30);

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
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(CONNECT_TIMEOUT)
            .timeout_read(IO_TIMEOUT)
            .timeout_write(IO_TIMEOUT)
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

    /// `INSERT ... FORMAT RowBinary` (`sql`) with `data` as the body, under the query
    /// id `query_id` (the server refuses a second query with an id that is still
    /// running: a retry can never overlap the attempt before it).
    pub fn insert(&self, sql: &str, query_id: &str, data: &[u8]) -> Result<(), ClickHouseError> {
        let r = self
            .agent
            .post(&self.base)
            .query("query", sql)
            .query("query_id", query_id)
            .send_bytes(data);
        self.answer(r).map(drop)
    }

    /// Runs `sql`, a query answering one unsigned number.
    pub fn count(&self, sql: &str) -> Result<u64, ClickHouseError> {
        let a = self.query(sql)?;
        a.trim().parse().map_err(|_| ClickHouseError::Answer {
            addr: self.addr.clone(),
            what: "a count",
            text: sanitise(a.as_bytes()),
        })
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
            Ok(resp) => read(resp)
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .map_err(|source| ClickHouseError::Read {
                    addr: self.addr.clone(),
                    source,
                }),
            Err(ureq::Error::Status(status, resp)) => Err(ClickHouseError::Status {
                addr: self.addr.clone(),
                status,
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
