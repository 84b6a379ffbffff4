//! The expression of a filter (`prev_pid != 0 && next_comm =~ "vcpu"`), parsed as
//! libtraceevent's parse-filter.c parses it, into a tree whose field names are not yet
//! resolved against an event format.
//!
//! The grammar (parse-filter.c's `process_filter`, written as recursive descent):
//!
//! ```text
//! expr    := term (('&&' | '||') term)*          left to right, one precedence
//! term    := '!' term | '(' expr ')' | simple    '!' takes one term
//! simple  := FIELD CMP rhs | item EXP item        a bit test `flags & 4` is true when non-zero
//! rhs     := NUMBER | 'C' | "STRING" | FIELD
//! CMP     := == != < <= > >= =~ !~
//! EXP     := + - * / % << >> & | ^
//! ```
//!
//! `&&` and `||` bind equally and group from the left, as libtraceevent builds its tree:
//! `a || b && c` is `(a || b) && c`. Numbers are decimal, `0x` hex or `0` octal (as
//! `strtoull(s, NULL, 0)`); a quoted string compares a string field (`==`, `!=`; `=~`,
//! `!~` a POSIX basic regular expression, case-insensitive, unanchored); a one-character
//! single-quoted `'c'` compared with `== != < ...` is that character's code. Strings keep
//! their backslashes as libtraceevent keeps them (`\"` does not end one); adjacent
//! double-quoted strings join.

use std::sync::Arc;

use super::bre::{compile_bre, Bre};
use super::FilterErrorKind as E;

/// Longest expression (bytes) a filter may hold.
pub const MAX_EXPR_LEN: usize = 4096;
/// Deepest nesting of parentheses and `!`.
pub const MAX_DEPTH: usize = 32;

/// A numeric comparison.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CmpOp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

/// An arithmetic operator of a value expression (`flags & 4`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpOp {
    Add,
    Sub,
    Mul,
    Div,
    Mod,
    Shl,
    Shr,
    And,
    Or,
    Xor,
}

/// What a string comparison tests.
#[derive(Debug)]
pub enum StrTest {
    /// `==` (`true`) or `!=` (`false`) against these bytes.
    Equal(Vec<u8>, bool),
    /// `=~` (`true`) or `!~` (`false`) against this expression.
    Regex(Box<Bre>, bool),
}

/// A value: a number or a field (resolved per event).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Item {
    Num(u64),
    Field(String),
}

/// A parsed expression.
#[derive(Debug)]
pub enum Ast {
    /// All of these (`&&`), left to right.
    And(Vec<Ast>),
    /// Any of these (`||`), left to right.
    Or(Vec<Ast>),
    /// `!`.
    Not(Box<Ast>),
    /// `FIELD op rhs`, numeric.
    Num { field: String, op: CmpOp, rhs: Item },
    /// `FIELD op "string"`.
    Str { field: String, test: Arc<StrTest> },
    /// `item op item`: true when the value is not zero.
    Value { left: Item, op: ExpOp, right: Item },
}

impl Ast {
    /// Calls `f` with every field name the expression uses.
    pub fn fields<'a>(&'a self, f: &mut dyn FnMut(&'a str)) {
        match self {
            Ast::And(v) | Ast::Or(v) => v.iter().for_each(|a| a.fields(f)),
            Ast::Not(a) => a.fields(f),
            Ast::Num { field, rhs, .. } => {
                f(field);
                if let Item::Field(r) = rhs {
                    f(r);
                }
            }
            Ast::Str { field, .. } => f(field),
            Ast::Value { left, right, .. } => {
                for i in [left, right] {
                    if let Item::Field(n) = i {
                        f(n);
                    }
                }
            }
        }
    }
}

/// A token of an expression.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Tok {
    /// A run of letters, digits and `_` (a number or a field name).
    Word(String),
    /// A double-quoted string (adjacent ones joined).
    Str(String),
    /// A single-quoted string.
    Char(String),
    Open,
    Close,
    Op(&'static str),
}

/// Operators, longest first.
const OPS: &[&str] = &[
    "&&", "||", "==", "!=", "<=", ">=", "=~", "!~", "<<", ">>", "!", "<", ">", "&", "|", "+", "-",
    "*", "/", "%", "^", "~", "=",
];

/// Splits `s` into tokens with their byte offsets.
fn lex(s: &str) -> Result<Vec<(usize, Tok)>, E> {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    // Bounded: every round consumes at least one byte.
    while i < b.len() {
        let c = b[i];
        let start = i;
        if c.is_ascii_whitespace() {
            i += 1;
            continue;
        }
        let tok = if c.is_ascii_alphanumeric() || c == b'_' {
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            Tok::Word(s[start..i].to_string())
        } else if c == b'"' || c == b'\'' {
            let (text, end) = quoted(s, i)?;
            i = end;
            if c == b'\'' {
                Tok::Char(text)
            } else {
                Tok::Str(text)
            }
        } else if c == b'(' || c == b')' {
            i += 1;
            if c == b'(' {
                Tok::Open
            } else {
                Tok::Close
            }
        } else if let Some(op) = OPS.iter().find(|o| s[i..].starts_with(**o)) {
            i += op.len();
            Tok::Op(op)
        } else {
            let ch = s[i..].chars().next().unwrap_or('?');
            return Err(E::Syntax(start, format!("unexpected `{ch}`")));
        };
        out.push((start, tok));
    }
    Ok(out)
}

