//! Kernel symbols stored in a trace.dat: the `kallsyms` section (function addresses for
//! `%pS`/`%ps` and the plugins) and the `printk formats` section (addresses of constant
//! strings that events store as pointers, printed with `%s`).

use std::collections::HashMap;

/// Most symbols kept from one file (a full x86_64 kallsyms has ~200k).
const MAX_SYMBOLS: usize = 4 << 20;

/// The symbol tables of one trace.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelSymbols {
    /// (address, name), sorted by address.
    funcs: Vec<(u64, Box<str>)>,
    /// printk format address → string.
    printk: HashMap<u64, Box<str>>,
}

/// A resolved address: the symbol at or below it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Symbol<'a> {
    /// Symbol name.
    pub name: &'a str,
    /// Symbol address.
    pub addr: u64,
}

impl KernelSymbols {
    /// No symbols.
    pub fn new() -> Self {
        Self::default()
    }

    /// Parses the text of `/proc/kallsyms` (`ADDR TYPE NAME [MODULE]` lines); bad lines
    /// and zero addresses are skipped.
    pub fn parse_kallsyms(&mut self, text: &[u8]) {
        for line in text.split(|&b| b == b'\n') {
            if self.funcs.len() >= MAX_SYMBOLS {
                break;
            }
            let line = String::from_utf8_lossy(line);
            let mut it = line.split_ascii_whitespace();
            let (Some(a), Some(_ty), Some(name)) = (it.next(), it.next(), it.next()) else {
                continue;
            };
            match u64::from_str_radix(a, 16) {
                Ok(addr) if addr != 0 => self.funcs.push((addr, name.into())),
                _ => {}
            }
        }
        self.funcs.sort_by_key(|f| f.0);
    }

    /// Parses the `printk formats` section (`0xADDR : "text"` lines, C escapes).
    pub fn parse_printk(&mut self, text: &[u8]) {
        for line in text.split(|&b| b == b'\n') {
            if self.printk.len() >= MAX_SYMBOLS {
                break;
            }
            let line = String::from_utf8_lossy(line);
            let Some((a, s)) = line.split_once(':') else {
                continue;
            };
            let a = a.trim();
            let a = a
                .strip_prefix("0x")
                .or_else(|| a.strip_prefix("0X"))
                .unwrap_or(a);
            let Ok(addr) = u64::from_str_radix(a, 16) else {
                continue;
            };
            let s = s.trim();
            let s = s.strip_prefix('"').unwrap_or(s);
            let s = s.strip_suffix('"').unwrap_or(s);
            self.printk.insert(addr, unescape(s).into());
        }
    }

    /// Whether there are no function symbols.
    pub fn is_empty(&self) -> bool {
        self.funcs.is_empty()
    }

    /// The function symbol at or below `addr` (the last one at that address), if any.
    pub fn lookup(&self, addr: u64) -> Option<Symbol<'_>> {
        let i = self.funcs.partition_point(|f| f.0 <= addr);
        let (a, n) = self.funcs.get(i.checked_sub(1)?)?;
        Some(Symbol { name: n, addr: *a })
    }

    /// The printk string stored at `addr`.
    pub fn printk(&self, addr: u64) -> Option<&str> {
        self.printk.get(&addr).map(|s| &**s)
    }
}

fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut it = s.chars();
    while let Some(c) = it.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some('r') => out.push('\r'),
            Some('"') => out.push('"'),
            Some('\\') => out.push('\\'),
            Some(o) => {
                out.push('\\');
                out.push(o);
            }
            None => out.push('\\'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kallsyms_lookup() {
        let mut k = KernelSymbols::new();
        k.parse_kallsyms(b"ffffffff81000010 T b\nffffffff81000000 T a\nbad\n0000000000000000 A z\nffffffff81000020 t c [kvm]\n");
        assert_eq!(k.lookup(0xffffffff80ffffff), None);
        assert_eq!(k.lookup(0xffffffff81000000).unwrap().name, "a");
        assert_eq!(k.lookup(0xffffffff8100000f).unwrap().name, "a");
        assert_eq!(k.lookup(0xffffffff81000011).unwrap().name, "b");
        assert_eq!(k.lookup(u64::MAX).unwrap().name, "c");
        k.parse_printk(b"0xffffffff82000000 : \"hello\\n\"\nnonsense\n");
        assert_eq!(k.printk(0xffffffff82000000), Some("hello\n"));
        assert_eq!(k.printk(1), None);
    }
}
