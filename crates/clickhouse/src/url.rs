//! `clickhouse://HOST:PORT/DATABASE[?vm=NAME]`: where the rows go.

/// A bad `clickhouse://` URL (the user's: exit 2).
#[derive(Debug, thiserror::Error)]
#[error("bad ClickHouse URL `{url}`: {why} (expected clickhouse://HOST:PORT/DATABASE[?vm=NAME])")]
pub struct UrlError {
    /// The URL as given (escaped for a terminal).
    pub url: String,
    /// What is wrong.
    pub why: String,
}

/// The URL scheme that names a ClickHouse output.
pub const SCHEME: &str = "clickhouse://";

/// Longest database or VM name taken.
const MAX_NAME: usize = 64;
/// Longest host name taken (DNS's limit).
const MAX_HOST: usize = 253;

/// A checked `clickhouse://` URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClickHouseUrl {
    /// Host name or IPv4 address (an IPv6 address in brackets, kept with them).
    pub host: String,
    /// HTTP port.
    pub port: u16,
    /// Database: `[A-Za-z_][A-Za-z0-9_]*` (put into SQL as it is: nothing else is
    /// taken; a leading digit would not be an identifier).
    pub database: String,
    /// `?vm=NAME`: the name of the VM on every row (`[A-Za-z0-9_.:-]+`), if given.
    pub vm: Option<String>,
}

/// Whether `s` names a ClickHouse output (starts with `clickhouse://`).
pub fn is_clickhouse_url(s: &str) -> bool {
    s.starts_with(SCHEME)
}

fn is_name(s: &str, extra: &[u8]) -> bool {
    !s.is_empty()
        && s.len() <= MAX_NAME
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || extra.contains(&b))
}

/// A host name or IPv4 address (`[A-Za-z0-9._-]`, no empty label, no leading or
/// trailing `-` or `.`), or an IPv6 address in brackets (`[` hex digits, `:` and `.`
/// `]`): what an HTTP URL takes as it is, so the request goes where the URL says.
fn is_host(h: &str) -> bool {
    if h.is_empty() || h.len() > MAX_HOST {
        return false;
    }
    if let Some(v6) = h.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
        return v6.contains(':')
            && v6
                .bytes()
                .all(|b| b.is_ascii_hexdigit() || b":.".contains(&b));
    }
    h.split('.').all(|label| {
        !label.is_empty()
            && !label.starts_with('-')
            && !label.ends_with('-')
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    })
}

impl ClickHouseUrl {
    /// Parses `clickhouse://HOST:PORT/DATABASE[?vm=NAME]`: a host, a port 1..=65535, a
    /// database `[A-Za-z_][A-Za-z0-9_]*` are required.
    pub fn parse(url: &str) -> Result<Self, UrlError> {
        let bad = |why: &str| UrlError {
            url: hyptrace_output::escape_guest_str(url).into_owned(),
            why: why.into(),
        };
        let rest = url
            .strip_prefix(SCHEME)
            .ok_or_else(|| bad("not clickhouse://"))?;
        let (authority, path) = rest.split_once('/').ok_or_else(|| bad("no /DATABASE"))?;
        let (db, query) = match path.split_once('?') {
            Some((d, q)) => (d, Some(q)),
            None => (path, None),
        };
        let (host, port) = authority.rsplit_once(':').ok_or_else(|| bad("no :PORT"))?;
        if !is_host(host) {
            return Err(bad("no host, or a host that is not a name or an address"));
        }
        let port: u16 = match port.parse() {
            Ok(p) if p > 0 && port.bytes().all(|b| b.is_ascii_digit()) => p,
            _ => return Err(bad("the port is not a number 1 to 65535")),
        };
        if !is_name(db, b"") || db.starts_with(|c: char| c.is_ascii_digit()) {
            return Err(bad(
                "the database name is not [A-Za-z_][A-Za-z0-9_]* (at most 64)",
            ));
        }
        let vm = match query {
            None => None,
            Some(q) => match q.strip_prefix("vm=") {
                Some(v) if is_name(v, b".:-") => Some(v.to_string()),
                _ => return Err(bad("the only option is vm=NAME, NAME [A-Za-z0-9_.:-]+")),
            },
        };
        Ok(Self {
            host: host.to_string(),
            port,
            database: db.to_string(),
            vm,
        })
    }

    /// `HOST:PORT` (for messages).
    pub fn addr(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn good_urls() {
        let u = ClickHouseUrl::parse("clickhouse://127.0.0.1:8123/db_1").unwrap();
        assert_eq!(
            (u.host.as_str(), u.port, u.database.as_str()),
            ("127.0.0.1", 8123, "db_1")
        );
        assert_eq!(u.vm, None);
        let u = ClickHouseUrl::parse("clickhouse://ch.example:1/x?vm=web-1.a").unwrap();
        assert_eq!(u.vm.as_deref(), Some("web-1.a"));
        assert_eq!(
            ClickHouseUrl::parse("clickhouse://[::1]:9/x").unwrap().host,
            "[::1]"
        );
    }

    #[test]
    fn bad_urls() {
        for u in [
            "clickhouse://",
            "clickhouse:///db",
            "clickhouse://:8123/db",
            "clickhouse://h/db",
            "clickhouse://h:0/db",
            "clickhouse://h:65536/db",
            "clickhouse://h:x/db",
            "clickhouse://h:1/",
            "clickhouse://h:1",
            "clickhouse://h:1/a-b",
            "clickhouse://h:1/a;DROP",
            "clickhouse://h:1/db?vm=",
            "clickhouse://h:1/db?vm=a'b",
            "clickhouse://h:1/db?x=1",
            "clickhouse://h h:1/db",
            "clickhouse://a]b:1/db",
            "clickhouse://::1:1/db",
            "clickhouse://[zz]:1/db",
            "clickhouse://[::1:1/db",
            "clickhouse://h.:1/db",
            "clickhouse://.h:1/db",
            "clickhouse://a..b:1/db",
            "clickhouse://-h:1/db",
            "clickhouse://h:+1/db",
            "clickhouse://h:1/1db",
        ] {
            assert!(ClickHouseUrl::parse(u).is_err(), "{u} accepted");
        }
        let e = ClickHouseUrl::parse("clickhouse://h:1/a\nb")
            .unwrap_err()
            .to_string();
        assert!(!e.contains('\n'), "{e}");
    }
}
