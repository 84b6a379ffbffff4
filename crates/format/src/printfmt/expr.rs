//! The compiled form of a print fmt — ops, conversions, argument expressions over
//! fields resolved to offsets — and the evaluation of those expressions (the parser
//! builds it, the guest subset check walks it, `Program::run` renders it).

use crate::format::Field;

/// Why a print fmt cannot be compiled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unsupported(pub String);

impl std::fmt::Display for Unsupported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Unsupported {}

/// How a field is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    Int,
    /// Fixed array; `true` when it is a char string.
    Array(bool),
    /// `__data_loc`; `true` when it is a char string.
    DataLoc(bool),
    /// `__rel_loc`; `true` when it is a char string.
    RelLoc(bool),
}

/// A field resolved at compile time: where its bytes lie in a payload and how to read
/// them (the trace-cmd plugins of `hyptrace-output` read fields with it too).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FieldRef {
    pub(super) offset: usize,
    pub(super) size: usize,
    pub(super) signed: bool,
    pub(super) kind: Kind,
}

impl FieldRef {
    /// The field `f` of a format, resolved.
    pub fn new(f: &Field) -> Self {
        let s = f.is_string();
        let kind = if f.is_data_loc() {
            Kind::DataLoc(s)
        } else if f.is_rel_loc() {
            Kind::RelLoc(s)
        } else if f.is_array() {
            Kind::Array(s)
        } else {
            Kind::Int
        };
        Self {
            offset: f.offset,
            size: f.size,
            signed: f.signed,
            kind,
        }
    }

    /// Element `i` of array field `f` (`unsigned long args[6]`), as an integer field.
    pub fn element(f: &Field, i: u64) -> Option<Self> {
        if !f.is_array() {
            return None;
        }
        let t = &f.type_name;
        let n: usize = t[t.rfind('[')? + 1..t.len() - 1].trim().parse().ok()?;
        let el = f.size.checked_div(n)?;
        let i = usize::try_from(i).ok().filter(|&i| i < n)?;
        Some(Self {
            offset: f.offset.checked_add(i.checked_mul(el)?)?,
            size: el,
            signed: f.signed,
            kind: Kind::Int,
        })
    }

    /// The integer value (sign-extended when signed); `None` for arrays, odd sizes or
    /// past the payload.
    pub fn int(&self, p: &[u8]) -> Option<u64> {
        if self.kind != Kind::Int {
            return None;
        }
        let b = p.get(self.offset..self.offset.checked_add(self.size)?)?;
        let mut w = [0u8; 8];
        match self.size {
            1 | 2 | 4 | 8 => w[..self.size].copy_from_slice(b),
            _ => return None,
        }
        let v = u64::from_le_bytes(w);
        Some(if self.signed && self.size < 8 {
            let sh = 64 - 8 * self.size as u32;
            (((v << sh) as i64) >> sh) as u64
        } else {
            v
        })
    }

    /// Whether the field holds a char string (char array, `__data_loc char[]`).
    pub fn is_string(&self) -> bool {
        matches!(
            self.kind,
            Kind::Array(true) | Kind::DataLoc(true) | Kind::RelLoc(true)
        )
    }

    /// The offset of a `__data_loc` field's word, if it is one.
    pub fn data_loc_word(&self) -> Option<usize> {
        matches!(self.kind, Kind::DataLoc(_)).then_some(self.offset)
    }

    /// Where the bytes of an array or dynamic field lie in payload `p` (whole, not cut
    /// at a NUL); `None` for integers or when they lie outside `p`.
    pub fn range(&self, p: &[u8]) -> Option<std::ops::Range<usize>> {
        let r = match self.kind {
            Kind::Int => return None,
            // A flexible array (`char buf[]`, size 0) runs to the end of the payload.
            Kind::Array(_) if self.size == 0 => self.offset..p.len(),
            Kind::Array(_) => self.offset..self.offset.checked_add(self.size)?,
            Kind::DataLoc(_) | Kind::RelLoc(_) => {
                let w = p.get(self.offset..self.offset.checked_add(4)?)?;
                let w = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
                let mut off = (w & 0xffff) as usize;
                if matches!(self.kind, Kind::RelLoc(_)) {
                    off = off.checked_add(self.offset)?.checked_add(self.size)?;
                }
                off..off.checked_add((w >> 16) as usize)?
            }
        };
        p.get(r.clone()).map(|_| r)
    }

