//! Parser of a `print fmt:` line into a [`Program`]: the C string literal, split into
//! literal text and conversions, and the C expressions of the arguments.

use super::expr::{
    eval_const, Cast, Conv, Expr, FieldRef, Net, Op, Program, Spec, Table, Unsupported,
};
use crate::format::EventFormat;

/// The value of a table entry naming an unknown constant (libtraceevent: -1).
const UNKNOWN: u64 = u64::MAX;

/// Deepest expression nesting accepted (kernel formats nest ~15 deep).
const MAX_DEPTH: u32 = 200;

#[derive(Clone, Debug, PartialEq)]
pub(super) enum Tok {
    /// Number, and whether it is unsigned (`U` suffix or too big for a signed long).
    Num(u64, bool),
    Str(String),
    Ident(String),
    P(&'static str),
}

const PUNCTS: &[&str] = &[
    "->", "<<", ">>", "<=", ">=", "==", "!=", "&&", "||", "+", "-", "*", "/", "%", "&", "|", "^",
    "!", "~", "?", ":", "(", ")", "{", "}", "[", "]", ",", ";", ".", "<", ">", "=",
];

fn unsupported(what: impl Into<String>) -> Unsupported {
    Unsupported(what.into())
}

pub(super) fn lex(s: &str) -> Result<Vec<Tok>, Unsupported> {
    let b = s.as_bytes();
    let mut i = 0;
    let mut out = Vec::new();
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_whitespace() {
            i += 1;
        } else if c == b'"' {
            let (text, n) = c_string(&s[i..])?;
            i += n;
            // Adjacent literals concatenate.
            if let Some(Tok::Str(prev)) = out.last_mut() {
                prev.push_str(&text);
            } else {
                out.push(Tok::Str(text));
            }
        } else if c == b'\'' {
            let rest = &b[i + 1..];
            let (v, n) = match rest {
                [b'\\', e, b'\'', ..] => (
                    match e {
                        b'n' => b'\n',
                        b't' => b'\t',
                        b'0' => 0,
                        x => *x,
                    },
                    4,
                ),
                [x, b'\'', ..] => (*x, 3),
                _ => return Err(unsupported("char literal")),
            };
            out.push(Tok::Num(u64::from(v), false));
            i += n;
        } else if c.is_ascii_digit() {
            let st = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric()) {
                i += 1;
            }
            let lit = &s[st..i];
            let digits = lit.trim_end_matches(['u', 'U', 'l', 'L']);
            let uns = lit[digits.len()..].contains(['u', 'U']);
            let v = if let Some(h) = digits
                .strip_prefix("0x")
                .or_else(|| digits.strip_prefix("0X"))
            {
                u64::from_str_radix(h, 16)
            } else if digits.len() > 1 && digits.starts_with('0') {
                u64::from_str_radix(&digits[1..], 8)
            } else {
                digits.parse()
            }
            .map_err(|_| unsupported(format!("number {lit}")))?;
            out.push(Tok::Num(v, uns || v > i64::MAX as u64));
        } else if c.is_ascii_alphabetic() || c == b'_' {
            let st = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            out.push(Tok::Ident(s[st..i].to_string()));
        } else {
            let p = PUNCTS
                .iter()
                .find(|p| s[i..].starts_with(**p))
                .ok_or_else(|| unsupported(format!("character {:?}", c as char)))?;
            out.push(Tok::P(p));
            i += p.len();
        }
    }
    Ok(out)
}

/// Parses a C string literal at the start of `s`; returns the text and the bytes used.
fn c_string(s: &str) -> Result<(String, usize), Unsupported> {
    let mut out = String::new();
    let mut it = s.char_indices().skip(1);
    while let Some((i, c)) = it.next() {
        match c {
            '"' => return Ok((out, i + 1)),
            '\\' => {
                let (_, e) = it.next().ok_or_else(|| unsupported("string escape"))?;
                out.push(match e {
                    'n' => '\n',
                    't' => '\t',
                    'r' => '\r',
                    '\\' => '\\',
                    '"' => '"',
                    '\'' => '\'',
                    '0' => '\0',
                    e => return Err(unsupported(format!("escape \\{e}"))),
                });
            }
            c => out.push(c),
        }
    }
    Err(unsupported("unterminated string"))
}

