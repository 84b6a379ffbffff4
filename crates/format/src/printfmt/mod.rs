//! The event print-format language (`print fmt:` of a format file), compiled once per
//! event into a [`Program`] and run per event with no allocation beyond the output
//! string. Output follows `trace-cmd report` (libtraceevent 1.7, trace-cmd 3.1.6) as
//! observed on real kernel traces (tests/fixtures/kernel):
//!
//! - printf conversions `%d %i %u %x %X %o %c %s %p` with flags, width, precision and
//!   `h hh l ll L z` lengths (the value is cut to the C type the length names; `l` is the
//!   trace's `sizeof(long)`), `%p` prints `0x...` or `(nil)`, `%pS`/`%pF`/`%pB` print
//!   `symbol+0xoffset` and `%ps`/`%pf` `symbol` from the trace's kallsyms;
//! - `REC->field`, C integer arithmetic (`+ - * / % << >> & | ^ ! ~ == != < > <= >= && ||`)
//!   in 64 bits with C's signedness, `?:`, casts (cut and sign-extend to the type's size;
//!   pointer and unknown typedef casts keep the value), `sizeof(type)`, `true`/`false`;
//!   an identifier the format cannot define (`vmemmap_base`, an enum constant) is 0 in
//!   arithmetic and matches nothing as a `__print_symbolic`/`__print_flags` value;
//! - `__print_symbolic` (the name of the first entry equal to the value, else `0x...`),
//!   `__print_flags` (names of the entries whose bits are all set, in table order, joined
//!   by the delimiter, the remaining bits as `0x...`), `__print_hex` (`%02x` bytes joined
//!   by spaces), `__print_hex_str` (no spaces), `__print_array`, `__get_str`,
//!   `__get_dynamic_array(_len)`, `__get_bitmask`;
//! - `%s` of an integer (a `const char *` pointing at a constant string) prints the
//!   trace's printk-format string at that address.
//!
//! Anything else (statement expressions, `%pI4`...) is [`Unsupported`]: the caller prints
//! the fields raw.

mod expr;
mod guest;
mod parse;

pub use expr::{FieldRef, Program, Unsupported};
pub use guest::{check_guest_format, GuestFormatError, MAX_GUEST_WIDTH};

use crate::escape::escape_guest_bytes;
use crate::format::EventFormat;
use crate::symbols::KernelSymbols;
use expr::{bytes_of, cut, eval, Conv, Expr, Kind, Net, Op, Spec};

/// Appends `v` as `0x...` lower-case hex.
pub fn push_hex(out: &mut String, v: u64) {
    out.push_str("0x");
    push_hex_digits(out, v, false);
}

fn push_hex_digits(out: &mut String, v: u64, upper: bool) {
    let digits: &[u8; 16] = if upper {
        b"0123456789ABCDEF"
    } else {
        b"0123456789abcdef"
    };
    let mut buf = [0u8; 16];
    let mut i = buf.len();
    let mut v = v;
    loop {
        i -= 1;
        buf[i] = digits[(v & 15) as usize];
        v >>= 4;
        if v == 0 {
            break;
        }
    }
    // The buffer holds only ASCII hex digits.
    out.push_str(std::str::from_utf8(&buf[i..]).unwrap_or(""));
}

/// Appends a symbol: `name+0xoff` (`offset`) or `name`; `0x...` when unknown.
pub fn push_sym(out: &mut String, syms: &KernelSymbols, v: u64, offset: bool) {
    match syms.lookup(v) {
        Some(s) => {
            push_lit(out, s.name);
            if offset {
                out.push('+');
                push_hex(out, v.wrapping_sub(s.addr));
            }
        }
        None => push_hex(out, v),
    }
}

/// Left- or right-pads what was appended since `start` to `width` characters.
fn pad_from(out: &mut String, start: usize, width: Option<u16>, left: bool) {
    let Some(w) = width else { return };
    let n = out[start..].chars().count();
    let w = usize::from(w);
    if n >= w {
        return;
    }
    if left {
        out.extend(std::iter::repeat_n(' ', w - n));
    } else {
        const SP: &str = "                                                                ";
        let mut k = w - n;
        while k > 0 {
            let m = k.min(SP.len());
            out.insert_str(start, &SP[..m]);
            k -= m;
        }
    }
}

/// Context of one run of a program.
struct Ctx<'a> {
    p: &'a [u8],
    syms: &'a KernelSymbols,
    long_size: u8,
}

