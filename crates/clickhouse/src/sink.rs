//! [`ClickHouseSink`]: every event of every page a row of `DATABASE.events`, every gap a
//! row of `DATABASE.losses`, sent in batches (RowBinary over HTTP).
//!
//! Batches: at most [`Options::batch_rows`] rows (64 k) or [`MAX_BATCH_BYTES`], sent
//! when full, when [`Options::batch_age`] (1 s) old at the next page, and at `finish`.
//! One batch is held at a time, and sent in the caller's thread: run behind a
//! [`hyptrace_output::ThreadedSink`] (as `record` does) a slow or absent server
//! holds that thread, its bounded chunk queue fills and the reader waits (stop mode:
//! the rings fill and the guest's drops are counted; overwrite mode: the rings keep
//! the newest). Memory is one batch plus the threaded sink's chunks: never more.
//!
//! Exactly once: every row carries its run's id and its batch number. An INSERT whose
//! outcome is unknown (no answer, an error) is never simply re-sent: the sink asks the
//! server how many rows of that batch the table holds — all (the insert went in: done),
//! none (re-sent) or some (an error: an INSERT of one block, at most 1 048 576 rows, is
//! atomic in ClickHouse, so only another writer can cause it) — every
//! [`Options::retry_for`] at most, backing off to 1 s between tries; each attempt uses
//! the same query id, which the server refuses while an earlier attempt still runs.

use std::time::{Duration, Instant};

use hyptrace_output::{
    export_page_into, page_events, page_missed, text, EventFormat, Missed, OutputError, PageSink,
    RunSummary, TraceMeta,
};

use crate::client::Client;
use crate::error::ClickHouseError;
use crate::identity::{unix_offset, RunIdentity};
use crate::rowbinary::{
    put_bytes, put_bytes_array, put_i32, put_i64_array, put_u16, put_u32, put_u64, put_u8,
};
use crate::schema::{Table, EVENTS, LOSSES};

/// Bytes of encoded rows after which a batch is sent, whatever its row count.
pub const MAX_BATCH_BYTES: usize = 32 << 20;
/// Longest pause between retries.
const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// First pause after a failed attempt.
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
/// How often a pause between retries checks [`ClickHouseSink::cancel_on`]'s condition.
const CANCEL_POLL: Duration = Duration::from_millis(20);

/// How the sink batches and retries.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// Rows per batch at most (also bounded by [`MAX_BATCH_BYTES`]).
    pub batch_rows: u64,
    /// Age after which a partial batch is sent at the next page.
    pub batch_age: Duration,
    /// How long a batch is retried before the sink fails (exit 1).
    pub retry_for: Duration,
    /// Told (one line) when a batch failed and is being checked and retried, and when
    /// it is stored after all: the server's trouble holds the run, the user should
    /// know. Default: the line on stderr after `hyptrace: `.
    pub notify: fn(&str),
}

/// [`Options::notify`]'s default: `hyptrace: LINE` on stderr.
fn notify_stderr(line: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "hyptrace: {line}");
}

impl Default for Options {
    fn default() -> Self {
        Self {
            batch_rows: 65_536,
            batch_age: Duration::from_secs(1),
            retry_for: Duration::from_secs(60),
            notify: notify_stderr,
        }
    }
}

/// What the sink has done (for tests and reports).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SinkCounts {
    /// Event rows stored.
    pub events: u64,
    /// Loss rows stored.
    pub losses: u64,
    /// Batches stored.
    pub batches: u64,
    /// Inserts that failed and were checked (then re-sent or found stored).
    pub retries: u64,
}

/// Rows of one table waiting to be sent.
#[derive(Default)]
struct Rows {
    data: Vec<u8>,
    n: u64,
}

impl Rows {
    fn clear(&mut self) {
        self.data.clear();
        self.n = 0;
    }
}

/// The [`PageSink`] that writes to ClickHouse (see the module).
pub struct ClickHouseSink {
    client: Client,
    db: String,
    who: RunIdentity,
    meta: TraceMeta,
    opts: Options,
    /// Added to a row's `ts` to give `time_unix_ns` (None: 0 is stored).
    unix_offset: Option<i64>,
    scratch: Vec<u8>,
    events: Rows,
    losses: Rows,
    /// The number of the batch being filled.
    batch: u64,
    since: Option<Instant>,
    /// Per CPU: ns of its last event (where a trailing loss goes).
    last_ns: Vec<u64>,
    counts: std::sync::Arc<std::sync::Mutex<SinkCounts>>,
    /// When to stop retrying ([`ClickHouseSink::cancel_on`]).
    cancel: Option<Cancel>,
}

