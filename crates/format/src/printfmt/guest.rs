//! The print-fmt subset a guest may register (docs/abi.md "Print formats a guest may
//! register"; invariant G1 of docs/design.md): formats that trace-cmd 3.1.6 /
//! libtraceevent and KernelShark evaluate without a crash, a hang or a forged line,
//! whatever the guest writes into its records. The format is parsed by this module's
//! own parser ([`super::parse`]: the one hyptrace prints with), then the parse is
//! checked against the subset:
//!
//! - escapes in string literals only `\\` and `\"` (no `\n`, `\t`, `\r`, `\0`, `\e`,
//!   octal or hex: nothing that prints a control byte), no character literals;
//! - conversions `%d %i %u %x %X %o %s %p` with flags and `h hh l ll z` lengths, width
//!   and precision literal and at most [`MAX_GUEST_WIDTH`]; no `*`, no `%c` (it prints
//!   a record byte as is: a newline), no `%p` extension (`%pS`, `%pI4`, `%pM`... read
//!   past a field or look up kernel state);
//! - integer arguments: literals, `REC->field` of an integer field (or a constant
//!   element `REC->array[N]`), C operators, `?:`, casts and `sizeof` of the scalar
//!   types; `/` and `%` only by a literal in `1..=i64::MAX` (no division by zero, no
//!   `LLONG_MIN / -1`);
//! - `%s` arguments: string literals, `c ? s1 : s2` of them, a `char[N]` field, `__get_str(field)` of a
//!   `__data_loc char[]` field, `__print_symbolic`/`__print_flags` of an integer
//!   argument, `__print_hex`/`__print_hex_str(REC->array, N)` and
//!   `__print_array(REC->array, N, SIZE)` of a fixed array field, with `N` (and
//!   `SIZE` in 1, 2, 4, 8) literal and the bytes they read inside the field;
//! - identifiers: `REC`, the field names, those helpers, `sizeof` and the C type words
//!   of casts; nothing else (no `__get_dynamic_array`, `__get_bitmask`,
//!   `__builtin_expect`, enum constants, `NULL`).

use super::expr::{Conv, Expr, FieldRef, Kind, Op, Spec};
use super::parse::{compile, lex, Tok};
use crate::format::EventFormat;

/// Largest width or precision of a conversion in a guest's print fmt.
pub const MAX_GUEST_WIDTH: u16 = 64;

/// Helpers a guest's print fmt may call (each followed by `(`).
const HELPERS: &[&str] = &[
    "__get_str",
    "__print_symbolic",
    "__print_flags",
    "__print_hex",
    "__print_hex_str",
    "__print_array",
    "sizeof",
];

/// Type words a cast or `sizeof` may use.
const TYPE_WORDS: &[&str] = &[
    "u8", "u16", "u32", "u64", "s8", "s16", "s32", "s64", "__u8", "__u16", "__u32", "__u64",
    "__s8", "__s16", "__s32", "__s64", "char", "short", "int", "long", "unsigned", "signed",
    "bool", "void",
];