impl Ctx<'_> {
    /// Appends a string-valued expression.
    fn render(&self, e: &Expr, out: &mut String) -> Option<()> {
        match e {
            Expr::Str(s) => push_lit(out, s),
            Expr::Field(f) if f.kind == Kind::Array(true) && f.size == 0 => {
                push_flexible_str(out, f.bytes(self.p)?)
            }
            Expr::Field(f) if f.kind != Kind::Int => escape_guest_bytes(out, f.bytes(self.p)?),
            Expr::StrField(f) => escape_guest_bytes(out, f.bytes(self.p)?),
            Expr::Cond(c, a, b) => {
                if eval(c, self.p)?.v != 0 {
                    self.render(a, out)?
                } else {
                    self.render(b, out)?
                }
            }
            Expr::Symbolic(v, table) => {
                let v = eval(v, self.p)?.v;
                match table.iter().find(|(x, _)| *x == v) {
                    Some((_, name)) => push_lit(out, name),
                    None => push_hex(out, v),
                }
            }
            Expr::Flags(v, delim, table) => {
                // libtraceevent's rules, as trace-cmd prints them: a zero value prints
                // the first entry whose value is negative (an unknown constant is -1);
                // else the entries with positive values whose bits are all set.
                let mut v = eval(v, self.p)?.v;
                let mut first = true;
                if v == 0 {
                    if let Some((_, name)) = table.iter().find(|(x, _)| (*x as i64) < 0) {
                        push_lit(out, name);
                    }
                    return Some(());
                }
                for &(x, ref name) in table {
                    if (x as i64) > 0 && v & x == x {
                        if !first {
                            push_lit(out, delim);
                        }
                        first = false;
                        push_lit(out, name);
                        v &= !x;
                    }
                }
                if v != 0 {
                    if !first {
                        push_lit(out, delim);
                    }
                    push_hex(out, v);
                }
            }
            Expr::Hex(b, n, spaced) => {
                let b = bytes_of(b, self.p)?;
                let n = usize::try_from(eval(n, self.p)?.v).ok()?.min(b.len());
                for (i, x) in b[..n].iter().enumerate() {
                    if i > 0 && *spaced {
                        out.push(' ');
                    }
                    push_byte_hex(out, *x);
                }
            }
            Expr::Array(b, n, el) => {
                let b = bytes_of(b, self.p)?;
                let n = usize::try_from(eval(n, self.p)?.v).ok()?;
                let el = usize::try_from(eval(el, self.p)?.v).ok()?;
                if !matches!(el, 1 | 2 | 4 | 8) {
                    return None;
                }
                out.push('{');
                for (i, c) in b.chunks_exact(el).take(n).enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    let mut w = [0u8; 8];
                    w[..el].copy_from_slice(c);
                    push_hex(out, u64::from_le_bytes(w));
                }
                out.push('}');
            }
            Expr::Bitmask(f) => {
                let b = f.bytes(self.p)?;
                // 32-bit words, most significant first, `%08x` joined by commas.
                let words = b.len().div_ceil(4);
                for i in (0..words).rev() {
                    let mut w = [0u8; 4];
                    let c = &b[i * 4..(i * 4 + 4).min(b.len())];
                    w[..c.len()].copy_from_slice(c);
                    let v = u32::from_le_bytes(w);
                    let st = out.len();
                    push_hex_digits(out, u64::from(v), false);
                    let len = out.len() - st;
                    for _ in len..8 {
                        out.insert(st, '0');
                    }
                    if i > 0 {
                        out.push(',');
                    }
                }
            }
            e => {
                // An integer used as a string: a pointer to a constant (printk) string.
                let v = eval(e, self.p)?.v;
                out.push_str(self.syms.printk(v)?);
            }
        }
        Some(())
    }

    /// `*` width (negative: left-justified) and precision (negative: none), as C.
    fn star_conv(
        &self,
        sp: &Spec,
        w: Option<&Expr>,
        pr: Option<&Expr>,
        e: &Expr,
        out: &mut String,
    ) -> Option<()> {
        let mut sp = *sp;
        if let Some(w) = w {
            let w = cut(eval(w, self.p)?.v, 32, true) as i64;
            sp.left |= w < 0;
            sp.width = Some(
                u16::try_from(w.unsigned_abs())
                    .ok()
                    .filter(|&w| w <= 1024)?,
            );
        }
        if let Some(pr) = pr {
            let pr = cut(eval(pr, self.p)?.v, 32, true) as i64;
            sp.prec = if pr < 0 {
                None
            } else {
                Some(u16::try_from(pr).unwrap_or(u16::MAX))
            };
        }
        self.conv(&sp, e, out)
    }

    fn conv(&self, sp: &Spec, e: &Expr, out: &mut String) -> Option<()> {
        let start = out.len();
        match sp.conv {
            Conv::Str => {
                self.render(e, out)?;
                if let Some(p) = sp.prec {
                    if let Some((i, _)) = out[start..].char_indices().nth(usize::from(p)) {
                        out.truncate(start + i);
                    }
                }
            }
            Conv::Ptr => {
                let v = eval(e, self.p)?.v;
                if v == 0 {
                    out.push_str("(nil)");
                } else {
                    push_hex(out, v);
                }
            }
            Conv::Net(n) => push_net(out, n, bytes_of(e, self.p)?)?,
            Conv::Sym { offset } => {
                let v = eval(e, self.p)?.v;
                push_sym(out, self.syms, v, offset);
            }
            Conv::Char => {
                let v = eval(e, self.p)?.v;
                escape_guest_bytes(out, &[v as u8]);
            }
            _ => {
                let v = eval(e, self.p)?;
                self.int(sp, v.v, out);
                return Some(());
            }
        }
        pad_from(out, start, sp.width, sp.left);
        Some(())
    }

    fn int(&self, sp: &Spec, v: u64, out: &mut String) {
        let bits: u8 = if sp.longs >= 2 {
            64
        } else if sp.longs == 1 {
            self.long_size.saturating_mul(8).clamp(8, 64)
        } else if sp.half >= 2 {
            8
        } else if sp.half == 1 {
            16
        } else {
            32
        };
        let mut buf = [0u8; 24];
        let mut i = buf.len();
        let mut neg = false;
        let (mut u, base, upper) = match sp.conv {
            Conv::Signed => {
                let s = cut(v, bits, true) as i64;
                neg = s < 0;
                (s.unsigned_abs(), 10, false)
            }
            Conv::Unsigned => (cut(v, bits, false), 10, false),
            Conv::Hex => (cut(v, bits, false), 16, false),
            Conv::HexUpper => (cut(v, bits, false), 16, true),
            _ => (cut(v, bits, false), 8, false),
        };
        let nonzero = u != 0;
        let digits: &[u8; 16] = if upper {
            b"0123456789ABCDEF"
        } else {
            b"0123456789abcdef"
        };
        // C prints no digits for a zero value with precision 0.
        if !(u == 0 && sp.prec == Some(0)) {
            loop {
                i -= 1;
                buf[i] = digits[(u % base) as usize];
                u /= base;
                if u == 0 {
                    break;
                }
            }
        }
        let ndig = buf.len() - i;
        let prec_zeros = sp.prec.map_or(0, |p| usize::from(p).saturating_sub(ndig));
        let sign = if neg {
            "-"
        } else if sp.conv == Conv::Signed && sp.plus {
            "+"
        } else if sp.conv == Conv::Signed && sp.space {
            " "
        } else {
            ""
        };
        let prefix = match sp.conv {
            Conv::Hex if sp.alt && nonzero => "0x",
            Conv::HexUpper if sp.alt && nonzero => "0X",
            Conv::Octal if sp.alt && prec_zeros == 0 && buf.get(i) != Some(&b'0') => "0",
            _ => "",
        };
        let body = sign.len() + prefix.len() + prec_zeros + ndig;
        let width = usize::from(sp.width.unwrap_or(0));
        let fill = width.saturating_sub(body);
        let zero_fill = sp.zero && !sp.left && sp.prec.is_none();
        if !sp.left && !zero_fill {
            out.extend(std::iter::repeat_n(' ', fill));
        }
        out.push_str(sign);
        out.push_str(prefix);
        if zero_fill {
            out.extend(std::iter::repeat_n('0', fill));
        }
        out.extend(std::iter::repeat_n('0', prec_zeros));
        out.push_str(std::str::from_utf8(&buf[i..]).unwrap_or(""));
        if sp.left {
            out.extend(std::iter::repeat_n(' ', fill));
        }
    }
}

