//! hyptrace output to ClickHouse: `-o clickhouse://HOST:PORT/DATABASE[?vm=NAME]` streams
//! every event as a row of `DATABASE.events` and every gap as a row of
//! `DATABASE.losses`, over ClickHouse's HTTP interface in RowBinary, batched, each
//! batch stored exactly once (docs/fleet.md: the schema, the guarantees, queries).
//!
//! A crate of its own so that `hyptrace-output` pulls in no HTTP.

mod client;
mod error;
mod identity;
pub mod rowbinary;
mod schema;
mod sink;
mod url;

pub use client::Client;
pub use error::ClickHouseError;
pub use identity::{hostname, unix_offset, RunIdentity};
pub use schema::{Table, EVENTS, LOSSES};
pub use sink::{ClickHouseSink, Options, SinkCounts, MAX_BATCH_BYTES};
pub use url::{is_clickhouse_url, ClickHouseUrl, UrlError, SCHEME};

/// Checks that the server `url` names answers, and creates the database and its two
/// tables if missing: what `record` and `convert` do before they start.
pub fn prepare(url: &ClickHouseUrl) -> Result<Client, ClickHouseError> {
    let client = Client::new(url);
    schema::create(&client, &url.database)?;
    Ok(client)
}
