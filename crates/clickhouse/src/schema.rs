//! The tables (docs/fleet.md): `DATABASE.events`, one row per event, and
//! `DATABASE.losses`, one row per gap. Plain types only: ClickHouse 18.16 (Debian's)
//! has no Map, no DateTime64, and LowCardinality only behind an experimental setting.
//!
//! A table that exists already (`CREATE TABLE IF NOT EXISTS` leaves it) is checked
//! before any row is sent: every column a row carries must be there with its type, so
//! a database that holds another program's `events` (or ClickHouse's own
//! `system.events`) is refused at once, not after a run's worth of failed inserts.

use crate::client::Client;
use crate::error::ClickHouseError;

/// One table: its name and its columns (name, ClickHouse type), in the order a row is
/// encoded.
#[derive(Clone, Copy, Debug)]
pub struct Table {
    /// `events` or `losses`.
    pub name: &'static str,
    /// (name, type), in row order.
    pub columns: &'static [(&'static str, &'static str)],
}

/// The columns every row starts with.
const WHO: [Column; 7] = [
    ("host", "String"),
    ("vm", "String"),
    ("run", "String"),
    ("batch", "UInt64"),
    ("cpu", "UInt32"),
    ("ts", "UInt64"),
    ("time_unix_ns", "UInt64"),
];

/// A column: its name and ClickHouse type.
type Column = (&'static str, &'static str);

/// [`WHO`]'s columns, then `rest`: `N` must be 7 + `M` (checked when built).
const fn after_who<const M: usize, const N: usize>(rest: [Column; M]) -> [Column; N] {
    assert!(N == WHO.len() + M, "N is WHO's columns and the rest");
    let mut out = [("", ""); N];
    let mut i = 0;
    while i < N {
        out[i] = if i < WHO.len() {
            WHO[i]
        } else {
            rest[i - WHO.len()]
        };
        i += 1;
    }
    out
}

const EVENT_COLUMNS: [Column; 15] = after_who([
    ("system", "String"),
    ("name", "String"),
    ("id", "UInt16"),
    ("pid", "Int32"),
    ("int_keys", "Array(String)"),
    ("int_values", "Array(Int64)"),
    ("str_keys", "Array(String)"),
    ("str_values", "Array(String)"),
]);

const LOSS_COLUMNS: [Column; 10] = after_who([
    ("lost", "UInt64"),
    ("known", "UInt8"),
    ("trailing", "UInt8"),
]);

/// `DATABASE.events`.
pub const EVENTS: Table = Table {
    name: "events",
    columns: &EVENT_COLUMNS,
};

/// `DATABASE.losses`.
pub const LOSSES: Table = Table {
    name: "losses",
    columns: &LOSS_COLUMNS,
};

impl Table {
    /// `a, b, c`: the columns of an INSERT.
    pub fn column_list(&self) -> String {
        let names: Vec<&str> = self.columns.iter().map(|c| c.0).collect();
        names.join(", ")
    }

    fn create_sql(&self, db: &str) -> String {
        let cols: Vec<String> = self
            .columns
            .iter()
            .map(|(n, t)| format!("{n} {t}"))
            .collect();
        format!(
            "CREATE TABLE IF NOT EXISTS {db}.{} ({}) ENGINE = MergeTree() ORDER BY (vm, run, cpu, ts)",
            self.name,
            cols.join(", ")
        )
    }

    /// Checks that `db.NAME` has every column with its type. The answer must name
    /// what it answers (the database and table on every line): else it is no list of
    /// columns, an error of the server, not of the URL. `exists`: the table must be
    /// there (at least one line); else no line is a table yet to be created.
    fn check(&self, client: &Client, db: &str, exists: bool) -> Result<(), ClickHouseError> {
        let a = client.query(&format!(
            "SELECT database, table, name, type FROM system.columns \
             WHERE database = '{db}' AND table = '{}' FORMAT TabSeparated",
            self.name
        ))?;
        let prefix = format!("{db}\t{}\t", self.name);
        let have: Option<std::collections::BTreeSet<&str>> =
            a.lines().map(|l| l.strip_prefix(&prefix)).collect();
        let have = have
            .filter(|h| !(exists && h.is_empty()))
            .ok_or_else(|| client.unexpected("the columns of a table", &a))?;
        if have.is_empty() {
            return Ok(());
        }
        let missing: Vec<String> = self
            .columns
            .iter()
            .map(|(n, t)| format!("{n}\t{t}"))
            .filter(|c| !have.contains(c.as_str()))
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        Err(ClickHouseError::Schema {
            addr: client.addr().into(),
            table: format!("{db}.{}", self.name),
            missing: missing.join(", ").replace('\t', " "),
        })
    }
}

/// Creates the database and both tables if missing, and checks that both have the
/// columns rows carry (`db` is checked: [`crate::ClickHouseUrl::parse`]). Both tables
/// are checked before either is created: a refused database gets no table of ours.
pub fn create(client: &Client, db: &str) -> Result<(), ClickHouseError> {
    client.execute(&format!("CREATE DATABASE IF NOT EXISTS {db}"))?;
    for t in [EVENTS, LOSSES] {
        t.check(client, db, false)?;
    }
    for t in [EVENTS, LOSSES] {
        client.execute(&t.create_sql(db))?;
        t.check(client, db, true)?;
    }
    Ok(())
}
