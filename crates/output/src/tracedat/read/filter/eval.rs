//! An expression resolved against one event format, and its test of a record
//! (libtraceevent's `test_filter`): fields read from the payload, unsigned 64-bit
//! comparisons of sign-extended values, strings cut at their NUL.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::format::{EventFormat, Field};
use crate::text::{comm_of, field_bytes, field_int};

use super::expr::{Ast, CmpOp, ExpOp, Item, StrTest};
use super::FilterErrorKind as E;

/// A value of a record.
#[derive(Debug)]
pub enum Val {
    Const(u64),
    Field(Field),
    /// The record's CPU (libtraceevent's `CPU`).
    Cpu,
    Exp(Box<Val>, ExpOp, Box<Val>),
}

/// Where a string comes from.
#[derive(Debug)]
pub enum StrSrc {
    Field(Field),
    /// The comm of the record's pid (libtraceevent's `COMM`).
    Comm,
}

/// An expression resolved for one event.
#[derive(Debug)]
pub enum Node {
    Const(bool),
    And(Vec<Node>),
    Or(Vec<Node>),
    Not(Box<Node>),
    Num(Val, CmpOp, Val),
    Str(StrSrc, Arc<StrTest>),
    Value(Val),
}

/// What a record gives a test: its payload, CPU and the file's comms.
pub struct Rec<'a> {
    pub payload: &'a [u8],
    pub cpu: u32,
    pub cmdlines: &'a BTreeMap<i32, String>,
}

/// A field of `fmt` by name (common fields first, as `tep_find_any_field`), then the
/// special `COMM` and `CPU`.
enum Found<'a> {
    Field(&'a Field),
    Comm,
    Cpu,
    Missing,
}

fn find<'a>(fmt: &'a EventFormat, name: &str) -> Found<'a> {
    let f = fmt
        .common_fields
        .iter()
        .chain(&fmt.fields)
        .find(|f| f.name == name);
    match (f, name) {
        (Some(f), _) => Found::Field(f),
        (None, "COMM") => Found::Comm,
        (None, "CPU") => Found::Cpu,
        (None, _) => Found::Missing,
    }
}

/// Whether `fmt` has the field (or it is `COMM`/`CPU`).
pub fn has_field(fmt: &EventFormat, name: &str) -> bool {
    !matches!(find(fmt, name), Found::Missing)
}

fn event_name(fmt: &EventFormat) -> String {
    format!("{}:{}", fmt.system, fmt.name)
}

/// A numeric value; `None` for a field this event does not have.
fn num_val(fmt: &EventFormat, it: &Item) -> Result<Option<Val>, E> {
    let name = match it {
        Item::Num(n) => return Ok(Some(Val::Const(*n))),
        Item::Field(n) => n,
    };
    match find(fmt, name) {
        Found::Field(f) if f.is_string() || !matches!(f.size, 1 | 2 | 4 | 8) => {
            Err(E::NotNumber(name.clone(), event_name(fmt)))
        }
        Found::Field(f) => Ok(Some(Val::Field(f.clone()))),
        Found::Cpu => Ok(Some(Val::Cpu)),
        Found::Comm => Err(E::NotNumber(name.clone(), event_name(fmt))),
        Found::Missing => Ok(None),
    }
}