/// Appends a network address read from `b`: `%pI4` dotted quad, `%pI6` eight groups of
/// four hex digits, `%pI6c` compressed (the longest run of two or more zero groups as
/// `::`, an IPv4-mapped address ending in its dotted quad), `%pIS[p][c]` a `sockaddr_in`
/// (`a.b.c.d[:port]`) or `sockaddr_in6` (`[v6]:port` with `p`), `%pM` a MAC address.
fn push_net(out: &mut String, n: Net, b: &[u8]) -> Option<()> {
    use std::fmt::Write as _;
    let v4 = |out: &mut String, b: &[u8]| {
        let _ = write!(out, "{}.{}.{}.{}", b[0], b[1], b[2], b[3]);
    };
    let v6c = |out: &mut String, b: &[u8]| {
        let g: Vec<u16> = b[..16]
            .chunks_exact(2)
            .map(|c| u16::from_be_bytes([c[0], c[1]]))
            .collect();
        let mapped = g[..5].iter().all(|&x| x == 0) && g[5] == 0xffff;
        let groups = if mapped { 6 } else { 8 };
        // Longest run of zero groups (two or more), the first one on ties.
        let (mut best, mut best_len, mut i) = (groups, 0, 0);
        while i < groups {
            if g[i] == 0 {
                let st = i;
                while i < groups && g[i] == 0 {
                    i += 1;
                }
                if i - st > best_len && i - st > 1 {
                    (best, best_len) = (st, i - st);
                }
            } else {
                i += 1;
            }
        }
        let mut need_colon = false;
        let mut i = 0;
        while i < groups {
            if i == best {
                out.push_str("::");
                i += best_len;
                need_colon = false;
                continue;
            }
            if need_colon {
                out.push(':');
            }
            let _ = write!(out, "{:x}", g[i]);
            need_colon = true;
            i += 1;
        }
        if mapped {
            if need_colon {
                out.push(':');
            }
            v4(out, &b[12..16]);
        }
    };
    match n {
        Net::Ip4 => v4(out, b.get(..4)?),
        Net::Ip6 { compressed: true } => v6c(out, b.get(..16)?),
        Net::Ip6 { compressed: false } => {
            for (i, c) in b.get(..16)?.chunks_exact(2).enumerate() {
                if i > 0 {
                    out.push(':');
                }
                let _ = write!(out, "{:02x}{:02x}", c[0], c[1]);
            }
        }
        Net::Sockaddr { port } => {
            let family = u16::from_le_bytes([*b.first()?, *b.get(1)?]);
            let p = u16::from_be_bytes([*b.get(2)?, *b.get(3)?]);
            match family {
                2 => {
                    v4(out, b.get(4..8)?);
                    if port {
                        let _ = write!(out, ":{p}");
                    }
                }
                10 => {
                    if port {
                        out.push('[');
                    }
                    v6c(out, b.get(8..24)?);
                    if port {
                        let _ = write!(out, "]:{p}");
                    }
                }
                _ => return None,
            }
        }
        Net::Mac => {
            for (i, x) in b.get(..6)?.iter().enumerate() {
                if i > 0 {
                    out.push(':');
                }
                push_byte_hex(out, *x);
            }
        }
    }
    Some(())
}