    /// The bytes of an array or dynamic field (strings cut at the first NUL).
    pub fn bytes<'p>(&self, p: &'p [u8]) -> Option<&'p [u8]> {
        let b = p.get(self.range(p)?)?;
        Some(if self.is_string() {
            b.split(|&c| c == 0).next().unwrap_or(b)
        } else {
            b
        })
    }
}

/// A cast's effect on a value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Cast {
    Int { bits: u8, signed: bool },
    Bool,
    NoOp,
}

/// A `__print_symbolic`/`__print_flags` table: (value, name); an entry naming an unknown
/// constant has the value -1 (`u64::MAX`).
pub(super) type Table = Vec<(u64, Box<str>)>;

/// Network address conversions (`%pI4`, `%pI6`, `%pI6c`, `%pISpc`, `%pM`) of byte arrays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Net {
    Ip4,
    Ip6 { compressed: bool },
    Sockaddr { port: bool },
    Mac,
}

/// An argument expression.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Expr {
    /// Integer literal and whether it is signed.
    Num(u64, bool),
    Str(Box<str>),
    Field(FieldRef),
    /// An identifier the format does not define.
    Unknown,
    Unary(&'static str, Box<Expr>),
    Bin(&'static str, Box<Expr>, Box<Expr>),
    Cond(Box<Expr>, Box<Expr>, Box<Expr>),
    Cast(Cast, Box<Expr>),
    Symbolic(Box<Expr>, Table),
    Flags(Box<Expr>, Box<str>, Table),
    /// Bytes, count, spaced (`__print_hex`) or not (`__print_hex_str`).
    Hex(Box<Expr>, Box<Expr>, bool),
    /// Array, count, element size.
    Array(Box<Expr>, Box<Expr>, Box<Expr>),
    StrField(FieldRef),
    DynArray(FieldRef),
    DynArrayLen(FieldRef),
    Bitmask(FieldRef),
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum Conv {
    #[default]
    Signed,
    Unsigned,
    Hex,
    HexUpper,
    Octal,
    Char,
    Str,
    Ptr,
    Sym {
        offset: bool,
    },
    Net(Net),
}

/// One printf conversion.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Spec {
    pub(super) left: bool,
    pub(super) zero: bool,
    pub(super) plus: bool,
    pub(super) space: bool,
    pub(super) alt: bool,
    pub(super) width: Option<u16>,
    pub(super) prec: Option<u16>,
    pub(super) longs: u8,
    pub(super) half: u8,
    pub(super) conv: Conv,
    /// `*` width, `*` precision.
    pub(super) star_width: bool,
    pub(super) star_prec: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Op {
    Lit(Box<str>),
    Conv(Spec, Expr),
    /// A conversion with `*` width and/or precision taken from arguments.
    StarConv(Spec, Option<Expr>, Option<Expr>, Expr),
}

/// A compiled print fmt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Program {
    pub(super) ops: Vec<Op>,
    pub(super) long_size: u8,
}

/// A value and whether C would treat it as signed.
#[derive(Clone, Copy, Debug)]
pub(super) struct Val {
    pub(super) v: u64,
    pub(super) signed: bool,
}

pub(super) fn cut(v: u64, bits: u8, signed: bool) -> u64 {
    if bits >= 64 {
        return v;
    }
    let sh = 64 - u32::from(bits);
    if signed {
        (((v << sh) as i64) >> sh) as u64
    } else {
        (v << sh) >> sh
    }
}

/// Evaluates a constant expression (table values); unknown identifiers are 0.
pub(super) fn eval_const(e: &Expr) -> Result<u64, Unsupported> {
    eval(e, &[])
        .map(|v| v.v)
        .ok_or_else(|| Unsupported("table value is not a constant".into()))
}

pub(super) fn eval(e: &Expr, p: &[u8]) -> Option<Val> {
    Some(match e {
        Expr::Num(v, s) => Val { v: *v, signed: *s },
        Expr::Unknown => Val { v: 0, signed: true },
        Expr::Field(f) => Val {
            v: f.int(p)?,
            signed: f.signed,
        },
        Expr::DynArrayLen(f) => Val {
            v: f.bytes(p)?.len() as u64,
            signed: false,
        },
        Expr::Unary(op, a) => unary(op, eval(a, p)?),
        Expr::Bin(op, a, b) => {
            let a = eval(a, p)?;
            // `&&` and `||` do not evaluate their right side when the left decides.
            if *op == "&&" && a.v == 0 || *op == "||" && a.v != 0 {
                return Some(Val {
                    v: u64::from(*op == "||"),
                    signed: true,
                });
            }
            binary(op, a, eval(b, p)?)?
        }
        Expr::Cond(c, a, b) => {
            if eval(c, p)?.v != 0 {
                eval(a, p)?
            } else {
                eval(b, p)?
            }
        }
        Expr::Cast(c, a) => {
            let a = eval(a, p)?;
            match *c {
                Cast::Int { bits, signed } => Val {
                    v: cut(a.v, bits, signed),
                    signed,
                },
                Cast::Bool => Val {
                    v: u64::from(a.v != 0),
                    signed: false,
                },
                Cast::NoOp => a,
            }
        }
        _ => return None,
    })
}

/// `op a` for `-`, `!` and `~`.
fn unary(op: &str, a: Val) -> Val {
    match op {
        "-" => Val {
            v: a.v.wrapping_neg(),
            signed: a.signed,
        },
        "!" => Val {
            v: u64::from(a.v == 0),
            signed: true,
        },
        _ => Val {
            v: !a.v,
            signed: a.signed,
        },
    }
}

/// `a op b` as C computes it on 64-bit values (signed when both sides are); `None` for a
/// division by zero or an unknown operator.
fn binary(op: &str, a: Val, b: Val) -> Option<Val> {
    let signed = a.signed && b.signed;
    let (x, y) = (a.v, b.v);
    let cmp = |r: bool| Val {
        v: u64::from(r),
        signed: true,
    };
    let v = |v| Val { v, signed };
    Some(match op {
        "+" => v(x.wrapping_add(y)),
        "-" => v(x.wrapping_sub(y)),
        "*" => v(x.wrapping_mul(y)),
        "/" if y == 0 => return None,
        "%" if y == 0 => return None,
        "/" if signed => v((x as i64).wrapping_div(y as i64) as u64),
        "%" if signed => v((x as i64).wrapping_rem(y as i64) as u64),
        "/" => v(x / y),
        "%" => v(x % y),
        "<<" => Val {
            v: if y >= 64 { 0 } else { x << y },
            signed: a.signed,
        },
        ">>" => Val {
            v: if a.signed {
                ((x as i64) >> y.min(63)) as u64
            } else if y >= 64 {
                0
            } else {
                x >> y
            },
            signed: a.signed,
        },
        "&" => v(x & y),
        "|" => v(x | y),
        "^" => v(x ^ y),
        "==" => cmp(x == y),
        "!=" => cmp(x != y),
        "<" if signed => cmp((x as i64) < (y as i64)),
        ">" if signed => cmp((x as i64) > (y as i64)),
        "<=" if signed => cmp((x as i64) <= (y as i64)),
        ">=" if signed => cmp((x as i64) >= (y as i64)),
        "<" => cmp(x < y),
        ">" => cmp(x > y),
        "<=" => cmp(x <= y),
        ">=" => cmp(x >= y),
        "&&" | "||" => cmp(y != 0),
        _ => return None,
    })
}

/// The bytes an array expression points at.
pub(super) fn bytes_of<'p>(e: &Expr, p: &'p [u8]) -> Option<&'p [u8]> {
    match e {
        Expr::Field(f) | Expr::DynArray(f) | Expr::StrField(f) | Expr::Bitmask(f) => f.bytes(p),
        Expr::Cast(_, a) => bytes_of(a, p),
        _ => None,
    }
}
