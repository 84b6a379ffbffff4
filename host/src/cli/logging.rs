//! Diagnostics of the VMM's steps (memory map, vCPU start and exit, swaps per poll,
//! contended swaps, mailbox requests, stop reasons) through `log`, shown on stderr by
//! `env_logger`: `-v` (info), `-vv` (debug), `-vvv` (trace), or `RUST_LOG` (which wins).
//! Without either nothing is logged; what a user reads (events, summary, errors) is
//! printed as before, not logged.

use log::LevelFilter;

/// Installs the logger once per process: `RUST_LOG` if set, else the level that
/// `verbose` (`-v` count) asks for. Later calls do nothing.
pub fn init(verbose: u8) {
    let level = match verbose {
        0 => LevelFilter::Off,
        1 => LevelFilter::Info,
        2 => LevelFilter::Debug,
        _ => LevelFilter::Trace,
    };
    let mut b = env_logger::Builder::new();
    b.filter_level(level);
    if let Ok(spec) = std::env::var("RUST_LOG") {
        b.parse_filters(&spec);
    }
    // Already installed (a second command line in one process, e.g. tests): keep it.
    let _ = b.target(env_logger::Target::Stderr).try_init();
}
