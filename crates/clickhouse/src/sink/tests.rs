//! The sink against a fake server that answers as a hostile or broken peer would.

use super::*;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

use crate::client::Timeouts;

/// What the fake server does with a request.
#[derive(Clone, Copy)]
enum Reply {
    /// Closes the connection without an answer (the outcome is unknown).
    Hang,
    /// Answers 200 with this body.
    Ok(&'static str),
    /// Answers 200 with the count query's own table, run and batch, and this count.
    Count(u64),
    /// Answers 200 with a count naming the next batch (an answer to another query).
    Foreign(u64),
    /// Answers this status with this body (a `Location` header too).
    Status(u16, &'static str),
    /// Reads the request and never answers (until the client goes).
    Silent,
    /// Answers 200 with a body of 1 GiB, written until the client goes.
    Huge,
    /// Announces 100 bytes, sends 10, closes.
    Cut,
    /// Answers 200, then a byte of its body every 50 ms (each read well within any
    /// read timeout), for 10 minutes unless the client goes.
    Trickle,
}

/// The requests a fake got: `INSERT`, or a query's SQL.
type Seen = Arc<Mutex<Vec<String>>>;

/// One request: the first line and the body.
fn request(s: &TcpStream) -> Option<(String, String)> {
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).ok()?;
    let mut len = 0usize;
    loop {
        let mut h = String::new();
        if r.read_line(&mut h).ok()? == 0 {
            return None;
        }
        if h == "\r\n" {
            break;
        }
        if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse().ok()?;
        }
    }
    let mut body = vec![0; len];
    r.read_exact(&mut body).ok()?;
    Some((line, String::from_utf8_lossy(&body).into_owned()))
}

/// The count the answer to `sql` (the sink's count query) names: its own table, run
/// and batch, or (`foreign`) the next batch.
fn count_answer(sql: &str, n: u64, foreign: bool) -> String {
    let lit: Vec<&str> = sql
        .trim_start_matches("SELECT ")
        .splitn(4, ", ")
        .map(|l| l.trim_matches('\''))
        .collect();
    let batch: u64 = lit[2].parse().expect("batch");
    let batch = batch + u64::from(foreign);
    format!("{}\t{}\t{batch}\t{n}\n", lit[0], lit[1])
}

fn answer(mut s: TcpStream, reply: Reply, sql: &str) {
    let ok = |b: &str| {
        format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{b}",
            b.len()
        )
    };
    let _ = match reply {
        Reply::Hang => Ok(()),
        Reply::Ok(b) => s.write_all(ok(b).as_bytes()),
        Reply::Count(n) => s.write_all(ok(&count_answer(sql, n, false)).as_bytes()),
        Reply::Foreign(n) => s.write_all(ok(&count_answer(sql, n, true)).as_bytes()),
        Reply::Status(c, b) => write!(
            s,
            "HTTP/1.1 {c} X\r\nLocation: http://127.0.0.1:9/\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{b}",
            b.len()
        ),
        Reply::Silent => s.read_to_end(&mut Vec::new()).map(drop),
        Reply::Huge => {
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 1073741824\r\n\r\n");
            let chunk = [b'7'; 65536];
            // Bounded: 16 384 chunks, or fewer when the client goes.
            (0..16_384).try_for_each(|_| s.write_all(&chunk))
        }
        Reply::Cut => s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789"),
        Reply::Trickle => {
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 12000\r\n\r\n");
            // Bounded: 12 000 bytes, or fewer when the client goes. (The fake's
            // pace, not a wait for a condition.)
            (0..12_000).try_for_each(|_| {
                std::thread::sleep(Duration::from_millis(50));
                s.write_all(b"7")
            })
        }
    };
}