/// Names the kernel's print fmts use for constants that are not numbers in the text
/// and whose values are fixed ABI (softirq vectors, hrtimer restart codes).
fn known_constant(name: &str) -> Option<u64> {
    Some(match name {
        "HI_SOFTIRQ" | "HRTIMER_NORESTART" => 0,
        "TIMER_SOFTIRQ" | "HRTIMER_RESTART" => 1,
        "NET_TX_SOFTIRQ" => 2,
        "NET_RX_SOFTIRQ" => 3,
        "BLOCK_SOFTIRQ" => 4,
        "IRQ_POLL_SOFTIRQ" | "BLOCK_IOPOLL_SOFTIRQ" => 5,
        "TASKLET_SOFTIRQ" => 6,
        "SCHED_SOFTIRQ" => 7,
        "HRTIMER_SOFTIRQ" => 8,
        "RCU_SOFTIRQ" => 9,
        _ => return None,
    })
}

/// The cast a type name denotes (`None` if the words are not a type).
fn type_cast(words: &[String], stars: usize, long_size: u8) -> Option<Cast> {
    if words.is_empty() {
        return None;
    }
    let long_bits = if long_size == 4 { 32 } else { 64 };
    if stars > 0 {
        return Some(Cast::Int {
            bits: long_bits,
            signed: false,
        });
    }
    let ws: Vec<&str> = words
        .iter()
        .map(String::as_str)
        .filter(|w| !matches!(*w, "const" | "volatile"))
        .collect();
    let int = |bits, signed| Some(Cast::Int { bits, signed });
    if let [one] = ws.as_slice() {
        let c = match *one {
            "u8" | "__u8" | "uint8_t" => int(8, false),
            "s8" | "__s8" | "int8_t" => int(8, true),
            "u16" | "__u16" | "uint16_t" => int(16, false),
            "s16" | "__s16" | "int16_t" => int(16, true),
            "u32" | "__u32" | "uint32_t" | "gfp_t" | "unsigned" | "uint" => int(32, false),
            "ulong" => int(long_bits, false),
            "s32" | "__s32" | "int32_t" | "pid_t" | "int" => int(32, true),
            "u64" | "__u64" | "uint64_t" | "size_t" => int(64, false),
            "s64" | "__s64" | "int64_t" | "ssize_t" | "loff_t" => int(64, true),
            "long" => int(long_bits, true),
            "short" => int(16, true),
            "char" => int(8, true),
            "bool" | "_Bool" => Some(Cast::Bool),
            "void" => Some(Cast::NoOp),
            w if w.ends_with("_t") => Some(Cast::NoOp),
            _ => None,
        };
        return c;
    }
    if matches!(ws.first(), Some(&("struct" | "union" | "enum"))) {
        return Some(Cast::NoOp);
    }
    let mut signed = true;
    let mut longs = 0;
    let mut bits = 32;
    for w in &ws {
        match *w {
            "unsigned" => signed = false,
            "signed" | "int" => {}
            "long" => longs += 1,
            "short" => bits = 16,
            "char" => bits = 8,
            _ => return None,
        }
    }
    if longs == 1 {
        bits = long_bits;
    } else if longs >= 2 {
        bits = 64;
    }
    int(bits, signed)
}

/// libtraceevent's operator priorities (lower binds tighter); 0: not a binary operator.
fn prio(op: &str) -> u8 {
    match op {
        "*" | "/" | "%" => 6,
        "+" | "-" => 7,
        "<<" | ">>" => 8,
        "<" | ">" | "<=" | ">=" => 9,
        "==" | "!=" => 10,
        "&" => 11,
        "^" => 12,
        "|" => 13,
        "&&" => 14,
        "||" => 15,
        "?" => 16,
        _ => 0,
    }
}