/// Resolves `ast` for `fmt`. A comparison of a field the event does not have is false
/// (libtraceevent); the caller refuses a field no selected event has.
pub fn resolve(ast: &Ast, fmt: &EventFormat) -> Result<Node, E> {
    Ok(match ast {
        Ast::And(v) => Node::And(
            v.iter()
                .map(|a| resolve(a, fmt))
                .collect::<Result<_, _>>()?,
        ),
        Ast::Or(v) => Node::Or(
            v.iter()
                .map(|a| resolve(a, fmt))
                .collect::<Result<_, _>>()?,
        ),
        Ast::Not(a) => Node::Not(Box::new(resolve(a, fmt)?)),
        Ast::Num { field, op, rhs } => {
            let l = num_val(fmt, &Item::Field(field.clone()))?;
            let r = num_val(fmt, rhs)?;
            match (l, r) {
                (Some(l), Some(r)) => Node::Num(l, *op, r),
                (None, _) => Node::Const(false),
                // libtraceevent: an unknown field on the right is an illegal rvalue.
                (Some(_), None) => return Err(E::NoField(rhs_name(rhs), event_name(fmt))),
            }
        }
        Ast::Str { field, test } => match find(fmt, field) {
            Found::Field(f) if f.is_string() => Node::Str(StrSrc::Field(f.clone()), test.clone()),
            Found::Comm => Node::Str(StrSrc::Comm, test.clone()),
            Found::Missing => Node::Const(false),
            Found::Field(_) | Found::Cpu => {
                return Err(E::NotString(field.clone(), event_name(fmt)))
            }
        },
        Ast::Value { left, op, right } => match (num_val(fmt, left)?, num_val(fmt, right)?) {
            (Some(l), Some(r)) => Node::Value(Val::Exp(Box::new(l), *op, Box::new(r))),
            _ => Node::Const(false),
        },
    })
}

fn rhs_name(i: &Item) -> String {
    match i {
        Item::Field(n) => n.clone(),
        Item::Num(n) => n.to_string(),
    }
}

impl Node {
    /// Whether the record passes.
    pub fn test(&self, r: &Rec<'_>) -> bool {
        match self {
            Node::Const(b) => *b,
            Node::And(v) => v.iter().all(|n| n.test(r)),
            Node::Or(v) => v.iter().any(|n| n.test(r)),
            Node::Not(n) => !n.test(r),
            Node::Num(l, op, rv) => {
                let (a, b) = (l.get(r), rv.get(r));
                match op {
                    CmpOp::Eq => a == b,
                    CmpOp::Ne => a != b,
                    CmpOp::Lt => a < b,
                    CmpOp::Le => a <= b,
                    CmpOp::Gt => a > b,
                    CmpOp::Ge => a >= b,
                }
            }
            Node::Str(src, t) => {
                let s: &[u8] = match src {
                    StrSrc::Field(f) => field_bytes(f, r.payload).unwrap_or_default(),
                    StrSrc::Comm => comm_of(r.cmdlines, pid(r.payload)).as_bytes(),
                };
                match &**t {
                    StrTest::Equal(b, m) => (s == b.as_slice()) == *m,
                    StrTest::Regex(re, m) => re.is_match(s) == *m,
                }
            }
            Node::Value(v) => v.get(r) != 0,
        }
    }
}

fn pid(payload: &[u8]) -> i32 {
    payload
        .get(4..8)
        .map_or(-1, |b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

impl Val {
    fn get(&self, r: &Rec<'_>) -> u64 {
        match self {
            Val::Const(n) => *n,
            // A payload too short for the field reads as 0.
            Val::Field(f) => field_int(f, r.payload).unwrap_or(0),
            Val::Cpu => u64::from(r.cpu),
            Val::Exp(l, op, rv) => {
                let (a, b) = (l.get(r), rv.get(r));
                // Wrapping as C's unsigned arithmetic; what C leaves undefined (x / 0,
                // shifts of 64 or more) is 0 here.
                match op {
                    ExpOp::Add => a.wrapping_add(b),
                    ExpOp::Sub => a.wrapping_sub(b),
                    ExpOp::Mul => a.wrapping_mul(b),
                    ExpOp::Div => a.checked_div(b).unwrap_or(0),
                    ExpOp::Mod => a.checked_rem(b).unwrap_or(0),
                    ExpOp::Shl => u32::try_from(b)
                        .ok()
                        .and_then(|s| a.checked_shl(s))
                        .unwrap_or(0),
                    ExpOp::Shr => u32::try_from(b)
                        .ok()
                        .and_then(|s| a.checked_shr(s))
                        .unwrap_or(0),
                    ExpOp::And => a & b,
                    ExpOp::Or => a | b,
                    ExpOp::Xor => a ^ b,
                }
            }
        }
    }
}