/// A fake ClickHouse answering requests in turn from `script` (its last reply
/// repeated for ever); returns its port and the requests it got, each recorded before
/// it is answered. The server thread is left to the end of the test process.
fn fake(script: Vec<Reply>) -> (u16, Seen) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let seen = Seen::default();
    let out = Arc::clone(&seen);
    std::thread::spawn(move || {
        for i in 0.. {
            let Ok((s, _)) = l.accept() else { return };
            let Some((line, body)) = request(&s) else {
                continue;
            };
            let insert = line.contains("INSERT");
            out.lock().unwrap().push(if insert {
                "INSERT".into()
            } else {
                body.clone()
            });
            let reply = *script.get(i).or(script.last()).unwrap();
            // Each answer on its own thread: a silent one does not hold the next.
            std::thread::spawn(move || answer(s, reply, &body));
        }
    });
    (port, seen)
}

fn sink_with(port: u16, retry_for: Duration, total: Duration) -> ClickHouseSink {
    let url = crate::ClickHouseUrl::parse(&format!("clickhouse://127.0.0.1:{port}/db")).unwrap();
    let meta = TraceMeta::guest(4096, 1, hyptrace_output::Clock::nanoseconds());
    let opts = Options {
        retry_for,
        notify: |_| {},
        ..Options::default()
    };
    let t = Timeouts {
        total,
        ..Timeouts::default()
    };
    let client = Client::with_timeouts(&url, t);
    ClickHouseSink::new(client, "db", RunIdentity::new(None), meta, opts).unwrap()
}

fn sink(port: u16) -> ClickHouseSink {
    sink_with(port, Duration::from_secs(20), Duration::from_secs(20))
}

fn rows(n: u64) -> Rows {
    Rows {
        data: vec![1, 2, 3],
        n,
    }
}

fn seen(s: &Seen) -> Vec<String> {
    s.lock().unwrap().clone()
}

/// `INSERT` or `SELECT` per request.
fn kinds(s: &Seen) -> Vec<&'static str> {
    seen(s)
        .iter()
        .map(|r| if r == "INSERT" { "INSERT" } else { "SELECT" })
        .collect()
}

/// An insert without an answer that did go in: found by the count, not re-sent.
#[test]
fn an_unanswered_insert_that_went_in_is_not_resent() {
    let (port, log) = fake(vec![Reply::Hang, Reply::Count(3)]);
    let s = sink(port);
    s.store(EVENTS, &rows(3)).unwrap();
    let seen = seen(&log);
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(seen[0], "INSERT");
    let run = &s.who.run;
    assert_eq!(
        seen[1],
        format!(
            "SELECT 'events', '{run}', 0, count() FROM db.events \
             WHERE run = '{run}' AND batch = 0 FORMAT TabSeparated"
        )
    );
    assert_eq!(s.counts.lock().unwrap().retries, 1);
}

/// An insert without an answer that did not go in: re-sent once.
#[test]
fn an_unanswered_insert_that_is_missing_is_resent() {
    let (port, log) = fake(vec![Reply::Hang, Reply::Count(0), Reply::Ok("")]);
    sink(port).store(LOSSES, &rows(3)).unwrap();
    assert_eq!(kinds(&log), ["INSERT", "SELECT", "INSERT"]);
}