struct Parser<'a> {
    toks: &'a [Tok],
    pos: usize,
    fmt: &'a EventFormat,
    long_size: u8,
    depth: u32,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<&'a Tok> {
        self.toks.get(self.pos)
    }

    fn peek_at(&self, n: usize) -> Option<&'a Tok> {
        self.toks.get(self.pos + n)
    }

    fn next(&mut self) -> Option<&'a Tok> {
        let t = self.toks.get(self.pos);
        self.pos += 1;
        t
    }

    fn is_p(&self, p: &str) -> bool {
        matches!(self.peek(), Some(Tok::P(x)) if *x == p)
    }

    fn expect(&mut self, p: &str) -> Result<(), Unsupported> {
        if self.is_p(p) {
            self.pos += 1;
            Ok(())
        } else {
            Err(unsupported(format!(
                "expected `{p}`, got {:?}",
                self.peek()
            )))
        }
    }

    fn field(&self, name: &str) -> Result<FieldRef, Unsupported> {
        let f = self
            .fmt
            .field(name)
            .ok_or_else(|| unsupported(format!("no field {name}")))?;
        Ok(FieldRef::new(f))
    }

    /// If a parenthesised type starts here (`(unsigned long)`, `( gfp_t)`, `(void *)`),
    /// consumes it and returns its cast.
    fn try_cast(&mut self) -> Option<Cast> {
        if !self.is_p("(") {
            return None;
        }
        let mut words = Vec::new();
        let mut stars = 0;
        let mut n = 1;
        loop {
            match self.peek_at(n)? {
                Tok::Ident(w) if stars == 0 => words.push(w.clone()),
                Tok::P("*") => stars += 1,
                Tok::P(")") => break,
                _ => return None,
            }
            n += 1;
        }
        if words.first().is_some_and(|w| w == "REC") {
            return None;
        }
        let c = type_cast(&words, stars, self.long_size)?;
        self.pos += n + 1;
        Some(c)
    }

    /// A whole expression: an operand and the operators after it.
    fn expr(&mut self) -> Result<Expr, Unsupported> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(unsupported("expression too deep"));
        }
        let r = self.unary().and_then(|first| self.tail(first));
        self.depth -= 1;
        r
    }

    /// The binary operator (or `?`) at the cursor.
    fn binop(&self) -> Option<&'static str> {
        match self.peek() {
            Some(Tok::P(p)) if prio(p) > 0 => Some(p),
            _ => None,
        }
    }

    /// Applies the operators that follow the complete operand `arg`.
    fn tail(&mut self, arg: Expr) -> Result<Expr, Unsupported> {
        match self.binop() {
            Some(op) => self.op(arg, op),
            None => Ok(arg),
        }
    }

    /// libtraceevent's way with binary operators, which trace-cmd's output follows
    /// (it is not C's): the right operand is one operand (a unary operator's operand
    /// takes the operators after it along); if the right operand is itself an operation
    /// (from parentheses) of a looser operator, the tree is rotated so that `op` takes
    /// only that operation's left operand (`x & (a | b)` is `(x & a) | b`); a following
    /// operator binds the whole so far if it is looser than the root, else it continues
    /// in the right slot (so equal operators group to the right).
    fn op(&mut self, arg: Expr, op: &'static str) -> Result<Expr, Unsupported> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(unsupported("expression too deep"));
        }
        self.pos += 1;
        let r = self.op_inner(arg, op);
        self.depth -= 1;
        r
    }

    fn op_inner(&mut self, arg: Expr, op: &'static str) -> Result<Expr, Unsupported> {
        if op == "?" {
            let a = self.expr()?;
            self.expect(":")?;
            let b = self.expr()?;
            return Ok(Expr::Cond(Box::new(arg), Box::new(a), Box::new(b)));
        }
        let unary = matches!(self.peek(), Some(Tok::P("-" | "!" | "~" | "+")));
        let mut right = self.unary()?;
        if unary {
            right = self.tail(right)?;
        }
        // Rotation when the right operand is a looser operation.
        enum Slot {
            Right,
            Rotated,
        }
        let (node, slot) = match right {
            Expr::Bin(rop, rl, rr) if prio(op) < prio(rop) => (
                Expr::Bin(rop, Box::new(Expr::Bin(op, Box::new(arg), rl)), rr),
                Slot::Rotated,
            ),
            Expr::Cond(c, a, b) if prio(op) < prio("?") => (
                Expr::Cond(Box::new(Expr::Bin(op, Box::new(arg), c)), a, b),
                Slot::Rotated,
            ),
            r => (Expr::Bin(op, Box::new(arg), Box::new(r)), Slot::Right),
        };
        let Some(next) = self.binop() else {
            return Ok(node);
        };
        let node_prio = match &node {
            Expr::Bin(o, ..) => prio(o),
            _ => 0,
        };
        if prio(next) > node_prio {
            return self.op(node, next);
        }
        Ok(match (node, slot) {
            (Expr::Bin(o, l, r), Slot::Right) => Expr::Bin(o, l, Box::new(self.op(*r, next)?)),
            (Expr::Bin(o, l, r), Slot::Rotated) => Expr::Bin(o, Box::new(self.op(*l, next)?), r),
            (n, _) => n,
        })
    }

    fn unary(&mut self) -> Result<Expr, Unsupported> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(unsupported("expression too deep"));
        }
        let r = self.unary_inner();
        self.depth -= 1;
        r
    }

    fn unary_inner(&mut self) -> Result<Expr, Unsupported> {
        if let Some(Tok::P(p @ ("-" | "!" | "~" | "+"))) = self.peek() {
            self.pos += 1;
            let e = self.unary()?;
            return Ok(if *p == "+" {
                e
            } else {
                Expr::Unary(p, Box::new(e))
            });
        }
        if let Some(c) = self.try_cast() {
            let e = self.unary()?;
            return Ok(Expr::Cast(c, Box::new(e)));
        }
        self.primary()
    }

    fn primary(&mut self) -> Result<Expr, Unsupported> {
        match self.next() {
            Some(Tok::Num(v, uns)) => Ok(Expr::Num(*v, !uns)),
            Some(Tok::Str(s)) => Ok(Expr::Str(s.as_str().into())),
            Some(Tok::P("(")) => {
                if self.is_p("{") {
                    return Err(unsupported("statement expression"));
                }
                let e = self.expr()?;
                self.expect(")")?;
                Ok(e)
            }
            Some(Tok::Ident(id)) => self.ident(id),
            t => Err(unsupported(format!("unexpected {t:?}"))),
        }
    }

    fn ident(&mut self, id: &str) -> Result<Expr, Unsupported> {
        if id == "REC" {
            self.expect("->")?;
            let Some(Tok::Ident(name)) = self.next() else {
                return Err(unsupported("REC-> without a field"));
            };
            let f = self
                .fmt
                .field(name)
                .ok_or_else(|| unsupported(format!("no field {name}")))?;
            if self.is_p("[") {
                // `REC->args[N]`: one element of an array field.
                self.pos += 1;
                let i = eval_const(&self.expr()?)?;
                self.expect("]")?;
                return Ok(Expr::Field(
                    FieldRef::element(f, i).ok_or_else(|| unsupported(format!("{name}[{i}]")))?,
                ));
            }
            return Ok(Expr::Field(FieldRef::new(f)));
        }
        if !self.is_p("(") {
            return Ok(match id {
                "true" => Expr::Num(1, true),
                "false" | "NULL" => Expr::Num(0, true),
                _ => match known_constant(id) {
                    Some(v) => Expr::Num(v, true),
                    None => Expr::Unknown,
                },
            });
        }
        self.pos += 1;
        let e = match id {
            "__get_str" | "__get_rel_str" => Expr::StrField(self.field_arg()?),
            "__get_dynamic_array"
            | "__get_rel_dynamic_array"
            | "__get_sockaddr"
            | "__get_rel_sockaddr" => Expr::DynArray(self.field_arg()?),
            "__get_dynamic_array_len" | "__get_rel_dynamic_array_len" => {
                Expr::DynArrayLen(self.field_arg()?)
            }
            "__get_bitmask" | "__get_rel_bitmask" => Expr::Bitmask(self.field_arg()?),
            // A hint to the compiler: its value is its first argument.
            "__builtin_expect" => {
                let v = self.expr()?;
                self.expect(",")?;
                self.expr()?;
                v
            }
            "__print_symbolic" | "__print_symbolic_u64" => {
                let v = self.expr()?;
                let table = self.table()?;
                Expr::Symbolic(Box::new(v), table)
            }
            "__print_flags" | "__print_flags_u64" => {
                let v = self.expr()?;
                self.expect(",")?;
                let delim = match self.next() {
                    Some(Tok::Str(s)) => s.as_str().into(),
                    _ => return Err(unsupported("__print_flags delimiter")),
                };
                let table = self.table()?;
                Expr::Flags(Box::new(v), delim, table)
            }
            "__print_hex" | "__print_hex_str" => {
                let p = self.expr()?;
                self.expect(",")?;
                let n = self.expr()?;
                Expr::Hex(Box::new(p), Box::new(n), id == "__print_hex")
            }
            "__print_array" => {
                let p = self.expr()?;
                self.expect(",")?;
                let n = self.expr()?;
                self.expect(",")?;
                let el = self.expr()?;
                Expr::Array(Box::new(p), Box::new(n), Box::new(el))
            }
            "sizeof" => {
                let mut words = Vec::new();
                let mut stars = 0;
                while let Some(t) = self.peek() {
                    match t {
                        Tok::Ident(w) => words.push(w.clone()),
                        Tok::P("*") => stars += 1,
                        _ => break,
                    }
                    self.pos += 1;
                }
                let size = match type_cast(&words, stars, self.long_size) {
                    Some(Cast::Int { bits, .. }) => u64::from(bits / 8),
                    Some(Cast::Bool) => 1,
                    _ => return Err(unsupported("sizeof")),
                };
                Expr::Num(size, false)
            }
            other => return Err(unsupported(format!("function {other}"))),
        };
        self.expect(")")?;
        Ok(e)
    }

    fn field_arg(&mut self) -> Result<FieldRef, Unsupported> {
        match self.next() {
            Some(Tok::Ident(n)) => self.field(n),
            _ => Err(unsupported("field name")),
        }
    }

    /// `, { value, "name" }, ...` up to the closing parenthesis (not consumed). Values
    /// are constant expressions; an entry whose value names an unknown constant is kept
    /// with a value that matches nothing.
    fn table(&mut self) -> Result<Table, Unsupported> {
        let mut out = Vec::new();
        while self.is_p(",") {
            self.pos += 1;
            self.expect("{")?;
            let v = self.expr()?;
            self.expect(",")?;
            // A `{ 0, NULL }` terminator (the name not a string) names nothing.
            let name = match self.peek() {
                Some(Tok::Str(s)) => {
                    self.pos += 1;
                    Some(s.as_str().into())
                }
                _ => {
                    self.expr()?;
                    None
                }
            };
            self.expect("}")?;
            let v = match v {
                Expr::Unknown => UNKNOWN,
                v => eval_const(&v)?,
            };
            if let Some(name) = name {
                out.push((v, name));
            }
        }
        Ok(out)
    }
}