/// The string quoted at `s[at]` and the offset after it: backslashes are kept and keep
/// the next quote in the string (`\\` cancels itself); a double-quoted string followed
/// by another (spaces between) goes on with it.
fn quoted(s: &str, at: usize) -> Result<(String, usize), E> {
    let b = s.as_bytes();
    let q = b[at];
    let mut text = Vec::new();
    let mut i = at + 1;
    loop {
        let mut last = 0u8;
        // Bounded: every round consumes a byte or ends.
        loop {
            let Some(&c) = b.get(i) else {
                return Err(E::Syntax(at, "string without its closing quote".into()));
            };
            i += 1;
            if c == q && last != b'\\' {
                break;
            }
            text.push(c);
            last = if c == b'\\' && last == b'\\' { 0 } else { c };
        }
        if q != b'"' {
            break;
        }
        let mut j = i;
        while b.get(j).is_some_and(u8::is_ascii_whitespace) {
            j += 1;
        }
        if b.get(j) != Some(&b'"') {
            break;
        }
        i = j + 1;
    }
    // Cut at quote bytes only: the text is whole UTF-8 characters.
    Ok((String::from_utf8_lossy(&text).into_owned(), i))
}

/// Parses a filter expression.
pub fn parse(s: &str) -> Result<Ast, E> {
    if s.len() > MAX_EXPR_LEN {
        return Err(E::TooLong(s.len(), MAX_EXPR_LEN));
    }
    let toks = lex(s)?;
    let mut p = Parser {
        toks,
        at: 0,
        end: s.len(),
    };
    if p.toks.is_empty() {
        return Err(E::Syntax(s.len(), "empty expression".into()));
    }
    let ast = p.expr(0)?;
    match p.peek() {
        None => Ok(ast),
        Some(Tok::Close) => Err(E::Syntax(p.pos(), "`)` without its `(`".into())),
        Some(t) => Err(E::Syntax(p.pos(), format!("unexpected {}", describe(t)))),
    }
}

fn describe(t: &Tok) -> String {
    match t {
        Tok::Word(w) => format!("`{w}`"),
        Tok::Str(s) => format!("\"{s}\""),
        Tok::Char(s) => format!("'{s}'"),
        Tok::Open => "`(`".into(),
        Tok::Close => "`)`".into(),
        Tok::Op(o) => format!("`{o}`"),
    }
}

struct Parser {
    toks: Vec<(usize, Tok)>,
    at: usize,
    /// Length of the text (the position of "the end").
    end: usize,
}

impl Parser {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.at).map(|(_, t)| t)
    }

    fn pos(&self) -> usize {
        self.toks.get(self.at).map_or(self.end, |(p, _)| *p)
    }

    fn next(&mut self, what: &str) -> Result<Tok, E> {
        match self.toks.get(self.at) {
            Some((_, t)) => {
                self.at += 1;
                Ok(t.clone())
            }
            None => Err(E::Syntax(
                self.end,
                format!("expected {what}, found the end"),
            )),
        }
    }

    fn expr(&mut self, depth: usize) -> Result<Ast, E> {
        let mut acc = self.term(depth)?;
        while let Some(Tok::Op(op @ ("&&" | "||"))) = self.peek() {
            let and = *op == "&&";
            self.at += 1;
            let t = self.term(depth)?;
            acc = match (acc, and) {
                (Ast::And(mut v), true) => {
                    v.push(t);
                    Ast::And(v)
                }
                (Ast::Or(mut v), false) => {
                    v.push(t);
                    Ast::Or(v)
                }
                (a, true) => Ast::And(vec![a, t]),
                (a, false) => Ast::Or(vec![a, t]),
            };
        }
        Ok(acc)
    }

    fn term(&mut self, depth: usize) -> Result<Ast, E> {
        if depth >= MAX_DEPTH {
            return Err(E::TooDeep(MAX_DEPTH));
        }
        let pos = self.pos();
        match self.next("a comparison")? {
            Tok::Op("!") => Ok(Ast::Not(Box::new(self.term(depth + 1)?))),
            Tok::Open => {
                let e = self.expr(depth + 1)?;
                match self.next("`)`")? {
                    Tok::Close => Ok(e),
                    t => Err(E::Syntax(
                        self.toks[self.at - 1].0,
                        format!("expected `)` or `&&`/`||`, found {}", describe(&t)),
                    )),
                }
            }
            Tok::Word(w) => self.simple(pos, w),
            t => Err(E::Syntax(
                pos,
                format!("expected a field, `!` or `(`, found {}", describe(&t)),
            )),
        }
    }

    /// `FIELD CMP rhs` or `item EXP item`, `left` read.
    fn simple(&mut self, pos: usize, left: String) -> Result<Ast, E> {
        let op_pos = self.pos();
        let op = match self.next("an operator")? {
            Tok::Op(op) => op,
            t => {
                return Err(E::Syntax(
                    op_pos,
                    format!(
                        "expected an operator after `{left}`, found {}",
                        describe(&t)
                    ),
                ))
            }
        };
        if let Some(e) = exp_op(op) {
            let right = self.item()?;
            return Ok(Ast::Value {
                left: item(pos, &left)?,
                op: e,
                right,
            });
        }
        let Some(cmp) = cmp_op(op) else {
            return Err(E::Syntax(op_pos, format!("`{op}` is not a comparison")));
        };
        if left.as_bytes()[0].is_ascii_digit() {
            return Err(E::Syntax(
                pos,
                format!("the left side of `{op}` must be a field, not `{left}`"),
            ));
        }
        let rpos = self.pos();
        let rhs = self.next("a value")?;
        compare(left, cmp, rhs, rpos)
    }

    fn item(&mut self) -> Result<Item, E> {
        let pos = self.pos();
        match self.next("a value")? {
            Tok::Word(w) => item(pos, &w),
            t => Err(E::Syntax(
                pos,
                format!("expected a number or a field, found {}", describe(&t)),
            )),
        }
    }
}