/// A condition under which the sink stops retrying (see [`ClickHouseSink::cancel_on`]).
type Cancel = Box<dyn Fn() -> bool + Send + Sync>;

/// One event's fields, split by type.
#[derive(Default)]
struct Fields<'a> {
    int_keys: Vec<&'a [u8]>,
    int_values: Vec<i64>,
    str_keys: Vec<&'a [u8]>,
    str_values: Vec<&'a [u8]>,
}

/// The name of the `guest:span` field added with the duration in ns.
const DUR_NS: &[u8] = b"dur_ns";

impl ClickHouseSink {
    /// A sink writing the pages of the trace `meta` describes as run `who`, through
    /// `client` into database `db` (tables created: [`crate::prepare`]).
    pub fn new(
        client: Client,
        db: &str,
        who: RunIdentity,
        meta: TraceMeta,
        opts: Options,
    ) -> Result<Self, OutputError> {
        meta.validate()?;
        Ok(Self {
            unix_offset: unix_offset(&meta.clock.name),
            scratch: vec![0; meta.page_size],
            last_ns: vec![0; meta.nr_cpus as usize],
            client,
            db: db.to_string(),
            who,
            meta,
            opts,
            events: Rows::default(),
            losses: Rows::default(),
            batch: 0,
            since: None,
            counts: Default::default(),
            cancel: None,
        })
    }

    /// Once `cancel()` holds (e.g. a second Ctrl-C), a batch being retried is given up
    /// at once: the pause between attempts ends within 20 ms, no further attempt is
    /// made, the request in flight ends by its deadline (30 s at most), and the sink
    /// fails with [`ClickHouseError::Cancelled`].
    #[must_use]
    pub fn cancel_on(mut self, cancel: impl Fn() -> bool + Send + Sync + 'static) -> Self {
        self.cancel = Some(Box::new(cancel));
        self
    }

    /// A handle on the sink's counts, readable after the sink is gone.
    pub fn counts(&self) -> std::sync::Arc<std::sync::Mutex<SinkCounts>> {
        std::sync::Arc::clone(&self.counts)
    }

    fn unix_ns(&self, ns: u64) -> u64 {
        self.unix_offset
            .map_or(0, |o| ns.checked_add_signed(o).unwrap_or(0))
    }

    /// The columns every row starts with.
    fn put_who(&self, out: &mut Vec<u8>, cpu: u32, ns: u64) {
        put_bytes(out, self.who.host.as_bytes());
        put_bytes(out, self.who.vm.as_bytes());
        put_bytes(out, self.who.run.as_bytes());
        put_u64(out, self.batch);
        put_u32(out, cpu);
        put_u64(out, ns);
        put_u64(out, self.unix_ns(ns));
    }

    /// A `losses` row: `lost` events (`known`: the count is known) before `ns`.
    fn loss_row(&mut self, cpu: u32, ns: u64, lost: u64, known: bool, trailing: bool) {
        let mut out = std::mem::take(&mut self.losses.data);
        self.put_who(&mut out, cpu, ns);
        put_u64(&mut out, lost);
        put_u8(&mut out, u8::from(known));
        put_u8(&mut out, u8::from(trailing));
        self.losses.data = out;
        self.losses.n += 1;
    }