/// Splits the format string into literal text and conversions.
fn parse_format(fmt: &str) -> Result<Vec<(String, Option<Spec>)>, Unsupported> {
    let b = fmt.as_bytes();
    let mut out = Vec::new();
    let mut lit = String::new();
    let mut i = 0;
    // Bounded: every iteration consumes at least one byte.
    while i < b.len() {
        if b[i] != b'%' {
            let n = fmt[i..].chars().next().map_or(1, char::len_utf8);
            lit.push_str(&fmt[i..i + n]);
            i += n;
            continue;
        }
        i += 1;
        if b.get(i) == Some(&b'%') {
            lit.push('%');
            i += 1;
            continue;
        }
        let sp = spec(fmt, &mut i)?;
        out.push((std::mem::take(&mut lit), Some(sp)));
    }
    if !lit.is_empty() {
        out.push((lit, None));
    }
    Ok(out)
}

/// The conversion whose text starts at `*i` (after its `%`): flags, width, precision,
/// length modifiers and the conversion character; `*i` moves past it.
fn spec(fmt: &str, i: &mut usize) -> Result<Spec, Unsupported> {
    let b = fmt.as_bytes();
    let mut sp = Spec::default();
    while let Some(&c) = b.get(*i) {
        match c {
            b'-' => sp.left = true,
            b'0' => sp.zero = true,
            b'+' => sp.plus = true,
            b' ' => sp.space = true,
            b'#' => sp.alt = true,
            _ => break,
        }
        *i += 1;
    }
    sp.width = number(fmt, i)?;
    if sp.width.is_none() && b.get(*i) == Some(&b'*') {
        sp.star_width = true;
        *i += 1;
    }
    if b.get(*i) == Some(&b'.') {
        *i += 1;
        if b.get(*i) == Some(&b'*') {
            sp.star_prec = true;
            *i += 1;
        } else {
            sp.prec = Some(number(fmt, i)?.unwrap_or(0));
        }
    }
    loop {
        match b.get(*i) {
            Some(b'l' | b'L' | b'q' | b'j') => sp.longs = sp.longs.saturating_add(1),
            Some(b'z' | b't' | b'Z') => sp.longs = sp.longs.max(1),
            Some(b'h') => sp.half = sp.half.saturating_add(1),
            _ => break,
        }
        *i += 1;
    }
    let conv = *b.get(*i).ok_or_else(|| unsupported("format ends in `%`"))?;
    *i += 1;
    sp.conv = match conv {
        b'd' | b'i' => Conv::Signed,
        b'u' => Conv::Unsigned,
        b'x' => Conv::Hex,
        b'X' => Conv::HexUpper,
        b'o' => Conv::Octal,
        b'c' => Conv::Char,
        b's' => Conv::Str,
        b'p' => pointer(b, i)?,
        c => return Err(unsupported(format!("conversion %{}", c as char))),
    };
    Ok(sp)
}