/// A batch found with another row count: an error, nothing re-sent.
#[test]
fn a_partial_batch_is_an_error() {
    let (port, log) = fake(vec![Reply::Hang, Reply::Count(2)]);
    let e = sink(port).store(EVENTS, &rows(3)).unwrap_err();
    assert!(
        matches!(
            e,
            ClickHouseError::Partial {
                found: 2,
                sent: 3,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(kinds(&log), ["INSERT", "SELECT"]);
}

/// A count that does not name the batch asked about (a bare number, another batch's
/// count, garbage) is no count: neither "stored" nor "missing" — asked again.
#[test]
fn a_count_for_another_query_is_not_trusted() {
    let (port, log) = fake(vec![
        Reply::Hang,
        Reply::Ok("3\n"),
        Reply::Foreign(3),
        Reply::Ok("<html>\x1b[2J garbage"),
        Reply::Foreign(0),
        Reply::Count(0),
        Reply::Ok(""),
    ]);
    let s = sink(port);
    s.store(EVENTS, &rows(3)).unwrap();
    assert_eq!(
        kinds(&log),
        ["INSERT", "SELECT", "SELECT", "SELECT", "SELECT", "SELECT", "INSERT"]
    );
    assert_eq!(s.counts.lock().unwrap().retries, 5);
}

/// An INSERT answered 200 with a body (ClickHouse's is empty), or with a redirect
/// (never followed), is not taken as stored: checked.
#[test]
fn an_insert_answered_with_garbage_or_a_redirect_is_checked() {
    let (port, log) = fake(vec![Reply::Ok("garbage"), Reply::Count(3)]);
    sink(port).store(EVENTS, &rows(3)).unwrap();
    assert_eq!(kinds(&log), ["INSERT", "SELECT"]);
    let (port, log) = fake(vec![Reply::Status(302, ""), Reply::Count(3)]);
    sink(port).store(EVENTS, &rows(3)).unwrap();
    assert_eq!(kinds(&log), ["INSERT", "SELECT"]);
}

/// A huge answer is read to 64 KiB at most (no count in it), a cut one is an error:
/// both checked again; the run goes on at once.
#[test]
fn huge_and_cut_answers_are_bounded_errors() {
    let t = Instant::now();
    let (port, log) = fake(vec![
        Reply::Huge,
        Reply::Huge,
        Reply::Cut,
        Reply::Count(0),
        Reply::Cut,
        Reply::Count(3),
    ]);
    sink(port).store(EVENTS, &rows(3)).unwrap();
    assert_eq!(
        kinds(&log),
        ["INSERT", "SELECT", "SELECT", "SELECT", "INSERT", "SELECT"]
    );
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
}

/// A server that never answers, or trickles its answer: every request ends by its
/// deadline (the whole request, not each read), the batch is checked and stored when
/// it answers again.
#[test]
fn a_silent_server_costs_one_deadline_per_request() {
    let (port, log) = fake(vec![
        Reply::Trickle,
        Reply::Silent,
        Reply::Count(0),
        Reply::Ok(""),
    ]);
    let t = Instant::now();
    let s = sink_with(port, Duration::from_secs(20), Duration::from_millis(300));
    s.store(EVENTS, &rows(3)).unwrap();
    let took = t.elapsed();
    assert_eq!(kinds(&log), ["INSERT", "SELECT", "SELECT", "INSERT"]);
    assert!(
        took >= Duration::from_millis(600) && took < Duration::from_secs(10),
        "{took:?}"
    );
}

/// A server answering 5xx for ever: the batch is given up after the retry time, with
/// the server's last message (bounded, printable).
#[test]
fn a_server_failing_for_ever_is_given_up_in_time() {
    let (port, log) = fake(vec![Reply::Status(503, "Code: 999, boom\n\x1b[2J")]);
    let t = Instant::now();
    let s = sink_with(port, Duration::from_secs(1), Duration::from_secs(5));
    let e = s.store(EVENTS, &rows(3)).unwrap_err();
    let took = t.elapsed();
    assert!(
        took >= Duration::from_secs(1) && took < Duration::from_secs(8),
        "{took:?}"
    );
    let msg = hyptrace_output::error_chain(&e);
    assert!(
        msg.contains("events batch 0 not stored after 1 s of retries")
            && msg.contains("HTTP 503: Code: 999, boom"),
        "{msg}"
    );
    assert!(!msg.contains('\n') && !msg.contains('\x1b'), "{msg}");
    assert!(kinds(&log).len() >= 3, "{:?}", seen(&log));
}

/// Cancelled (a second Ctrl-C) while a batch is retried: given up within a pause,
/// not after the retry time.
#[test]
fn a_cancelled_retry_ends_at_once() {
    let (port, log) = fake(vec![Reply::Status(500, "down")]);
    let asked = Arc::clone(&log);
    let s = sink_with(port, Duration::from_secs(60), Duration::from_secs(5))
        .cancel_on(move || asked.lock().unwrap().len() >= 3);
    let t = Instant::now();
    let e = s.store(EVENTS, &rows(3)).unwrap_err();
    let took = t.elapsed();
    assert!(matches!(e, ClickHouseError::Cancelled { .. }), "{e}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert_eq!(kinds(&log).len(), 3, "{:?}", seen(&log));
}
