//! A real ClickHouse server for the tests (Debian's `clickhouse-server`, 18.16): its
//! config, data, logs in a temporary directory, HTTP on a free loopback port, no TCP
//! port of its own in use elsewhere; killed when dropped. Queries go over a minimal
//! HTTP/1.0 client (the support library pulls in no HTTP crate).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::env::TempDir;

/// How long a server may take to answer `/ping` after it starts.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// Whether `clickhouse-server` is on the PATH. Prints `SKIP: clickhouse-server not
/// installed` when not; with `HYPTRACE_REQUIRE_CLICKHOUSE=1` a missing server fails the
/// test instead.
pub fn clickhouse_available() -> bool {
    let ok = std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join("clickhouse-server").is_file()));
    if !ok {
        if std::env::var("HYPTRACE_REQUIRE_CLICKHOUSE").is_ok_and(|v| v == "1") {
            panic!("clickhouse-server not installed and HYPTRACE_REQUIRE_CLICKHOUSE=1");
        }
        println!("SKIP: clickhouse-server not installed");
    }
    ok
}

/// A free loopback port (bound then released: the server binds it next).
fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    l.local_addr().expect("local addr").port()
}

/// A running server (see the module).
pub struct ClickHouse {
    dir: TempDir,
    child: Option<Child>,
    /// The HTTP port.
    pub port: u16,
}

fn config(dir: &std::path::Path, http: u16, tcp: u16) -> String {
    let d = dir.display();
    format!(
        r#"<?xml version="1.0"?>
<yandex>
  <logger><level>warning</level><log>{d}/server.log</log><errorlog>{d}/server.err.log</errorlog><size>10M</size><count>1</count></logger>
  <http_port>{http}</http_port>
  <tcp_port>{tcp}</tcp_port>
  <listen_host>127.0.0.1</listen_host>
  <path>{d}/data/</path>
  <tmp_path>{d}/tmp/</tmp_path>
  <user_files_path>{d}/user_files/</user_files_path>
  <format_schema_path>{d}/format_schemas/</format_schema_path>
  <users_config>{d}/users.xml</users_config>
  <default_profile>default</default_profile>
  <default_database>default</default_database>
  <mark_cache_size>268435456</mark_cache_size>
</yandex>
"#
    )
}

const USERS: &str = r#"<?xml version="1.0"?>
<yandex>
  <profiles><default></default></profiles>
  <users><default><password></password><networks><ip>127.0.0.1</ip></networks><profile>default</profile><quota>default</quota></default></users>
  <quotas><default></default></quotas>
</yandex>
"#;

impl ClickHouse {
    /// Starts a server on free ports (runs as root too: 18.16 does).
    pub fn start() -> Self {
        let dir = TempDir::new("clickhouse");
        let port = free_port();
        let cfg = config(dir.path(), port, free_port());
        std::fs::write(dir.path().join("config.xml"), cfg).expect("write config.xml");
        std::fs::write(dir.path().join("users.xml"), USERS).expect("write users.xml");
        let mut s = Self {
            dir,
            child: None,
            port,
        };
        s.restart();
        s
    }

    /// (Re)starts the server on its data directory and port; returns once `/ping`
    /// answers `Ok.`.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "the server is running");
        let cfg = self.dir.path().join("config.xml");
        let child = Command::new("clickhouse-server")
            .arg(format!("--config-file={}", cfg.display()))
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start clickhouse-server");
        self.child = Some(child);
        let t = Instant::now();
        while self.get("/ping").as_deref() != Some("Ok.\n") {
            let exited = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            assert!(
                exited.is_none(),
                "clickhouse-server exited: {exited:?}: {}",
                self.log()
            );
            assert!(
                t.elapsed() < START_TIMEOUT,
                "clickhouse-server did not answer /ping: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the server (SIGKILL: as a crash, not a pause) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The server's error log (for messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.err.log")).unwrap_or_default()
    }

    /// The `clickhouse://` URL of database `db`.
    pub fn url(&self, db: &str) -> String {
        format!("clickhouse://127.0.0.1:{}/{db}", self.port)
    }

    /// One HTTP/1.0 request; `(status, body)`, `None` if there is no answer.
    fn request(&self, head: &str, body: &[u8]) -> Option<(u16, String)> {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(60))).ok()?;
        s.write_all(head.as_bytes()).ok()?;
        s.write_all(body).ok()?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).ok()?;
        let text = String::from_utf8_lossy(&out).into_owned();
        let (h, b) = text.split_once("\r\n\r\n")?;
        let status = h.split(' ').nth(1)?.parse().ok()?;
        Some((status, b.to_string()))
    }

    fn get(&self, path: &str) -> Option<String> {
        match self.request(&format!("GET {path} HTTP/1.0\r\n\r\n"), b"")? {
            (200, b) => Some(b),
            _ => None,
        }
    }

    /// Runs `sql`: `(status, answer)` (TabSeparated), `None` without an answer.
    pub fn try_query(&self, sql: &str) -> Option<(u16, String)> {
        let head = format!("POST / HTTP/1.0\r\nContent-Length: {}\r\n\r\n", sql.len());
        self.request(&head, sql.as_bytes())
    }

    /// Runs `sql`, returns its answer (TabSeparated); fails on an error.
    pub fn query(&self, sql: &str) -> String {
        match self.try_query(sql) {
            Some((200, b)) => b,
            r => panic!("query {sql}: {r:?}"),
        }
    }
}

impl Drop for ClickHouse {
    fn drop(&mut self) {
        self.kill();
    }
}