/// A width or precision at `*i` (digits, at most 1024), `None` when there are no digits.
fn number(fmt: &str, i: &mut usize) -> Result<Option<u16>, Unsupported> {
    let b = fmt.as_bytes();
    let st = *i;
    while b.get(*i).is_some_and(u8::is_ascii_digit) {
        *i += 1;
    }
    if *i == st {
        Ok(None)
    } else {
        fmt[st..*i]
            .parse()
            .ok()
            .filter(|&n: &u16| n <= 1024)
            .map(Some)
            .ok_or_else(|| unsupported("width"))
    }
}

/// The `%p` extension at `b[*i..]` (symbols, `%px`/`%pK`, addresses, MACs; plain
/// `%p` when none follows); `*i` moves past it.
fn pointer(b: &[u8], i: &mut usize) -> Result<Conv, Unsupported> {
    Ok(match b.get(*i) {
        Some(b'S' | b'F' | b'B') => {
            *i += 1;
            Conv::Sym { offset: true }
        }
        Some(b's' | b'f') => {
            *i += 1;
            Conv::Sym { offset: false }
        }
        Some(b'x' | b'K') => {
            *i += 1;
            Conv::Ptr
        }
        Some(b'I') => {
            let ext = &b[*i + 1..];
            let (net, n) = match ext {
                [b'4', ..] => (Net::Ip4, 2),
                [b'6', b'c', ..] => (Net::Ip6 { compressed: true }, 3),
                [b'6', ..] => (Net::Ip6 { compressed: false }, 2),
                [b'S', b'p', b'c', ..] | [b'S', b'c', b'p', ..] => {
                    (Net::Sockaddr { port: true }, 4)
                }
                [b'S', b'p', ..] => (Net::Sockaddr { port: true }, 3),
                [b'S', b'c', ..] => (Net::Sockaddr { port: false }, 3),
                [b'S', ..] => (Net::Sockaddr { port: false }, 2),
                _ => return Err(unsupported("%pI")),
            };
            *i += n;
            Conv::Net(net)
        }
        Some(b'M') => {
            *i += 1;
            Conv::Net(Net::Mac)
        }
        Some(c) if c.is_ascii_alphanumeric() => {
            return Err(unsupported(format!("%p{}", *c as char)))
        }
        _ => Conv::Ptr,
    })
}

