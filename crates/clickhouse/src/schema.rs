//! The tables (docs/fleet.md): `DATABASE.events`, one row per event, and
//! `DATABASE.losses`, one row per gap. Plain types only: ClickHouse 18.16 (Debian's)
//! has no Map, no DateTime64, and LowCardinality only behind an experimental setting.

use crate::client::Client;
use crate::error::ClickHouseError;

/// The columns of `events`, in the order [`crate::ClickHouseSink`] encodes a row.
pub const EVENT_COLUMNS: &str = "host, vm, run, batch, cpu, ts, time_unix_ns, system, name, id, pid, int_keys, int_values, str_keys, str_values";

/// The columns of `losses`, in the order a row is encoded.
pub const LOSS_COLUMNS: &str = "host, vm, run, batch, cpu, ts, time_unix_ns, lost, known, trailing";

fn events_table(db: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {db}.events (\
         host String, vm String, run String, batch UInt64, \
         cpu UInt32, ts UInt64, time_unix_ns UInt64, \
         system String, name String, id UInt16, pid Int32, \
         int_keys Array(String), int_values Array(Int64), \
         str_keys Array(String), str_values Array(String)\
         ) ENGINE = MergeTree() ORDER BY (vm, run, cpu, ts)"
    )
}

fn losses_table(db: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {db}.losses (\
         host String, vm String, run String, batch UInt64, \
         cpu UInt32, ts UInt64, time_unix_ns UInt64, \
         lost UInt64, known UInt8, trailing UInt8\
         ) ENGINE = MergeTree() ORDER BY (vm, run, cpu, ts)"
    )
}

/// Creates the database and both tables if missing (`db` is checked:
/// `[A-Za-z0-9_]+`, [`crate::ClickHouseUrl::parse`]).
pub fn create(client: &Client, db: &str) -> Result<(), ClickHouseError> {
    client.query(&format!("CREATE DATABASE IF NOT EXISTS {db}"))?;
    client.query(&events_table(db))?;
    client.query(&losses_table(db))?;
    Ok(())
}