    /// An `events` row.
    fn event_row(&mut self, cpu: u32, raw_ts: u64, payload: &[u8]) {
        let ns = self.meta.clock.trace_cmd_ns(raw_ts);
        let id = payload
            .get(..2)
            .map_or(0, |b| u16::from_le_bytes([b[0], b[1]]));
        let pid = payload
            .get(4..8)
            .map_or(0, |b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        let mut out = std::mem::take(&mut self.events.data);
        self.put_who(&mut out, cpu, ns);
        let format = self.meta.format(id);
        let unknown = format!("event_{id}");
        let (system, name) = match format {
            Some(f) => (f.system.as_bytes(), f.name.as_bytes()),
            None => (&b"unknown"[..], unknown.as_bytes()),
        };
        put_bytes(&mut out, system);
        put_bytes(&mut out, name);
        put_u16(&mut out, id);
        put_i32(&mut out, pid);
        let mut f = format.map(|f| fields(f, payload)).unwrap_or_default();
        if let Some(dur) = span_dur(format, payload) {
            f.int_keys.push(DUR_NS);
            let ns = self.meta.clock.duration_ns(dur);
            f.int_values.push(i64::try_from(ns).unwrap_or(i64::MAX));
        }
        put_bytes_array(&mut out, f.int_keys.iter().copied());
        put_i64_array(&mut out, f.int_values.iter().copied());
        put_bytes_array(&mut out, f.str_keys.iter().copied());
        put_bytes_array(&mut out, f.str_values.iter().copied());
        self.events.data = out;
        self.events.n += 1;
        if let Some(l) = self.last_ns.get_mut(cpu as usize) {
            *l = ns;
        }
    }

    fn full(&self) -> bool {
        self.events.n >= self.opts.batch_rows
            || self.losses.n >= self.opts.batch_rows
            || self.events.data.len() >= MAX_BATCH_BYTES
            || self
                .since
                .is_some_and(|t| t.elapsed() >= self.opts.batch_age)
    }

    /// Sends the batch being filled (both tables), each exactly once.
    fn flush(&mut self) -> Result<(), OutputError> {
        if self.events.n > 0 {
            self.store(EVENTS, &self.events)?;
        }
        if self.losses.n > 0 {
            self.store(LOSSES, &self.losses)?;
        }
        let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        c.events += self.events.n;
        c.losses += self.losses.n;
        if self.events.n + self.losses.n > 0 {
            c.batches += 1;
            self.batch += 1;
        }
        drop(c);
        self.events.clear();
        self.losses.clear();
        self.since = None;
        Ok(())
    }

    /// Stores `rows` as batch `self.batch` of `table`, exactly once (see the module).
    fn store(&self, t: Table, rows: &Rows) -> Result<(), ClickHouseError> {
        let (db, run, batch, table) = (&self.db, &self.who.run, self.batch, t.name);
        let cols = t.column_list();
        let insert = format!("INSERT INTO {db}.{table} ({cols}) FORMAT RowBinary");
        let qid = format!("hyptrace-{run}-{table}-{batch}");
        let mut last = match self.client.insert(&insert, &qid, &rows.data) {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        if !self.cancelled() {
            (self.opts.notify)(&format!(
                "{}: checking and retrying {table} batch {batch}",
                hyptrace_output::error_chain(&last)
            ));
        }
        let deadline = Instant::now() + self.opts.retry_for;
        let mut pause = FIRST_BACKOFF;
        // Bounded by the deadline.
        while Instant::now() < deadline {
            self.pause(pause)?;
            pause = (pause * 2).min(MAX_BACKOFF);
            self.counts
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .retries += 1;
            let r = match self.stored_rows(table, batch) {
                Ok(n) if n == rows.n => Ok(()),
                Ok(0) => self.client.insert(&insert, &qid, &rows.data),
                Ok(found) => {
                    return Err(ClickHouseError::Partial {
                        addr: self.client.addr().into(),
                        table,
                        run: run.clone(),
                        batch,
                        found,
                        sent: rows.n,
                    })
                }
                Err(e) => Err(e),
            };
            match r {
                Ok(()) => {
                    let addr = self.client.addr();
                    (self.opts.notify)(&format!(
                        "ClickHouse at {addr}: {table} batch {batch} stored"
                    ));
                    return Ok(());
                }
                Err(e) => last = e,
            }
        }
        Err(ClickHouseError::GaveUp {
            addr: self.client.addr().into(),
            table,
            batch,
            secs: self.opts.retry_for.as_secs(),
            last: Box::new(last),
        })
    }

    /// Whether the sink was cancelled ([`ClickHouseSink::cancel_on`]).
    fn cancelled(&self) -> bool {
        self.cancel.as_ref().is_some_and(|c| c())
    }

    /// Waits `d`, or less when cancelled: then [`ClickHouseError::Cancelled`].
    fn pause(&self, d: Duration) -> Result<(), ClickHouseError> {
        let end = Instant::now() + d;
        // Bounded: each turn waits at most CANCEL_POLL, until `end`.
        loop {
            if self.cancelled() {
                return Err(ClickHouseError::Cancelled {
                    addr: self.client.addr().into(),
                });
            }
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(());
            }
            std::thread::sleep(left.min(CANCEL_POLL));
        }
    }

    /// How many rows of batch `batch` of this run `table` holds. The answer is only
    /// taken when it names what it answers (the table, the run, the batch): a reply
    /// to another query, or a number out of nowhere, is an error, never a count.
    fn stored_rows(&self, table: &'static str, batch: u64) -> Result<u64, ClickHouseError> {
        let (db, run) = (&self.db, &self.who.run);
        let a = self.client.query(&format!(
            "SELECT '{table}', '{run}', {batch}, count() FROM {db}.{table} \
             WHERE run = '{run}' AND batch = {batch} FORMAT TabSeparated"
        ))?;
        let want = format!("{table}\t{run}\t{batch}\t");
        a.strip_suffix('\n')
            .and_then(|l| l.strip_prefix(&want))
            .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| self.client.unexpected("a batch's row count", &a))
    }
}