/// Compiles the text after `print fmt: ` for `fmt`.
pub(super) fn compile(
    fmt: &EventFormat,
    print_fmt: &str,
    long_size: u8,
) -> Result<Program, Unsupported> {
    let toks = lex(print_fmt)?;
    let Some(Tok::Str(f)) = toks.first() else {
        return Err(unsupported("print fmt does not start with a string"));
    };
    let mut p = Parser {
        toks: &toks,
        pos: 1,
        fmt,
        long_size,
        depth: 0,
    };
    let mut args = Vec::new();
    while p.pos < toks.len() {
        p.expect(",")?;
        args.push(p.expr()?);
    }
    let mut args = args.into_iter();
    let mut ops = Vec::new();
    for (lit, spec) in parse_format(f)? {
        if !lit.is_empty() {
            ops.push(Op::Lit(lit.into()));
        }
        if let Some(spec) = spec {
            let mut next = || {
                args.next()
                    .ok_or_else(|| unsupported("fewer arguments than conversions"))
            };
            let w = if spec.star_width { Some(next()?) } else { None };
            let pr = if spec.star_prec { Some(next()?) } else { None };
            let arg = next()?;
            ops.push(if w.is_some() || pr.is_some() {
                Op::StarConv(spec, w, pr, arg)
            } else {
                Op::Conv(spec, arg)
            });
        }
    }
    if args.next().is_some() {
        return Err(unsupported("more arguments than conversions"));
    }
    Ok(Program { ops, long_size })
}
