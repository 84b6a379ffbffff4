//! Which registered events a run records: the selection (`-e` / `--disable` patterns in
//! the CLI), the names they match, and the registered events as `list` shows them.

use hyptrace_output::format::glob;
use hyptrace_reader::registry::{RegField, Registration, Registry};

/// Which events a run records: `enable` patterns (none = every registered event), then
/// `disable` patterns. A pattern is `all`, `SYSTEM:EVENT` (globs in either part) or a
/// bare word naming a system or an event ([`matches()`]).
///
/// # Examples
///
/// ```
/// let s = hyptrace_embed::Selection { enable: vec!["guest:*".into()], disable: vec!["span".into()] };
/// assert_eq!(s, s.clone());
/// assert!(hyptrace_embed::Selection::default().enable.is_empty()); // everything
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selection {
    /// Patterns of the events to enable; empty = all.
    pub enable: Vec<String>,
    /// Patterns of the events to leave disabled.
    pub disable: Vec<String>,
}

/// Errors of event selection.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EventsError {
    /// A pattern matches no registered event.
    #[error("unknown event {pattern:?} (the guest registered: {known}){elsewhere}")]
    Unknown {
        /// The pattern.
        pattern: String,
        /// The registered events, comma-separated (or "none").
        known: String,
        /// Where the pattern names events instead, as the end of the message (`; ...`),
        /// or empty (the caller's hint, e.g. the host kernel's events).
        elsewhere: String,
    },
    /// The guest has not registered its events (yet, or it never does).
    #[error("the guest has not registered any events")]
    NotRegistered,
}

/// One registered event, as `list` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventInfo {
    /// The registration.
    pub reg: Registration,
    /// Whether its bit is set on every CPU.
    pub enabled: bool,
}

impl EventInfo {
    /// `system:name` and its fields, as `trace-cmd list -e -F` prints an event (the
    /// common fields left out).
    /// # Examples
    ///
    /// ```
    /// # use std::{sync::Arc, time::Duration};
    /// # use hyptrace_abi::{layout::{Mode, RingGeometry}, registry::DEFAULT_TABLE_SIZE, HeapMem};
    /// # use hyptrace_embed::{Events, Exit, Selection, Tracer};
    /// # hyptrace_writer::event! {
    /// #     pub struct Tick { system: "demo", name: "tick", slot: 0, id: 0,
    /// #         print: "\"n=%u\", REC->n", fields: { n: u32 } }
    /// # }
    /// # let geometry = RingGeometry::new(1, 4, 4096, Mode::Stop, false)?.with_events(DEFAULT_TABLE_SIZE)?;
    /// # let mem = Arc::new(HeapMem::new(geometry.region_size));
    /// # let cb = hyptrace_reader::callbacks::for_geometry(mem.clone(), geometry, Duration::from_secs(5));
    /// # let tracer = Tracer::alloc(mem.clone(), geometry, cb, 1_000_000)?;
    /// # let register = |events: &Events<Arc<HeapMem>>| -> Result<(), Box<dyn std::error::Error>> {
    /// #     hyptrace_writer::events::register(&*mem, &[Tick::event()], || { events.on_register(0); })?;
    /// #     Ok(())
    /// # };
    /// let events = Events::new(mem.clone(), geometry);
    /// register(&events)?;
    /// let text = events.list()?[0].describe();
    /// assert!(text.starts_with("demo:tick"), "{text}");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn describe(&self) -> String {
        let mut s = format!("{}\n", self.reg.full_name());
        for f in &self.reg.fields {
            s.push_str(&format!(
                "\tfield:{};\toffset:{};\tsize:{};\tsigned:{};\n",
                decl(f),
                f.offset,
                f.size,
                u8::from(f.signed)
            ));
        }
        s
    }
}

fn decl(f: &RegField) -> String {
    let arr = f.ctype.ends_with(']') && !f.ctype.starts_with("__data_loc");
    match (arr, f.ctype.find('[')) {
        (true, Some(i)) => format!("{} {}{}", &f.ctype[..i], f.name, &f.ctype[i..]),
        _ => format!("{} {}", f.ctype, f.name),
    }
}

/// Whether pattern `pat` names event `system:name`: `all`, `SYSTEM:EVENT` (globs in
/// either part), or a bare word that is the system or the event name (as trace-cmd's
/// `-e`).
///
/// # Examples
///
/// ```
/// use hyptrace_embed::matches;
/// assert!(matches("guest:m*", "guest", "marker") && matches("marker", "guest", "marker"));
/// assert!(!matches("mark", "guest", "marker"));
/// ```
pub fn matches(pat: &str, system: &str, name: &str) -> bool {
    if pat == "all" {
        return true;
    }
    match pat.split_once(':') {
        Some((s, n)) => glob(s, system) && glob(n, name),
        None => glob(pat, system) || glob(pat, name),
    }
}

/// The enable bit of `slot` (0 for a slot past the word: never enabled; the registry
/// refuses such slots anyway).
pub(crate) fn bit(slot: u32) -> u64 {
    1u64.checked_shl(slot).unwrap_or(0)
}

/// The bits of the events `pattern` names; none is an error.
pub(crate) fn mask_of(reg: &Registry, pattern: &str) -> Result<u64, EventsError> {
    let mask = reg
        .events
        .iter()
        .filter(|e| matches(pattern, &e.system, &e.name))
        .fold(0u64, |m, e| m | bit(e.slot));
    if mask == 0 {
        let known: Vec<String> = reg.events.iter().map(Registration::full_name).collect();
        return Err(EventsError::Unknown {
            pattern: pattern.to_string(),
            known: if known.is_empty() {
                "none".into()
            } else {
                known.join(", ")
            },
            elsewhere: String::new(),
        });
    }
    Ok(mask)
}

impl Selection {
    /// The enable mask of this selection over `reg`.
    pub(crate) fn mask(&self, reg: &Registry) -> Result<u64, EventsError> {
        let mut mask = if self.enable.is_empty() {
            reg.events.iter().fold(0u64, |m, e| m | bit(e.slot))
        } else {
            let mut m = 0;
            for p in &self.enable {
                m |= mask_of(reg, p)?;
            }
            m
        };
        for p in &self.disable {
            mask &= !mask_of(reg, p)?;
        }
        Ok(mask)
    }
}

#[cfg(test)]
mod tests {
    use super::matches;

    #[test]
    fn globs() {
        assert!(matches("all", "a", "b"));
        assert!(matches("guest:*", "guest", "marker"));
        assert!(!matches("guest:*", "other", "marker"));
        assert!(matches("guest", "guest", "marker"));
        assert!(matches("marker", "guest", "marker"));
        assert!(matches("*:mark*", "guest", "marker"));
        assert!(matches("g?est:m*r", "guest", "marker"));
        assert!(!matches("mark", "guest", "marker"));
        assert!(!matches("guest:span", "guest", "marker"));
    }
}
