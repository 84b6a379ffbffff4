//! Progress of a run whose events are not on the terminal: a status line on a
//! terminal stderr, else one line every 5 s.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use crate::drain::session::Session;

use super::output::Shown;

/// Progress lines when the events are not on the terminal (a caller's sink: none).
pub(super) fn shows_progress(shown: &Shown) -> bool {
    match shown {
        Shown::Stdout => !std::io::stdout().is_terminal(),
        Shown::File { .. } => true,
        Shown::Sink => false,
    }
}

/// Progress of a run whose events are not on the terminal (`record`, or `run` with
/// stdout redirected): on a terminal stderr a status line redrawn every 0.5 s, else
/// one line every 5 s — a long, otherwise silent recording shows it is alive.
pub(super) struct Heartbeat {
    pub(super) tty: bool,
    pub(super) every: Duration,
    pub(super) last: Instant,
    pub(super) drawn: bool,
}

impl Heartbeat {
    pub(super) fn new(enabled: bool) -> Option<Self> {
        let tty = std::io::stderr().is_terminal();
        enabled.then(|| Self {
            tty,
            every: if tty {
                Duration::from_millis(500)
            } else {
                Duration::from_secs(5)
            },
            last: Instant::now(),
            drawn: false,
        })
    }

    pub(super) fn tick(&mut self, session: &Session, nr: u32, started: Instant) {
        if self.last.elapsed() < self.every {
            return;
        }
        self.last = Instant::now();
        let read: u64 = (0..nr).map(|c| session.stats(c).read).sum();
        let lost: u64 = (0..nr).map(|c| session.stats(c).lost).sum();
        let t = started.elapsed().as_secs_f64();
        if self.tty {
            self.drawn = true;
            let mut err = std::io::stderr();
            let _ = write!(
                err,
                "\r\x1b[Khyptrace: recording: {t:.1} s, {read} events read, {lost} lost"
            );
            let _ = err.flush();
        } else {
            note!("hyptrace: recording: {t:.1} s, {read} events read, {lost} lost");
        }
    }

    /// Ends the status line before other messages.
    pub(super) fn end(&mut self) {
        if std::mem::take(&mut self.drawn) {
            note!();
        }
    }
}
