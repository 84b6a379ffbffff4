//! Shared helpers for the integration tests.
//!
//! - [`adversary`]: builds the adversarial guest, runs `hyptrace` under a watchdog
//!   (peak RSS, wall time, SIGTERM, kill on a bound).
//! - [`cguest`]: builds the C SDK, the example C guest and the test C guests.
//! - [`capture`]: text output kept (or counted) in memory.
//! - [`clickhouse`]: a real ClickHouse server in a temporary directory (skip helper,
//!   start, kill, restart, queries).
//! - [`env`](mod@env): skip helpers (`/dev/kvm`, `trace-cmd`), the VM test log for CI, a lock that
//!   serialises VM-booting tests of one test binary, temporary directories.
//! - [`text`]: parses `trace-cmd report -t` / `hyptrace run` lines and checks the event
//!   stream rules (per-CPU `seq` gaps equal to the drop count printed before them,
//!   timestamps non-decreasing).
//! - [`model`]: what the guest workloads write, event by event, to check every field.
//! - [`once`]: exactly-once accounting of a killed run's live output plus its dump
//!   (per-CPU streams, the dump's marked ranges and summary lines).
//! - [`rng`]: the tests' seeded SplitMix64 generator.
//! - [`watchdog`]: tests that fail, never hang (progress watchdog, drop guards, scoped
//!   joins that re-raise panics) and a per-thread allocation counter.

pub mod adversary;
pub mod capture;
pub mod cguest;
pub mod clickhouse;
pub mod env;
pub mod model;
pub mod once;
pub mod rng;
pub mod text;
pub mod watchdog;
