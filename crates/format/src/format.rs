//! Event `format` files: the guest event table, generation of the text the kernel
//! prints in `events/<system>/<event>/format`, and parsing of such text (from any
//! trace.dat), plus `header_page` / `header_event`.

use hyptrace_abi::events;

use crate::FormatError;

/// One field of an event format.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Field {
    /// C type as written in the format (`u64`, `unsigned short`, `__data_loc char[]`, `char[16]`...).
    pub type_name: String,
    /// Field name.
    pub name: String,
    /// Offset in the payload.
    pub offset: usize,
    /// Size in bytes.
    pub size: usize,
    /// Signedness.
    pub signed: bool,
}

impl Field {
    /// `__data_loc` field (u32 `offset | len << 16` pointing into the payload).
    pub fn is_data_loc(&self) -> bool {
        self.type_name.starts_with("__data_loc")
    }

    /// `__rel_loc` field (like `__data_loc`, offset relative to the end of the field).
    pub fn is_rel_loc(&self) -> bool {
        self.type_name.starts_with("__rel_loc")
    }

    /// Fixed-size array (`char comm[16]` is parsed as type `char[16]`).
    pub fn is_array(&self) -> bool {
        self.type_name.ends_with(']') && !self.is_data_loc() && !self.is_rel_loc()
    }

    /// Character string (char array, `__data_loc char[]`).
    pub fn is_string(&self) -> bool {
        // strip_prefix, not trim_start_matches: no substring searcher per call (this
        // runs for every field of every event `report` prints raw).
        let t = self.type_name.as_str();
        let t = t
            .strip_prefix("__data_loc")
            .or_else(|| t.strip_prefix("__rel_loc"))
            .unwrap_or(t)
            .trim();
        t.starts_with("char") && t.ends_with(']')
    }
}

/// An event format (what one `format` file says).
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct EventFormat {
    /// System (`guest`, `sched`...).
    pub system: String,
    /// Event name.
    pub name: String,
    /// Event id (`common_type`).
    pub id: u16,
    /// Common fields (`common_type`...).
    pub common_fields: Vec<Field>,
    /// Event fields.
    pub fields: Vec<Field>,
    /// The print fmt line after `print fmt: ` (format string in quotes, then arguments).
    pub print_fmt: String,
}

/// The common header fields every event starts with.
pub fn common_fields() -> Vec<Field> {
    let f = |t: &str, n: &str, offset, size, signed| Field {
        type_name: t.into(),
        name: n.into(),
        offset,
        size,
        signed,
    };
    vec![
        f("unsigned short", "common_type", 0, 2, false),
        f("unsigned char", "common_flags", 2, 1, false),
        f("unsigned char", "common_preempt_count", 3, 1, false),
        f("int", "common_pid", 4, 4, true),
    ]
}

/// One row of the guest event table.
struct GuestEvent {
    name: &'static str,
    id: u16,
    /// (type, name, offset, size, signed)
    fields: &'static [(&'static str, &'static str, usize, usize, bool)],
    print_fmt: &'static str,
}

/// The built-in guest events (system `guest`), from the layouts in `hyptrace_abi::events`.
const GUEST_EVENTS: &[GuestEvent] = &[
    GuestEvent {
        name: "marker",
        id: events::MARKER_ID,
        fields: &[("u64", "seq", 8, 8, false), ("u64", "value", 16, 8, false)],
        print_fmt: "\"seq=%llu value=%llu\", REC->seq, REC->value",
    },
    GuestEvent {
        name: "span",
        id: events::SPAN_ID,
        fields: &[
            ("u64", "seq", 8, 8, false),
            ("u64", "id", 16, 8, false),
            ("u64", "dur", 24, 8, false),
        ],
        print_fmt: "\"seq=%llu id=%llu dur=%llu\", REC->seq, REC->id, REC->dur",
    },
    GuestEvent {
        name: "text",
        id: events::TEXT_ID,
        fields: &[
            ("u64", "seq", 8, 8, false),
            ("__data_loc char[]", "msg", 16, 4, false),
        ],
        print_fmt: "\"seq=%llu msg=%s\", REC->seq, __get_str(msg)",
    },
];

