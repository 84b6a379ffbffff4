//! Sinks that stand between a producer and another sink: [`Tap`] watches the pages go
//! by, [`Discard`] takes them and writes nothing.
//!
//! **Why one wrapper** (invariant S-wrap, docs/design.md). Most of [`PageSink`]'s
//! methods have a default body (a leaf sink that has no use for `set_live` or `quiet`
//! need not write them), so a wrapper that forgets to forward one compiles and silently
//! changes what the sink behind it does: the bench's page counter once hid `set_live` from the trace.dat sink, whose
//! zstd workers then never went to the catch-up level, and the bench measured losses
//! no `record` has. A sink that only needs to see the pages is a [`Tap`]; the
//! wrappers that change pages ([`crate::ThreadedSink`], the filter's re-encoder) and
//! `Tap` itself are checked by `clippy::missing_trait_methods`: every method is
//! written out.

use crate::{Missed, OutputError, OutputWaits, PageSink, RunSummary};

/// A sink that takes every page and writes nothing (the reader alone, or a session
/// whose pages all go to subscribers).
#[derive(Debug, Default, Clone, Copy)]
pub struct Discard;

impl PageSink for Discard {
    fn page(&mut self, _cpu: u32, _page: &[u8], _missed: Missed) -> Result<(), OutputError> {
        Ok(())
    }
    fn finish(self: Box<Self>, _summary: &RunSummary) -> Result<(), OutputError> {
        Ok(())
    }
}

/// Forwards everything to `inner` unchanged, and shows each page to `watch` first.
///
/// # Examples
/// ```
/// use hyptrace_output::{Discard, Missed, PageSink, Tap};
/// let mut pages = 0;
/// let mut tap = Tap::new(Box::new(Discard), |_cpu: u32, _page: &[u8]| pages += 1);
/// tap.page(0, &[0u8; 4096], Missed::None).unwrap();
/// drop(tap);
/// assert_eq!(pages, 1);
/// ```
pub struct Tap<'a, F> {
    inner: Box<dyn PageSink + Send + 'a>,
    watch: F,
}

impl<'a, F: FnMut(u32, &[u8])> Tap<'a, F> {
    /// `inner`, its pages shown to `watch` (CPU, page) before it gets them.
    pub fn new(inner: Box<dyn PageSink + Send + 'a>, watch: F) -> Self {
        Self { inner, watch }
    }
}

#[deny(clippy::missing_trait_methods)]
impl<F: FnMut(u32, &[u8])> PageSink for Tap<'_, F> {
    fn page(&mut self, cpu: u32, page: &[u8], missed: Missed) -> Result<(), OutputError> {
        (self.watch)(cpu, page);
        self.inner.page(cpu, page, missed)
    }
    fn trailing_lost(&mut self, cpu: u32, lost: u64) -> Result<(), OutputError> {
        self.inner.trailing_lost(cpu, lost)
    }
    fn end_cpu(&mut self, cpu: u32) -> Result<(), OutputError> {
        self.inner.end_cpu(cpu)
    }
    fn quiet(&mut self, cpu: u32, ts: u64) -> Result<(), OutputError> {
        self.inner.quiet(cpu, ts)
    }
    fn idle(&mut self) -> Result<(), OutputError> {
        self.inner.idle()
    }
    fn set_live(&mut self) {
        self.inner.set_live()
    }
    fn abandon(&mut self) {
        self.inner.abandon()
    }
    fn finish(self: Box<Self>, summary: &RunSummary) -> Result<(), OutputError> {
        self.inner.finish(summary)
    }
    fn waits(&self) -> OutputWaits {
        self.inner.waits()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// Records each call it gets, by name.
    struct Log(Arc<Mutex<Vec<&'static str>>>);

    impl Log {
        fn push(&self, what: &'static str) {
            self.0.lock().unwrap().push(what);
        }
    }

    #[deny(clippy::missing_trait_methods)]
    impl PageSink for Log {
        fn page(&mut self, _: u32, _: &[u8], _: Missed) -> Result<(), OutputError> {
            self.push("page");
            Ok(())
        }
        fn trailing_lost(&mut self, _: u32, _: u64) -> Result<(), OutputError> {
            self.push("trailing_lost");
            Ok(())
        }
        fn end_cpu(&mut self, _: u32) -> Result<(), OutputError> {
            self.push("end_cpu");
            Ok(())
        }
        fn quiet(&mut self, _: u32, _: u64) -> Result<(), OutputError> {
            self.push("quiet");
            Ok(())
        }
        fn idle(&mut self) -> Result<(), OutputError> {
            self.push("idle");
            Ok(())
        }
        fn set_live(&mut self) {
            self.push("set_live");
        }
        fn abandon(&mut self) {
            self.push("abandon");
        }
        fn finish(self: Box<Self>, _: &RunSummary) -> Result<(), OutputError> {
            self.push("finish");
            Ok(())
        }
        fn waits(&self) -> OutputWaits {
            self.push("waits");
            OutputWaits::default()
        }
    }

    /// Every call reaches the sink behind the tap, in order; the watcher sees pages.
    #[test]
    fn a_tap_forwards_every_call() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut seen = Vec::new();
        let mut tap = Box::new(Tap::new(
            Box::new(Log(log.clone())),
            |cpu: u32, p: &[u8]| seen.push((cpu, p.len())),
        ));
        tap.set_live();
        tap.page(1, &[0; 16], Missed::None).unwrap();
        tap.quiet(1, 5).unwrap();
        tap.idle().unwrap();
        tap.trailing_lost(1, 3).unwrap();
        tap.end_cpu(1).unwrap();
        let _ = tap.waits();
        tap.abandon();
        tap.finish(&RunSummary::default()).unwrap();
        let want = [
            "set_live",
            "page",
            "quiet",
            "idle",
            "trailing_lost",
            "end_cpu",
            "waits",
            "abandon",
            "finish",
        ];
        assert_eq!(*log.lock().unwrap(), want);
        assert_eq!(seen, [(1, 16)]);
    }
}
