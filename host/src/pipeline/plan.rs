//! A `run`/`record` configuration checked once: every limit of the options (vCPUs,
//! page size, ring size, guest memory, poll period, duration, guest image) is checked
//! here, and each error names the flag and the limit. What passes is a [`Plan`] that
//! the run pipeline ([`crate::pipeline::run`]) boots without checking again.

use std::borrow::Cow;
use std::path::PathBuf;
use std::time::Duration;

use hyptrace_abi::guest::RUN_FLAG_SERVE_MAILBOX;
use hyptrace_abi::layout as ring;

use crate::pipeline::options::MAX_DURATION_S;
use crate::pipeline::options::{RunArgs, SwapArg};
use crate::vmm::elf::{ElfError, GuestImage};
use crate::vmm::memory_map::{
    GuestMemoryMap, HUGE_PAGE, LOW_END, MAX_MEM_BYTES, MAX_VCPUS, MIN_MEM_BYTES,
};
use crate::vmm::vm::{RunParams, VmConfig, DEFAULT_SEED};
use crate::GUEST_ELF;

/// Why the options of a run cannot be used (exit 2). Each message names the flag and
/// the limit.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// `--vcpus 0`.
    #[error("--vcpus must be at least 1")]
    NoVcpus,
    /// `--vcpus` above [`MAX_VCPUS`].
    #[error("--vcpus {0} is more than the limit of {MAX_VCPUS}")]
    TooManyVcpus(u32),
    /// `--page-size` not a power of two, or too small.
    #[error("--page-size {0} must be a power of two of at least {min}", min = ring::MIN_PAGE_SIZE)]
    PageSize(u64),
    /// `--page-size` too large.
    #[error("--page-size {0} is larger than the limit of {max}", max = ring::MAX_PAGE_SIZE)]
    PageSizeOver(u64),
    /// `--buffer-kb` larger than guest memory can ever be.
    #[error("--buffer-kb {0} is more than the limit of {max_kb} KiB per vCPU (guest memory is at most {max_mb} MiB)", max_kb = MAX_MEM_BYTES / 1024, max_mb = MAX_MEM_BYTES >> 20)]
    BufferOver(u64),
    /// `--buffer-kb` below the smallest ring.
    #[error("--buffer-kb {buffer_kb} is below the minimum of {min_kb} KiB ({min_pages} pages of {page_size} bytes: reader page + 2 ring pages)")]
    BufferUnder {
        /// Asked for.
        buffer_kb: u64,
        /// The minimum.
        min_kb: u64,
        /// Pages of the smallest ring.
        min_pages: u64,
        /// `--page-size`.
        page_size: u64,
    },
    /// More pages per vCPU than a ring can have.
    #[error("{0} pages per vCPU is too many")]
    TooManyPages(u64),
    /// The ring geometry is not possible.
    #[error("trace region")]
    Geometry(#[source] ring::LayoutError),
    /// `--poll-ms 0`.
    #[error("--poll-ms must be at least 1")]
    PollMs,
    /// `--mailbox-timeout-ms 0`.
    #[error("--mailbox-timeout-ms must be at least 1")]
    MailboxTimeout,
    /// `--duration` out of range (the value parser catches it first).
    #[error("--duration {0} must be a positive number of seconds")]
    Duration(f64),
    /// `--guest` cannot be read.
    #[error("cannot read guest image {path}", path = .path.display())]
    ReadGuest {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The guest image is not a loadable ELF.
    #[error("bad guest image {name}")]
    BadImage {
        /// The image.
        name: String,
        /// Why.
        #[source]
        source: ElfError,
    },
    /// The guest image loads into the page tables.
    #[error("bad guest image {name}: loads at {start:#x}, below {LOW_END:#x} (reserved for page tables)")]
    ImageLow {
        /// The image.
        name: String,
        /// Its first byte.
        start: u64,
    },
    /// The guest image ends past the largest guest memory.
    #[error("bad guest image {name}: ends at {end:#x}, past the largest guest memory")]
    ImageHigh {
        /// The image.
        name: String,
        /// Its end.
        end: u64,
    },
    /// The rings do not fit the largest guest memory; a smaller `--buffer-kb` would.
    #[error("--buffer-kb {buffer_kb} with {vcpus} vCPUs needs {need_mb} MiB of guest memory, more than the limit of {max_mb} MiB: at most {fit_kb} KiB per vCPU fits (lower --buffer-kb or --vcpus)", max_mb = MAX_MEM_BYTES >> 20)]
    BufferMemory {
        /// `--buffer-kb`.
        buffer_kb: u64,
        /// `--vcpus`.
        vcpus: u32,
        /// Guest memory needed.
        need_mb: u64,
        /// The largest `--buffer-kb` that fits.
        fit_kb: u64,
    },
    /// Even the smallest rings do not fit the largest guest memory.
    #[error("{vcpus} vCPUs need {need_mb} MiB of guest memory even with the smallest rings, more than the limit of {max_mb} MiB (lower --vcpus or --page-size)", max_mb = MAX_MEM_BYTES >> 20)]
    VcpusMemory {
        /// `--vcpus`.
        vcpus: u32,
        /// Guest memory needed.
        need_mb: u64,
    },
    /// `--mem-mb` above the limit.
    #[error("--mem-mb {0} is more than the limit of {max} MiB", max = MAX_MEM_BYTES >> 20)]
    MemOver(u64),
    /// `--mem-mb` too small for what the run needs.
    #[error("--mem-mb {mem_mb} is too small: the guest image, stacks, parameters and a {trace}-byte trace region need {need_mb} MiB")]
    MemUnder {
        /// `--mem-mb`.
        mem_mb: u64,
        /// Trace region bytes.
        trace: u64,
        /// Guest memory needed.
        need_mb: u64,
    },
}

/// The trace region layout for `vcpus` rings of `pages_per_cpu` pages (reader page
/// included) of `page_size` bytes, with an event registration table.
pub fn ring_layout(
    vcpus: u32,
    pages_per_cpu: u64,
    page_size: u64,
    mode: ring::Mode,
    guest_swap: bool,
) -> Result<ring::RingGeometry, PlanError> {
    let pages = u32::try_from(pages_per_cpu).map_err(|_| PlanError::TooManyPages(pages_per_cpu))?;
    ring::RingGeometry::new(vcpus, pages, page_size as usize, mode, guest_swap)
        .and_then(|l| l.with_events(hyptrace_abi::registry::DEFAULT_TABLE_SIZE))
        .map_err(PlanError::Geometry)
}

/// The largest `n` in `lo..=hi` with `ok(n)`, for `ok` true up to some point and false
/// after it; `None` if `ok(lo)` is false. At most 64 probes.
fn largest(lo: u64, hi: u64, ok: impl Fn(u64) -> bool) -> Option<u64> {
    if hi < lo || !ok(lo) {
        return None;
    }
    if ok(hi) {
        return Some(hi);
    }
    // ok(good) && !ok(bad)
    let (mut good, mut bad) = (lo, hi);
    while bad - good > 1 {
        let mid = good + (bad - good) / 2;
        if ok(mid) {
            good = mid;
        } else {
            bad = mid;
        }
    }
    Some(good)
}

/// A validated `run` configuration: what the VM, the rings and the run loop need.
#[derive(Debug)]
pub struct Plan {
    /// The VM.
    pub cfg: VmConfig,
    /// The rings in its trace region.
    pub ring: ring::RingGeometry,
    /// The guest's run parameters.
    pub params: RunParams,
    /// `--duration`.
    pub duration: Option<Duration>,
    /// `--poll-ms`.
    pub poll: Duration,
    /// `--mailbox-timeout-ms`.
    pub mailbox_timeout: Duration,
    /// `--mode` (for the loss hint and `--stats`).
    pub mode: ring::Mode,
    /// What `--stats` echoes of the options.
    pub echo: OptionsEcho,
    /// `--clock`.
    pub clock: crate::vmm::time::ClockKind,
    /// `--host-events`.
    pub host_events: bool,
    /// `--host-trace`, `--host-trace-all`.
    pub host_trace: Option<crate::drain::host_trace::HostTraceSpec>,
    /// `-e` / `--disable`: the events to record.
    pub events: crate::vmm::registration::Selection,
    /// `--drain`, `--hang-timeout`, `--crash-dump`, `--trace-mem`.
    pub flight: FlightPlan,
}

/// The flight recorder options of a run.
#[derive(Debug, Clone, Default)]
pub struct FlightPlan {
    /// `--drain live` (the default): the reader drains while the guest runs.
    pub drain_live: bool,
    /// `--hang-timeout`.
    pub hang_timeout: Option<Duration>,
    /// `--crash-dump` (explicit, or trace.dat for `run --drain none`; see
    /// [`FlightPlan::for_record`]).
    pub crash_dump: Option<PathBuf>,
    /// `--trace-mem`.
    pub trace_mem: Option<PathBuf>,
}

impl FlightPlan {
    fn new(a: &crate::pipeline::options::FlightArgs) -> Result<Self, PlanError> {
        let hang_timeout = match a.hang_timeout {
            None => None,
            Some(s) if s.is_finite() && s > 0.0 && s < MAX_DURATION_S => {
                Some(Duration::from_secs_f64(s))
            }
            Some(s) => return Err(PlanError::Duration(s)),
        };
        let drain_live = a.drain == crate::pipeline::options::DrainArg::Live;
        Ok(Self {
            drain_live,
            hang_timeout,
            crash_dump: a
                .crash_dump
                .clone()
                .or_else(|| (!drain_live).then(|| PathBuf::from("trace.dat"))),
            trace_mem: a.trace_mem.clone(),
        })
    }

    /// `record`: its own output gets a crash's events, so there is no default crash
    /// dump file (only an explicit `--crash-dump`).
    pub fn for_record(&mut self, a: &crate::pipeline::options::FlightArgs) {
        self.crash_dump = a.crash_dump.clone();
    }
}

/// The options `--stats` repeats.
#[derive(Debug, Clone)]
pub struct OptionsEcho {
    /// `--workload`, lower case.
    pub workload: String,
    /// `--mode`, lower case.
    pub mode: String,
    /// `--swap`, lower case.
    pub swap: String,
    /// `--vcpus`.
    pub vcpus: u32,
    /// `--events`.
    pub events: u64,
    /// `--rate`.
    pub rate: u64,
}

/// The ring: its size checked against the page size, its page count.
fn ring_pages(a: &RunArgs) -> Result<u64, PlanError> {
    if a.vcpus == 0 {
        return Err(PlanError::NoVcpus);
    }
    if a.vcpus > MAX_VCPUS {
        return Err(PlanError::TooManyVcpus(a.vcpus));
    }
    if !a.page_size.is_power_of_two() || a.page_size < ring::MIN_PAGE_SIZE as u64 {
        return Err(PlanError::PageSize(a.page_size));
    }
    if a.page_size > ring::MAX_PAGE_SIZE as u64 {
        return Err(PlanError::PageSizeOver(a.page_size));
    }
    let min_pages = ring::MIN_PAGES_PER_CPU as u64;
    // Every ring lives in guest memory: no vCPU's can be larger than all of it.
    if a.buffer_kb > MAX_MEM_BYTES / 1024 {
        return Err(PlanError::BufferOver(a.buffer_kb));
    }
    let buffer = a.buffer_kb * 1024;
    if buffer < min_pages * a.page_size {
        return Err(PlanError::BufferUnder {
            buffer_kb: a.buffer_kb,
            min_kb: min_pages * a.page_size / 1024,
            min_pages,
            page_size: a.page_size,
        });
    }
    Ok(buffer.div_ceil(a.page_size))
}

/// The guest image (`--guest` or the embedded one), parsed and placed.
fn guest_image(a: &RunArgs) -> Result<(Cow<'static, [u8]>, GuestImage), PlanError> {
    let (elf, name): (Cow<'static, [u8]>, String) = match &a.guest {
        None => (Cow::Borrowed(GUEST_ELF), "embedded guest".into()),
        Some(p) => {
            let bytes = std::fs::read(p).map_err(|source| PlanError::ReadGuest {
                path: p.clone(),
                source,
            })?;
            (Cow::Owned(bytes), p.display().to_string())
        }
    };
    let image = match GuestImage::parse(&elf) {
        Ok(i) => i,
        Err(source) => return Err(PlanError::BadImage { name, source }),
    };
    if image.start < LOW_END {
        return Err(PlanError::ImageLow {
            name,
            start: image.start,
        });
    }
    if image.end > MAX_MEM_BYTES {
        return Err(PlanError::ImageHigh {
            name,
            end: image.end,
        });
    }
    Ok((elf, image))
}

/// Guest memory for the image, stacks and a trace region of `trace` bytes: what
/// `--mem-mb` asks, or just enough.
fn guest_memory(a: &RunArgs, image: &GuestImage, pages: u64, trace: u64) -> Result<u64, PlanError> {
    let align = a.page_size;
    let need = GuestMemoryMap::required_mem(image, a.vcpus, trace, align).max(MIN_MEM_BYTES);
    let need_mb = need.div_ceil(1 << 20);
    if need > MAX_MEM_BYTES {
        let fits = |pages: u64| {
            ring_layout(
                a.vcpus,
                pages,
                a.page_size,
                a.mode.into(),
                a.swap == SwapArg::Guest,
            )
            .is_ok_and(|l| {
                GuestMemoryMap::required_mem(image, a.vcpus, l.region_size as u64, align)
                    .max(MIN_MEM_BYTES)
                    <= MAX_MEM_BYTES
            })
        };
        return Err(match largest(ring::MIN_PAGES_PER_CPU as u64, pages, fits) {
            Some(p) => PlanError::BufferMemory {
                buffer_kb: a.buffer_kb,
                vcpus: a.vcpus,
                need_mb,
                fit_kb: p * a.page_size / 1024,
            },
            None => PlanError::VcpusMemory {
                vcpus: a.vcpus,
                need_mb,
            },
        });
    }
    match a.mem_mb {
        None => Ok(need),
        Some(mb) if mb > MAX_MEM_BYTES >> 20 => Err(PlanError::MemOver(mb)),
        Some(mb) => {
            let bytes = (mb << 20).div_ceil(HUGE_PAGE) * HUGE_PAGE;
            if bytes < need {
                return Err(PlanError::MemUnder {
                    mem_mb: mb,
                    trace,
                    need_mb,
                });
            }
            Ok(bytes)
        }
    }
}

impl Plan {
    /// Checks the options of a run, once.
    pub fn new(a: &RunArgs) -> Result<Self, PlanError> {
        let pages = ring_pages(a)?;
        let ring = ring_layout(
            a.vcpus,
            pages,
            a.page_size,
            a.mode.into(),
            a.swap == SwapArg::Guest,
        )?;
        let trace = ring.region_size as u64;
        if a.poll_ms == 0 {
            return Err(PlanError::PollMs);
        }
        if a.mailbox_timeout_ms == 0 {
            return Err(PlanError::MailboxTimeout);
        }
        let duration = match a.duration {
            None => None,
            Some(s) if s.is_finite() && s > 0.0 && s < MAX_DURATION_S => {
                Some(Duration::from_secs_f64(s))
            }
            Some(s) => return Err(PlanError::Duration(s)),
        };
        let (elf, image) = guest_image(a)?;
        let mem_bytes = guest_memory(a, &image, pages, trace)?;
        let flags = if a.swap == SwapArg::Guest {
            RUN_FLAG_SERVE_MAILBOX
        } else {
            0
        };
        Ok(Plan {
            ring,
            cfg: VmConfig {
                vcpus: a.vcpus,
                mem_bytes,
                guest_elf: elf,
                trace_region_bytes: trace,
                trace_region_align: a.page_size,
                doorbell: a.doorbell.into(),
            },
            params: RunParams {
                workload: a.workload.into(),
                events: a.events,
                rate: a.rate,
                seed: DEFAULT_SEED,
                flags,
                burst: 0,
                payload: 0,
                clock: a.clock.into(),
            },
            duration,
            poll: Duration::from_millis(a.poll_ms),
            mailbox_timeout: Duration::from_millis(a.mailbox_timeout_ms),
            mode: a.mode.into(),
            events: crate::vmm::registration::Selection {
                enable: a.event.clone(),
                disable: a.disable.clone(),
            },
            clock: a.clock.into(),
            host_events: a.host_events,
            host_trace: crate::drain::host_trace::HostTraceSpec::parse(
                &a.host_trace,
                a.host_trace_all,
            ),
            echo: OptionsEcho {
                workload: format!("{:?}", a.workload).to_lowercase(),
                mode: format!("{:?}", a.mode).to_lowercase(),
                swap: format!("{:?}", a.swap).to_lowercase(),
                vcpus: a.vcpus,
                events: a.events,
                rate: a.rate,
            },
            flight: FlightPlan::new(&a.flight)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::options::{parse_duration, parse_run};

    fn args(extra: &[&str]) -> RunArgs {
        parse_run(extra).expect("parses")
    }

    fn plan(a: &RunArgs) -> Result<Plan, PlanError> {
        Plan::new(a)
    }

    #[test]
    fn defaults_plan() {
        let p = plan(&args(&[])).expect("default plan");
        assert_eq!(p.cfg.vcpus, 2);
        assert_eq!(p.params.events, 100_000);
        assert!(p.cfg.mem_bytes >= p.cfg.trace_region_bytes);
    }

    fn parse_err(extra: &[&str]) -> String {
        match parse_run(extra) {
            Ok(c) => panic!("{extra:?} parsed: {c:?}"),
            Err(e) => e.render().to_string(),
        }
    }

    #[test]
    fn range_errors_name_the_flag_and_the_limit() {
        for (bad, needles) in [
            (&["--vcpus", "0"][..], &["--vcpus", "1..=256"][..]),
            (&["--vcpus", "-1"], &["--vcpus", "1..=256"]),
            (&["--vcpus", "100000"], &["--vcpus", "1..=256"]),
            (
                &["--duration", "inf"],
                &["--duration", "finite", "1000000000"],
            ),
            (&["--duration", "nan"], &["--duration", "not a number"]),
            (&["--duration", "-1"], &["--duration", "more than 0"]),
            (&["--duration", "0"], &["--duration", "more than 0"]),
            (&["--duration", "1e10"], &["--duration", "limit"]),
            (&["--workload", "nope"], &["possible values: steady, mixed"]),
        ] {
            let e = parse_err(bad);
            for n in needles {
                assert!(e.contains(n), "{bad:?}: {e:?} lacks {n:?}");
            }
        }
        let e = plan(&args(&["--buffer-kb", "99999999999"]))
            .expect_err("accepted")
            .to_string();
        assert!(
            e.contains("--buffer-kb") && e.contains("3145728 KiB"),
            "{e}"
        );
        assert_eq!(parse_duration("0.5"), Ok(0.5));
    }

    /// The largest --buffer-kb the memory-limit message names is accepted, one page more
    /// is not.
    #[test]
    fn buffer_limit_is_exact() {
        let e = plan(&args(&["--vcpus", "256", "--buffer-kb", "65536"]))
            .expect_err("fits?")
            .to_string();
        let max: u64 = e
            .split("at most ")
            .nth(1)
            .and_then(|t| t.split(' ').next())
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("no limit in {e}"));
        assert!(
            e.contains("guest memory") && e.contains("--buffer-kb"),
            "{e}"
        );
        let ok = max.to_string();
        plan(&args(&["--vcpus", "256", "--buffer-kb", &ok])).expect("the limit fits");
        let over = (max + 4).to_string();
        assert!(plan(&args(&["--vcpus", "256", "--buffer-kb", &over])).is_err());
    }

    #[test]
    fn largest_search() {
        assert_eq!(largest(3, 100, |n| n <= 42), Some(42));
        assert_eq!(largest(3, 100, |_| true), Some(100));
        assert_eq!(largest(3, 100, |_| false), None);
        assert_eq!(largest(3, 3, |n| n == 3), Some(3));
        assert_eq!(largest(5, 3, |_| true), None);
    }

    #[test]
    fn rejects_bad_input() {
        for bad in [
            &["--page-size", "5000"][..],
            &["--page-size", "2048"],
            &["--buffer-kb", "8"],
            &["--mem-mb", "1"],
            &["--mem-mb", "100000"],
            &["--poll-ms", "0"],
            &["--guest", "/nonexistent/guest.elf"],
            &["--vcpus", "256", "--buffer-kb", "65536"],
        ] {
            assert!(plan(&args(bad)).is_err(), "{bad:?} accepted");
        }
    }
}