/// The formats of the built-in guest events.
pub fn guest_formats() -> Vec<EventFormat> {
    GUEST_EVENTS
        .iter()
        .map(|e| EventFormat {
            system: events::SYSTEM.into(),
            name: e.name.into(),
            id: e.id,
            common_fields: common_fields(),
            fields: e
                .fields
                .iter()
                .map(|&(t, n, offset, size, signed)| Field {
                    type_name: t.into(),
                    name: n.into(),
                    offset,
                    size,
                    signed,
                })
                .collect(),
            print_fmt: e.print_fmt.into(),
        })
        .collect()
}

/// System of the events hyptrace itself adds to a trace.dat (never written by a guest).
pub const HYPTRACE_SYSTEM: &str = "hyptrace";
/// Name of the event that closes a CPU whose writer lost events after its last page.
pub const TRAILING_LOST_NAME: &str = "trailing_lost";
/// Payload size of a `hyptrace:trailing_lost` event: common header + u64 count.
pub const TRAILING_LOST_SIZE: usize = 16;

/// The format of `hyptrace:trailing_lost` (field `u64 count` at 8, print fmt
/// `count=%llu`) with event id `id`.
pub fn trailing_lost_format(id: u16) -> EventFormat {
    EventFormat {
        system: HYPTRACE_SYSTEM.into(),
        name: TRAILING_LOST_NAME.into(),
        id,
        common_fields: common_fields(),
        fields: vec![Field {
            type_name: "u64".into(),
            name: "count".into(),
            offset: 8,
            size: 8,
            signed: false,
        }],
        print_fmt: "\"count=%llu\", REC->count".into(),
    }
}

impl EventFormat {
    /// Whether this is hyptrace's own `trailing_lost` event.
    pub fn is_trailing_lost(&self) -> bool {
        self.system == HYPTRACE_SYSTEM && self.name == TRAILING_LOST_NAME
    }
}

fn field_line(out: &mut String, f: &Field) {
    // Arrays are written `char comm[16]`: the bracket goes after the name.
    let decl = match (f.is_array(), f.type_name.find('[')) {
        (true, Some(i)) => format!("{} {}{}", &f.type_name[..i], f.name, &f.type_name[i..]),
        _ => format!("{} {}", f.type_name, f.name),
    };
    out.push_str(&format!(
        "\tfield:{decl};\toffset:{};\tsize:{};\tsigned:{};\n",
        f.offset,
        f.size,
        u8::from(f.signed)
    ));
}

impl EventFormat {
    /// The `format` file text, as the kernel prints it.
    pub fn to_format_text(&self) -> String {
        let mut s = format!("name: {}\nID: {}\nformat:\n", self.name, self.id);
        for f in &self.common_fields {
            field_line(&mut s, f);
        }
        s.push('\n');
        for f in &self.fields {
            field_line(&mut s, f);
        }
        s.push_str(&format!("\nprint fmt: {}\n", self.print_fmt));
        s
    }

    /// Looks a field (event or common) up by name.
    pub fn field(&self, name: &str) -> Option<&Field> {
        self.fields
            .iter()
            .chain(&self.common_fields)
            .find(|f| f.name == name)
    }

    /// Parses a `format` file. `system` is the system the file was stored under.
    ///
    /// # Errors
    /// [`FormatError::Event`] when a line is malformed or the name or ID is missing.
    pub fn parse(system: &str, text: &str) -> Result<Self, FormatError> {
        let bad = |reason: &'static str| FormatError::Event {
            system: system.into(),
            reason,
        };
        let mut name = None;
        let mut id = None;
        let mut common = Vec::new();
        let mut fields = Vec::new();
        let mut print_fmt = String::new();
        for line in text.lines() {
            let t = line.trim();
            if let Some(v) = t.strip_prefix("name:") {
                name = Some(v.trim().to_string());
            } else if let Some(v) = t.strip_prefix("ID:") {
                id = Some(v.trim().parse::<u16>().map_err(|_| bad("bad ID"))?);
            } else if let Some(v) = t.strip_prefix("field:") {
                let f = parse_field_line(v).ok_or_else(|| bad("bad field line"))?;
                if f.name.starts_with("common_") && fields.is_empty() {
                    common.push(f);
                } else {
                    fields.push(f);
                }
            } else if let Some(v) = t.strip_prefix("print fmt:") {
                print_fmt = v.trim().to_string();
            }
        }
        Ok(Self {
            system: system.into(),
            name: name.ok_or_else(|| bad("no name"))?,
            id: id.ok_or_else(|| bad("no ID"))?,
            common_fields: common,
            fields,
            print_fmt,
        })
    }
}

