//! Where an `-e` / `--disable` pattern that names no guest event points instead: the
//! host kernel's events, which `--host-trace` records (`-e sched` is a common slip).

use crate::drain::host_trace::{read_text, selects, tracefs_root};
use crate::vmm::registration::EventsError;

/// Event systems every Linux tracefs has: what names a host event when
/// `available_events` cannot be read (tracefs is root's, mode 0700).
const WELL_KNOWN_SYSTEMS: &[&str] = &[
    "block",
    "exceptions",
    "irq",
    "irq_vectors",
    "kmem",
    "kvm",
    "kvmmmu",
    "module",
    "net",
    "power",
    "raw_syscalls",
    "rcu",
    "sched",
    "signal",
    "syscalls",
    "task",
    "timer",
    "workqueue",
    "writeback",
];

/// `e` with the host kernel's events named, if its pattern names some.
pub fn with_hint(e: EventsError) -> EventsError {
    match e {
        EventsError::Unknown {
            pattern,
            known,
            elsewhere,
        } if elsewhere.is_empty() => {
            let available = read_text(&tracefs_root().join("available_events")).ok();
            let elsewhere = hint(&pattern, available.as_deref()).unwrap_or_default();
            EventsError::Unknown {
                pattern,
                known,
                elsewhere,
            }
        }
        e => e,
    }
}

/// The end of the unknown-event message for `pattern`, if it names host kernel events
/// (`available`: tracefs's `available_events`, `system:event` a line, if readable; else
/// the pattern's system part is looked up in the well-known systems). Matching is
/// `--host-trace`'s, so the command it suggests selects them.
pub fn hint(pattern: &str, available: Option<&str>) -> Option<String> {
    if pattern == "all" || pattern.is_empty() {
        return None;
    }
    let system = match available {
        Some(text) => {
            let mut hits = text
                .lines()
                .filter_map(|l| l.trim().split_once(':'))
                .filter(|(s, e)| selects(pattern, s, e));
            let (sys, ev) = hits.next()?;
            if sys == pattern {
                true
            } else if hits.next().is_none() {
                return Some(suggest(
                    pattern,
                    &format!("is the host kernel event {sys}:{ev}"),
                ));
            } else {
                false
            }
        }
        None => {
            let sys = pattern.split_once(':').map_or(pattern, |(s, _)| s);
            if !WELL_KNOWN_SYSTEMS
                .iter()
                .any(|w| hyptrace_output::format::glob(sys, w))
            {
                return None;
            }
            sys == pattern
        }
    };
    Some(suggest(
        pattern,
        if system {
            "is a host kernel event system"
        } else {
            "names host kernel events"
        },
    ))
}

/// `; "PATTERN" SAYS: record it with --host-trace PATTERN`.
fn suggest(pattern: &str, says: &str) -> String {
    format!(
        "; {pattern:?} {says}: record it with --host-trace {}",
        crate::exit::printable(pattern)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const AVAILABLE: &str = "sched:sched_switch\nsched:sched_wakeup\nirq:irq_handler_entry\n";

    #[test]
    fn host_events_are_named() {
        let h = |p: &str, a| hint(p, a).unwrap_or_default();
        assert_eq!(
            h("sched", Some(AVAILABLE)),
            "; \"sched\" is a host kernel event system: record it with --host-trace sched"
        );
        assert_eq!(
            h("sched_switch", Some(AVAILABLE)),
            "; \"sched_switch\" is the host kernel event sched:sched_switch: record it with --host-trace sched_switch"
        );
        assert!(h("sched:*", Some(AVAILABLE)).contains("names host kernel events"));
        assert!(h("irq", None).contains("is a host kernel event system"));
        assert!(h("kvm:kvm_exit", None).contains("names host kernel events"));
        // Not a host event, or `all` (every guest event): nothing to add.
        for p in ["nope", "all", "", "guest:marker"] {
            assert_eq!(hint(p, Some(AVAILABLE)), None, "{p}");
            assert_eq!(hint(p, None), None, "{p}");
        }
        let e = with_hint(EventsError::Unknown {
            pattern: "nope".into(),
            known: "g:a".into(),
            elsewhere: String::new(),
        });
        assert_eq!(
            e.to_string(),
            "unknown event \"nope\" (the guest registered: g:a)"
        );
    }
}