/// Why a guest's print fmt is not in the subset every reader evaluates safely.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GuestFormatError {
    /// The format does not parse (the parser's reason).
    #[error("print fmt does not parse: {0}")]
    Parse(String),
    /// An escape other than `\\` and `\"` in a string literal.
    #[error("print fmt has the escape \\{0} (only \\\\ and \\\" are allowed)")]
    Escape(char),
    /// A character literal.
    #[error("print fmt has a character literal")]
    CharLiteral,
    /// A string the format prints holds a control byte.
    #[error("print fmt prints a control byte ({0:#04x})")]
    ControlByte(u8),
    /// An identifier that is no field, allowed helper or type word.
    #[error("print fmt uses {0:?}, which is not a field, an allowed helper or a type")]
    Identifier(String),
    /// A width or precision over the bound.
    #[error("print fmt has a width or precision of {0} (at most {MAX_GUEST_WIDTH})")]
    Width(u16),
    /// A `*` width or precision.
    #[error("print fmt has a `*` width or precision")]
    Star,
    /// A conversion outside the subset.
    #[error("print fmt has the conversion {0} (allowed: %d %i %u %x %X %o %s %p)")]
    Conversion(&'static str),
    /// `/` or `%` by something other than a positive literal.
    #[error("print fmt divides by something other than a literal in 1..=2^63-1")]
    Division,
    /// An argument of the wrong kind for its conversion or helper.
    #[error("print fmt: {0}")]
    Argument(&'static str),
    /// A `__print_hex`/`__print_array` reading past its field.
    #[error("print fmt reads {want} bytes of a {size}-byte field")]
    Length {
        /// Bytes the helper reads.
        want: u64,
        /// The field's size.
        size: usize,
    },
}

type Check = Result<(), GuestFormatError>;

/// Checks the print fmt of `fmt` (a guest's registration: its fields already checked)
/// against the subset above.
pub fn check_guest_format(fmt: &EventFormat) -> Check {
    check_text(&fmt.print_fmt)?;
    let toks = lex(&fmt.print_fmt).map_err(|e| GuestFormatError::Parse(e.0))?;
    check_tokens(fmt, &toks)?;
    let prog = compile(fmt, &fmt.print_fmt, 8).map_err(|e| GuestFormatError::Parse(e.0))?;
    for op in &prog.ops {
        match op {
            Op::Lit(s) => printable(s)?,
            Op::StarConv(..) => return Err(GuestFormatError::Star),
            Op::Conv(spec, e) => conversion(spec, e)?,
        }
    }
    Ok(())
}

/// Escapes of string literals and character literals, on the text as written (the
/// lexer has decoded them).
fn check_text(s: &str) -> Check {
    let mut in_str = false;
    let mut it = s.chars();
    // Bounded: every iteration consumes at least one character.
    while let Some(c) = it.next() {
        match (in_str, c) {
            (true, '\\') => match it.next() {
                Some('\\' | '"') => {}
                Some(e) => return Err(GuestFormatError::Escape(e)),
                None => return Err(GuestFormatError::Parse("unterminated string".into())),
            },
            (_, '"') => in_str = !in_str,
            (false, '\'') => return Err(GuestFormatError::CharLiteral),
            _ => {}
        }
    }
    Ok(())
}

/// Every identifier is `REC->field`, a field argument of `__get_str`, an allowed helper
/// called, or a type word.
fn check_tokens(fmt: &EventFormat, toks: &[Tok]) -> Check {
    let mut i = 0;
    while i < toks.len() {
        // `/` and `%` (also in constant table values, which libtraceevent evaluates
        // when it parses the format) only by a positive literal.
        if matches!(toks[i], Tok::P("/" | "%"))
            && !matches!(toks.get(i + 1), Some(Tok::Num(v, _)) if (1..=i64::MAX as u64).contains(v))
        {
            return Err(GuestFormatError::Division);
        }
        if let Tok::Ident(id) = &toks[i] {
            let next = toks.get(i + 1);
            let call = next == Some(&Tok::P("("));
            if id == "REC" && next == Some(&Tok::P("->")) {
                match toks.get(i + 2) {
                    Some(Tok::Ident(f)) if fmt.field(f).is_some() => i += 2,
                    _ => return Err(GuestFormatError::Argument("REC-> names no field")),
                }
            } else if id == "__get_str" && call {
                match toks.get(i + 2) {
                    Some(Tok::Ident(f)) if fmt.field(f).is_some() => i += 2,
                    _ => return Err(GuestFormatError::Argument("__get_str names no field")),
                }
            } else if !(HELPERS.contains(&id.as_str()) && call || TYPE_WORDS.contains(&id.as_str()))
            {
                return Err(GuestFormatError::Identifier(id.clone()));
            }
        }
        i += 1;
    }
    Ok(())
}

fn printable(s: &str) -> Check {
    match s.bytes().find(|b| *b < 0x20 || *b == 0x7f) {
        Some(b) => Err(GuestFormatError::ControlByte(b)),
        None => Ok(()),
    }
}

fn conversion(spec: &Spec, e: &Expr) -> Check {
    for n in [spec.width, spec.prec].into_iter().flatten() {
        if n > MAX_GUEST_WIDTH {
            return Err(GuestFormatError::Width(n));
        }
    }
    if spec.star_width || spec.star_prec {
        return Err(GuestFormatError::Star);
    }
    match spec.conv {
        Conv::Signed | Conv::Unsigned | Conv::Hex | Conv::HexUpper | Conv::Octal | Conv::Ptr => {
            int_expr(e, 0)
        }
        Conv::Str => str_expr(e, 0),
        Conv::Char => Err(GuestFormatError::Conversion("%c")),
        Conv::Sym { .. } => Err(GuestFormatError::Conversion("%pS/%ps")),
        Conv::Net(_) => Err(GuestFormatError::Conversion("%pI/%pM")),
    }
}

/// Deepest integer expression accepted (the whole format is at most 1 KiB anyway).
const MAX_DEPTH: u32 = 32;

fn int_expr(e: &Expr, depth: u32) -> Check {
    if depth > MAX_DEPTH {
        return Err(GuestFormatError::Argument("expression nested too deep"));
    }
    let d = depth + 1;
    match e {
        Expr::Num(..) => Ok(()),
        Expr::Field(f) if f.kind == Kind::Int => Ok(()),
        Expr::Unary(_, a) | Expr::Cast(_, a) => int_expr(a, d),
        Expr::Bin(_, a, b) => {
            int_expr(a, d)?;
            int_expr(b, d)
        }
        Expr::Cond(c, a, b) => {
            int_expr(c, d)?;
            int_expr(a, d)?;
            int_expr(b, d)
        }
        _ => Err(GuestFormatError::Argument(
            "an integer conversion's argument is not an integer expression of fields and literals",
        )),
    }
}

fn str_expr(e: &Expr, depth: u32) -> Check {
    if depth > MAX_DEPTH {
        return Err(GuestFormatError::Argument("expression nested too deep"));
    }
    match e {
        Expr::Str(s) => printable(s),
        Expr::Field(f) if matches!(f.kind, Kind::Array(true)) => Ok(()),
        Expr::StrField(f) if matches!(f.kind, Kind::DataLoc(true)) => Ok(()),
        Expr::Symbolic(v, table) => {
            int_expr(v, 0)?;
            table.iter().try_for_each(|(_, name)| printable(name))
        }
        Expr::Flags(v, delim, table) => {
            int_expr(v, 0)?;
            printable(delim)?;
            table.iter().try_for_each(|(_, name)| printable(name))
        }
        Expr::Cond(c, a, b) => {
            int_expr(c, 0)?;
            str_expr(a, depth + 1)?;
            str_expr(b, depth + 1)
        }
        Expr::Hex(p, n, _) => within(p, n, 1),
        Expr::Array(p, n, el) => match **el {
            Expr::Num(s @ (1 | 2 | 4 | 8), _) => within(p, n, s),
            _ => Err(GuestFormatError::Argument(
                "__print_array's element size is not a literal 1, 2, 4 or 8",
            )),
        },
        _ => Err(GuestFormatError::Argument(
            "a %s argument is not a string literal, a char array or __get_str of a string field, or an allowed __print_ helper",
        )),
    }
}

/// `n` literal elements of `el` bytes of the fixed array field `p`, inside the field.
fn within(p: &Expr, n: &Expr, el: u64) -> Check {
    let (Expr::Field(f), Expr::Num(n, _)) = (p, n) else {
        return Err(GuestFormatError::Argument(
            "__print_hex/__print_array take a fixed array field and a literal length",
        ));
    };
    let f: &FieldRef = f;
    if !matches!(f.kind, Kind::Array(_)) || f.size == 0 {
        return Err(GuestFormatError::Argument(
            "__print_hex/__print_array take a fixed array field",
        ));
    }
    let want = n.saturating_mul(el);
    if *n == 0 || want > f.size as u64 {
        return Err(GuestFormatError::Length { want, size: f.size });
    }
    Ok(())
}