/// Parses `TYPE NAME;\toffset:N;\tsize:N;\tsigned:N;` (after `field:`).
fn parse_field_line(v: &str) -> Option<Field> {
    let mut parts = v.split(';').map(str::trim);
    let decl = parts.next()?;
    let mut offset = None;
    let mut size = None;
    let mut signed = false;
    for p in parts {
        if let Some(x) = p.strip_prefix("offset:") {
            offset = x.trim().parse().ok();
        } else if let Some(x) = p.strip_prefix("size:") {
            size = x.trim().parse().ok();
        } else if let Some(x) = p.strip_prefix("signed:") {
            signed = x.trim() == "1";
        }
    }
    // Split the declaration into type and name; `char comm[16]` → type `char[16]`.
    let (decl, array) = match decl.find('[') {
        Some(i) if !decl.starts_with("__data_loc") && !decl.starts_with("__rel_loc") => {
            (&decl[..i], &decl[i..])
        }
        _ => (decl, ""),
    };
    let decl = decl.trim_end();
    let sp = decl.rfind(|c: char| c.is_whitespace() || c == '*')?;
    let name = decl[sp + 1..].trim();
    let ty = decl[..=sp].trim();
    if name.is_empty() || ty.is_empty() {
        return None;
    }
    Some(Field {
        type_name: format!("{ty}{array}"),
        name: name.into(),
        offset: offset?,
        size: size?,
        signed,
    })
}

/// The `header_page` text for pages of `page_size` bytes (x86_64: 8-byte `commit`).
pub fn header_page_text(page_size: usize) -> String {
    format!(
        "\tfield: u64 timestamp;\toffset:0;\tsize:8;\tsigned:0;\n\
         \tfield: local_t commit;\toffset:8;\tsize:8;\tsigned:1;\n\
         \tfield: int overwrite;\toffset:8;\tsize:1;\tsigned:1;\n\
         \tfield: char data;\toffset:16;\tsize:{};\tsigned:0;\n",
        page_size.saturating_sub(16)
    )
}

/// The `header_event` text, as the kernel prints it.
pub const HEADER_EVENT_TEXT: &str = "# compressed entry header\n\
\ttype_len    :    5 bits\n\
\ttime_delta  :   27 bits\n\
\tarray       :   32 bits\n\
\n\
\tpadding     : type == 29\n\
\ttime_extend : type == 30\n\
\ttime_stamp : type == 31\n\
\tdata max type_len  == 28\n";

/// What a `header_page` text says: sizes of `commit` and of the data area.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeaderPage {
    /// Size of the `commit` field (8 on 64-bit kernels).
    pub commit_size: usize,
    /// Offset of `data`.
    pub data_offset: usize,
    /// Size of `data` (page size − 16).
    pub data_size: usize,
}

impl HeaderPage {
    /// Parses a `header_page` text.
    ///
    /// # Errors
    /// [`FormatError::HeaderPage`] when the `commit` or `data` field is missing.
    pub fn parse(text: &str) -> Result<Self, FormatError> {
        let mut commit = None;
        let mut data = None;
        for line in text.lines() {
            let t = line.trim();
            let Some(v) = t.strip_prefix("field:") else {
                continue;
            };
            let Some(f) = parse_field_line(v) else {
                continue;
            };
            match f.name.as_str() {
                "commit" => commit = Some(f.size),
                "data" => data = Some((f.offset, f.size)),
                _ => {}
            }
        }
        let commit_size = commit.ok_or(FormatError::HeaderPage("commit"))?;
        let (data_offset, data_size) = data.ok_or(FormatError::HeaderPage("data"))?;
        Ok(Self {
            commit_size,
            data_offset,
            data_size,
        })
    }
}

