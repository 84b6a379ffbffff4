//! Per-event-id values found by indexing, not hashing: the per-event lookup of a sink
//! (an event id is a `u16`, so a dense table of every id costs 256 KiB of index and
//! one load per lookup; the table's pages an id never touches are never read).

/// Values of some event ids, looked up by [`IdTable::get`] in one indexed load.
#[derive(Clone, Debug)]
pub(crate) struct IdTable<T> {
    /// Per id: 0 for none, else the value's index + 1 (every id fits: at most 2^16
    /// values).
    index: Box<[u32]>,
    values: Vec<T>,
}

impl<T> Default for IdTable<T> {
    fn default() -> Self {
        Self::new()
    }
}

/// Number of event ids (`u16`).
const IDS: usize = 1 << 16;

impl<T> IdTable<T> {
    /// An empty table (the index is allocated zeroed: untouched pages stay unmapped).
    pub(crate) fn new() -> Self {
        Self {
            index: vec![0u32; IDS].into_boxed_slice(),
            values: Vec::new(),
        }
    }

    /// Sets the value of `id` (replacing an earlier one).
    pub(crate) fn insert(&mut self, id: u16, value: T) {
        let slot = &mut self.index[usize::from(id)];
        match *slot as usize {
            0 => {
                self.values.push(value);
                // At most 2^16 values (one per id): the count fits a u32.
                *slot = self.values.len() as u32;
            }
            k => self.values[k - 1] = value,
        }
    }

    /// The value of `id`.
    #[inline]
    pub(crate) fn get(&self, id: u16) -> Option<&T> {
        match self.index[usize::from(id)] as usize {
            0 => None,
            k => self.values.get(k - 1),
        }
    }

    /// Whether no id holds a value.
    pub(crate) fn is_empty(&self) -> bool {
        self.values.is_empty()
    }
}

impl<T> FromIterator<(u16, T)> for IdTable<T> {
    fn from_iter<I: IntoIterator<Item = (u16, T)>>(iter: I) -> Self {
        let mut t = Self::new();
        for (id, v) in iter {
            t.insert(id, v);
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_insert_replace() {
        let mut t: IdTable<&str> = [(7, "a"), (u16::MAX, "b"), (0, "z")].into_iter().collect();
        assert_eq!(t.get(7), Some(&"a"));
        assert_eq!(t.get(u16::MAX), Some(&"b"));
        assert_eq!(t.get(0), Some(&"z"));
        assert_eq!(t.get(8), None);
        t.insert(7, "c");
        assert_eq!(t.get(7), Some(&"c"));
        assert!(!t.is_empty());
        assert!(IdTable::<u8>::new().is_empty());
    }

    #[test]
    fn every_id_fits() {
        let mut t = IdTable::new();
        for id in 0..=u16::MAX {
            t.insert(id, id);
        }
        assert!((0..=u16::MAX).all(|id| t.get(id) == Some(&id)));
    }
}
