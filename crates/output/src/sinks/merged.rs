//! The one release path of the merged sinks (text and JSON): lines or entries queued in
//! a [`Merger`] by the time they show, written in time order in 64 KiB batches.

use super::stream::StreamOut;
use crate::merge::{Merged, Merger, Released};
use crate::OutputError;

/// Queues a formatted line of `cpu` at `ns`, the time it shows (its length counts
/// against the window). Lines merge by that time, as trace-cmd orders a trace.dat's
/// events: two CPUs' events in the same nanosecond go lower CPU first, whatever the
/// order of their raw timestamps.
pub(super) fn queue_line(merger: &mut Merger<String>, cpu: usize, ns: u64, line: String) {
    let n = line.len();
    merger.push_sized(cpu, ns, Merged::Event(line), n);
}

/// What the merger releases, for a sink to render: a queued string at its time, or the
/// window-exceeded marker.
pub(super) enum Piece<'a> {
    Item { ts: u64, text: &'a str },
    WindowExceeded { held: usize, lagging: Option<usize> },
}

/// Writes to `out`, in time order, every string queued in `merger` that it releases (all
/// of them when `all`), each rendered by `render` into a 64 KiB batch — the one release
/// path of the merged sinks (text and JSON).
pub(super) fn release_merged(
    merger: &mut Merger<String>,
    out: &mut StreamOut,
    buf: &mut String,
    all: bool,
    mut render: impl FnMut(&mut String, Piece<'_>),
) -> Result<(), OutputError> {
    buf.clear();
    let mut err = None;
    let mut put = |piece: Piece<'_>, buf: &mut String| {
        render(buf, piece);
        if buf.len() >= 1 << 16 && err.is_none() {
            err = out.write_all(buf.as_bytes()).err();
            buf.clear();
        }
    };
    if all {
        merger.drain(|_, ts, item| {
            if let Merged::Event(text) = item {
                put(Piece::Item { ts, text: &text }, buf);
            }
        });
    } else {
        merger.release(|r| match r {
            Released::Item {
                ts,
                item: Merged::Event(text),
                ..
            } => put(Piece::Item { ts, text: &text }, buf),
            Released::Item { .. } => {}
            Released::WindowExceeded { held, lagging } => {
                put(Piece::WindowExceeded { held, lagging }, buf);
            }
        });
    }
    if let Some(e) = err {
        return Err(e);
    }
    out.write_all(buf.as_bytes())
}