/// The fields of event `f` in `payload`: integers as Int64 (an unsigned 64-bit value
/// above 2^63 − 1 wraps: `reinterpretAsUInt64` gives it back), strings, arrays and
/// dynamic fields as their bytes.
fn fields<'a>(f: &'a EventFormat, payload: &'a [u8]) -> Fields<'a> {
    let mut out = Fields::default();
    for fd in &f.fields {
        if fd.is_string() || fd.is_array() || fd.is_data_loc() || fd.is_rel_loc() {
            out.str_keys.push(fd.name.as_bytes());
            out.str_values
                .push(text::field_bytes(fd, payload).unwrap_or_default());
        } else if let Some(v) = text::field_int(fd, payload) {
            out.int_keys.push(fd.name.as_bytes());
            out.int_values.push(v as i64);
        }
    }
    out
}

/// The `dur` of a `guest:span` (TSC cycles).
fn span_dur(format: Option<&EventFormat>, payload: &[u8]) -> Option<u64> {
    let f = format.filter(|f| {
        f.id == hyptrace_abi::events::SPAN_ID && f.system == hyptrace_abi::events::SYSTEM
    })?;
    let fd = f.fields.iter().find(|fd| fd.name == "dur")?;
    text::field_int(fd, payload)
}

impl PageSink for ClickHouseSink {
    fn page(&mut self, cpu: u32, page: &[u8], missed: Missed) -> Result<(), OutputError> {
        self.meta.check_page(cpu, page)?;
        export_page_into(cpu, page, missed, &mut self.scratch)?;
        let scratch = std::mem::take(&mut self.scratch);
        let (page_ts, events, _err) = page_events(&scratch);
        let first = events.first().map_or(page_ts, |e| e.0);
        let at = self.meta.clock.trace_cmd_ns(first);
        match page_missed(&scratch) {
            Missed::None => {}
            Missed::Count(n) => self.loss_row(cpu, at, n, true, false),
            Missed::Unknown => self.loss_row(cpu, at, 0, false, false),
        }
        for &(ts, payload) in &events {
            self.event_row(cpu, ts, payload);
        }
        drop(events);
        self.scratch = scratch;
        self.since.get_or_insert_with(Instant::now);
        if self.full() {
            self.flush()?;
        }
        Ok(())
    }

    /// A `losses` row (`trailing` = 1) at the CPU's last event.
    fn trailing_lost(&mut self, cpu: u32, lost: u64) -> Result<(), OutputError> {
        let Some(&ns) = self.last_ns.get(cpu as usize) else {
            return Err(OutputError::BadPage {
                cpu,
                problem: hyptrace_output::PageProblem::NoSuchCpu {
                    cpu,
                    nr_cpus: self.meta.nr_cpus,
                },
            });
        };
        if lost > 0 {
            self.loss_row(cpu, ns, lost, true, true);
            self.since.get_or_insert_with(Instant::now);
        }
        Ok(())
    }

    fn finish(mut self: Box<Self>, _summary: &RunSummary) -> Result<(), OutputError> {
        self.flush()
    }
}

#[cfg(test)]
mod tests;
