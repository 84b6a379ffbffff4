//! The drain loop's scheduling advantage ([`ReaderPriority`]) and what the loop costs
//! ([`thread_cpu_time`]), shared by the session's loop and the standby drainer.

use std::time::Duration;

/// The scheduling advantage of the drain loop's thread ([`ReaderPriority::raise`]),
/// taken while the writers write and given back while they idle and on drop.
///
/// The reader needs little CPU (well under 1 % of a core at 200 000 events/s) but
/// needs it *soon*: on a machine whose cores are all taken by spinning vCPU threads
/// (and other load) a normal thread waits a time slice or more for a core while its
/// rings fill. The thread gets `SCHED_FIFO` priority 1 — it preempts normal threads
/// when it wakes, and since it sleeps at least [`MIN_POLL`](crate::drain::session::MIN_POLL) between rounds it never
/// keeps a core for good — or, where real-time policies are not permitted, nice −10;
/// where neither is permitted it runs as it is, after one log line.
/// `HYPTRACE_READER_PRIORITY=normal` in the environment turns it off. While idle
/// ([`ReaderPriority::set_active`]`(false)`) the thread runs as it was: a real-time
/// wake-up costs about twice a normal one here (measured: 2.5 % against 1.0 % of a
/// core for an idle VM at `--poll-ms 1`), and an idle ring needs no haste.
#[derive(Debug)]
pub struct ReaderPriority {
    boost: Option<Boost>,
    /// The boost is applied now.
    on: bool,
    /// Set and given back on the thread that raised it (`pid 0` is the calling
    /// thread): !Send.
    _thread: std::marker::PhantomData<*const ()>,
}

#[derive(Debug)]
enum Boost {
    Fifo {
        policy: i32,
        param: libc::sched_param,
    },
    Nice {
        tid: libc::id_t,
        nice: i32,
    },
}

impl Boost {
    fn apply(&self, on: bool) -> bool {
        match self {
            Boost::Fifo { policy, param } => {
                let rt = libc::sched_param { sched_priority: 1 };
                let (p, prm) = if on {
                    (libc::SCHED_FIFO, &rt)
                } else {
                    (*policy, param)
                };
                // SAFETY: sets the calling thread's (pid 0) policy from a valid param.
                unsafe { libc::sched_setscheduler(0, p, prm) == 0 }
            }
            Boost::Nice { tid, nice } => {
                // SAFETY: setpriority on our own thread id (Linux: per-thread nice).
                unsafe {
                    libc::setpriority(libc::PRIO_PROCESS, *tid, if on { -10 } else { *nice }) == 0
                }
            }
        }
    }
}

impl ReaderPriority {
    /// Raises the calling thread's scheduling priority (see the type), unless the
    /// environment says `HYPTRACE_READER_PRIORITY=normal`.
    pub fn raise() -> Self {
        let mut me = Self {
            boost: None,
            on: false,
            _thread: std::marker::PhantomData,
        };
        if std::env::var_os("HYPTRACE_READER_PRIORITY").is_some_and(|v| v == "normal") {
            log::debug!("reader thread: normal priority (HYPTRACE_READER_PRIORITY=normal)");
            return me;
        }
        // SAFETY: sched_getscheduler/getparam on the calling thread (pid 0) with a
        // valid out-pointer to a sched_param we own.
        let (policy, mut param) = unsafe {
            let mut p: libc::sched_param = std::mem::zeroed();
            (libc::sched_getscheduler(0), {
                libc::sched_getparam(0, &mut p);
                p
            })
        };
        if policy != libc::SCHED_OTHER {
            // Already real-time (or batch/idle on purpose): leave it as it is.
            return me;
        }
        param.sched_priority = 0;
        let fifo = Boost::Fifo { policy, param };
        if fifo.apply(true) {
            log::debug!("reader thread: SCHED_FIFO priority 1 while the writers write");
            me.boost = Some(fifo);
            me.on = true;
            return me;
        }
        let rt_err = std::io::Error::last_os_error();
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() } as libc::id_t;
        // getpriority can return -1 legitimately: clear errno first.
        // SAFETY: errno location of this thread; getpriority on our own thread id.
        let nice = unsafe {
            *libc::__errno_location() = 0;
            libc::getpriority(libc::PRIO_PROCESS, tid)
        };
        let boost = Boost::Nice { tid, nice };
        if boost.apply(true) {
            log::info!("reader thread: real-time policy refused ({rt_err}); running at nice -10");
            me.boost = Some(boost);
            me.on = true;
            return me;
        }
        log::info!(
            "reader thread: no scheduling advantage (SCHED_FIFO: {rt_err}; nice -10: {}): the reader may lag behind busy vCPUs",
            std::io::Error::last_os_error()
        );
        me
    }

    /// Whether the thread got an advantage (and gives it back on drop).
    pub fn raised(&self) -> bool {
        self.boost.is_some()
    }

    /// Takes the advantage (`true`: a writer writes) or gives it back for now (`false`:
    /// every writer idles). A system call only when this changes.
    pub fn set_active(&mut self, active: bool) {
        if active != self.on {
            if let Some(b) = &self.boost {
                if b.apply(active) {
                    self.on = active;
                }
            }
        }
    }
}

impl Drop for ReaderPriority {
    fn drop(&mut self) {
        self.set_active(false);
    }
}

/// CPU time the calling thread has used so far (`getrusage(RUSAGE_THREAD)`, user +
/// system): what the drain loop costs, measured by its own thread.
pub fn thread_cpu_time() -> Duration {
    // SAFETY: getrusage fills the rusage we own; RUSAGE_THREAD is the calling thread.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_THREAD, &mut ru);
        ru
    };
    let tv = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec.max(0) as u64) + Duration::from_micros(t.tv_usec.max(0) as u64)
    };
    tv(ru.ru_utime) + tv(ru.ru_stime)
}