/// A comparison: `==`... of a field with a value, string or regex.
enum Cmp {
    Num(CmpOp),
    Regex(bool),
}

fn cmp_op(op: &str) -> Option<Cmp> {
    Some(match op {
        "==" => Cmp::Num(CmpOp::Eq),
        "!=" => Cmp::Num(CmpOp::Ne),
        "<" => Cmp::Num(CmpOp::Lt),
        "<=" => Cmp::Num(CmpOp::Le),
        ">" => Cmp::Num(CmpOp::Gt),
        ">=" => Cmp::Num(CmpOp::Ge),
        "=~" => Cmp::Regex(true),
        "!~" => Cmp::Regex(false),
        _ => return None,
    })
}

fn exp_op(op: &str) -> Option<ExpOp> {
    Some(match op {
        "+" => ExpOp::Add,
        "-" => ExpOp::Sub,
        "*" => ExpOp::Mul,
        "/" => ExpOp::Div,
        "%" => ExpOp::Mod,
        "<<" => ExpOp::Shl,
        ">>" => ExpOp::Shr,
        "&" => ExpOp::And,
        "|" => ExpOp::Or,
        "^" => ExpOp::Xor,
        _ => return None,
    })
}

/// `field cmp rhs` (libtraceevent's `add_right`).
fn compare(field: String, cmp: Cmp, rhs: Tok, pos: usize) -> Result<Ast, E> {
    let string = |s: String| -> Result<Ast, E> {
        let test = match cmp {
            Cmp::Num(CmpOp::Eq) => StrTest::Equal(s.into_bytes(), true),
            Cmp::Num(CmpOp::Ne) => StrTest::Equal(s.into_bytes(), false),
            Cmp::Regex(m) => StrTest::Regex(Box::new(compile_bre(&s, false)?), m),
            Cmp::Num(_) => {
                return Err(E::Syntax(
                    pos,
                    "a string compares only with ==, !=, =~ or !~".into(),
                ))
            }
        };
        Ok(Ast::Str {
            field: field.clone(),
            test: Arc::new(test),
        })
    };
    match (rhs, &cmp) {
        (Tok::Str(s), _) => string(s),
        // A one-character 'c' is its code, but for a regex.
        (Tok::Char(s), Cmp::Num(op)) if s.len() == 1 => Ok(Ast::Num {
            field,
            op: *op,
            rhs: Item::Num(u64::from(s.as_bytes()[0])),
        }),
        (Tok::Char(s), _) => string(s),
        (Tok::Word(_), Cmp::Regex(_)) => Err(E::Syntax(
            pos,
            "=~ and !~ take a quoted regular expression".into(),
        )),
        (Tok::Word(w), Cmp::Num(op)) => Ok(Ast::Num {
            field,
            op: *op,
            rhs: item(pos, &w)?,
        }),
        (t, _) => Err(E::Syntax(
            pos,
            format!("expected a value, found {}", describe(&t)),
        )),
    }
}

/// A word as a value: a number when it starts with a digit, else a field name.
fn item(pos: usize, w: &str) -> Result<Item, E> {
    if !w.as_bytes()[0].is_ascii_digit() {
        return Ok(Item::Field(w.to_string()));
    }
    parse_number(w)
        .map(Item::Num)
        .ok_or_else(|| E::Syntax(pos, format!("`{w}` is not a number")))
}

/// `strtoull(w, NULL, 0)` of a whole word: `0x` hex, leading `0` octal, else decimal.
fn parse_number(w: &str) -> Option<u64> {
    if let Some(h) = w.strip_prefix("0x").or_else(|| w.strip_prefix("0X")) {
        u64::from_str_radix(h, 16).ok()
    } else if w.len() > 1 && w.starts_with('0') {
        u64::from_str_radix(&w[1..], 8).ok()
    } else {
        w.parse().ok()
    }
}