/// A flexible `char buf[]` string (ftrace:print): one trailing newline is dropped (a
/// `trace_marker` write ends in one; trace-cmd prints the event on one line), the rest
/// escaped. Other strings keep every byte (escaped).
fn push_flexible_str(out: &mut String, b: &[u8]) {
    escape_guest_bytes(out, b.strip_suffix(b"\n").unwrap_or(b));
}

fn push_byte_hex(out: &mut String, x: u8) {
    const D: &[u8; 16] = b"0123456789abcdef";
    out.push(D[usize::from(x >> 4)] as char);
    out.push(D[usize::from(x & 15)] as char);
}

impl Program {
    /// Compiles `print_fmt` (the text after `print fmt: `) against the fields of `fmt`.
    /// `long_size` is the traced kernel's `sizeof(long)` (4 or 8).
    pub fn compile(fmt: &EventFormat, print_fmt: &str, long_size: u8) -> Result<Self, Unsupported> {
        parse::compile(fmt, print_fmt, long_size)
    }

    /// Appends the fields of `payload` as the print fmt says. On failure (a field past
    /// the payload, a division by zero...) `out` is left as it was and `None` returned.
    pub fn run(&self, out: &mut String, payload: &[u8], syms: &KernelSymbols) -> Option<()> {
        let start = out.len();
        let ctx = Ctx {
            p: payload,
            syms,
            long_size: self.long_size,
        };
        for op in &self.ops {
            let r = match op {
                Op::Lit(s) => {
                    push_lit(out, s);
                    Some(())
                }
                Op::Conv(sp, e) => ctx.conv(sp, e, out),
                Op::StarConv(sp, w, pr, e) => ctx.star_conv(sp, w.as_ref(), pr.as_ref(), e, out),
            };
            if r.is_none() {
                out.truncate(start);
                return None;
            }
        }
        Some(())
    }
}

/// Appends text from the trace file (format text, table names, symbol names): control
/// characters (a `\n` in a format) are escaped like guest bytes so that one event stays
/// one line and cannot drive a terminal.
pub fn push_lit(out: &mut String, s: &str) {
    if s.bytes().any(|b| !(0x20..0x7f).contains(&b)) {
        escape_guest_bytes(out, s.as_bytes());
    } else {
        out.push_str(s);
    }
}

#[cfg(test)]
mod tests;