/// Whether `text` matches the glob `pat`: `*` any run of characters, `?` one character,
/// anything else itself (no classes, no escapes), as the `[SYSTEM:]EVENT` patterns of
/// `report -F`/`--events` and of `run -e`/`--disable` use it. Bounded for hostile text:
/// O(len(pat) × len(text)) at worst, no recursion.
pub fn glob(pat: &str, text: &str) -> bool {
    let p: Vec<char> = pat.chars().collect();
    let t: Vec<char> = text.chars().collect();
    // Iterative matcher with one backtrack point: O(|p| * |t|) at worst.
    let (mut i, mut j) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while j < t.len() {
        if i < p.len() && (p[i] == '?' || p[i] == t[j]) {
            i += 1;
            j += 1;
        } else if i < p.len() && p[i] == '*' {
            star = Some((i, j));
            i += 1;
        } else if let Some((si, sj)) = star {
            i = si + 1;
            j = sj + 1;
            star = Some((si, sj + 1));
        } else {
            return false;
        }
    }
    p[i..].iter().all(|&c| c == '*')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob("*", ""));
        assert!(glob("sched_*", "sched_switch"));
        assert!(glob("*switch", "sched_switch"));
        assert!(glob("s?hed*", "sched_switch"));
        assert!(!glob("sched", "sched_switch"));
        assert!(!glob("*x*", "sched_switch"));
        assert!(glob("a*b*c", "aXbYbZc"));
        // The cases of the host's `-e` matcher (it uses this one).
        assert!(glob("g?est", "guest"));
        assert!(glob("m*r", "marker"));
        assert!(glob("mark*", "marker"));
        assert!(!glob("mark", "marker"));
        assert!(!glob("span", "marker"));
        // `?` is one character, not one byte.
        assert!(glob("?", "é"));
        assert!(!glob("??", "é"));
    }

    #[test]
    fn guest_format_text_round_trips() {
        for f in guest_formats() {
            let text = f.to_format_text();
            let back = EventFormat::parse("guest", &text).unwrap();
            assert_eq!(back, f, "{text}");
        }
        let text = guest_formats()[2].to_format_text();
        assert!(
            text.contains("\tfield:__data_loc char[] msg;\toffset:16;\tsize:4;\tsigned:0;\n"),
            "{text}"
        );
        assert!(text.ends_with("print fmt: \"seq=%llu msg=%s\", REC->seq, __get_str(msg)\n"));
        assert!(text.starts_with(
            "name: text\nID: 1002\nformat:\n\tfield:unsigned short common_type;\toffset:0;"
        ));
    }

    #[test]
    fn parses_kernel_arrays() {
        let f = parse_field_line("char comm[16];\toffset:8;\tsize:16;\tsigned:0;").unwrap();
        assert_eq!(
            (f.type_name.as_str(), f.name.as_str(), f.offset, f.size),
            ("char[16]", "comm", 8, 16)
        );
        assert!(f.is_array() && f.is_string());
        let mut s = String::new();
        field_line(&mut s, &f);
        assert_eq!(
            s,
            "\tfield:char comm[16];\toffset:8;\tsize:16;\tsigned:0;\n"
        );
        let f = parse_field_line("const char * name;\toffset:8;\tsize:8;\tsigned:0;").unwrap();
        assert_eq!(
            (f.type_name.as_str(), f.name.as_str()),
            ("const char *", "name")
        );
    }

    #[test]
    fn header_page() {
        let h = HeaderPage::parse(&header_page_text(16384)).unwrap();
        assert_eq!(
            h,
            HeaderPage {
                commit_size: 8,
                data_offset: 16,
                data_size: 16368
            }
        );
        assert!(header_page_text(4096).contains("size:4080;"));
    }
}
