use super::*;
use crate::control::protocol::{LiveStats, PieceBatch, VERSION};

/// Answers `stats` with an empty table, `subscribe` for the first client, `fetch`
/// for the subscriber with 3 bytes after the line; records `gone`.
#[derive(Default)]
struct Fake {
    holder: Option<u64>,
    gone: Vec<u64>,
    executed: Vec<Command>,
}
impl Handler for Fake {
    fn handle(&mut self, conn: u64, cmd: &Command) -> Result<Answer, Refusal> {
        self.executed.push(cmd.clone());
        match cmd {
            Command::Stats => Ok(Answer::Stats(LiveStats {
                elapsed_s: 0.0,
                stopping: None,
                subscribed: false,
                cpus: Vec::new(),
            })),
            Command::Subscribe { .. } if self.holder.is_none() => {
                self.holder = Some(conn);
                Ok(Answer::Detached)
            }
            Command::Subscribe { .. } => Err("busy: another subscriber".into()),
            Command::Fetch { .. } if self.holder == Some(conn) => Ok(Answer::Pieces(PieceBatch {
                items: Vec::new(),
                knots: Vec::new(),
                knots_from: 0,
                bytes: 3,
                data: vec![bytes::Bytes::from_static(&[7, 8, 9])],
            })),
            _ => Err("no".into()),
        }
    }
    fn gone(&mut self, conn: u64) {
        self.gone.push(conn);
        if self.holder == Some(conn) {
            self.holder = None;
        }
    }
}

fn temp_sock(tag: &str) -> (PathBuf, PathBuf) {
    let dir = std::env::temp_dir().join(format!("hyptrace-ctl-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    let sock = dir.join("s");
    (dir, sock)
}

/// The run loop answers through `serve`; the socket is 0600 and removed on drop; a
/// client past MAX_CLIENTS is told `busy` while the others stay served.
#[test]
fn server_serves_and_bounds_clients() {
    let (dir, sock) = temp_sock("serve");
    let server = ControlServer::bind(&sock).expect("bind");
    let mode = std::fs::metadata(&sock).expect("meta").permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    let idle: Vec<UnixStream> = (0..MAX_CLIENTS)
        .map(|_| UnixStream::connect(&sock).expect("connect"))
        .collect();
    let mut extra = UnixStream::connect(&sock).expect("connect");
    extra
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let mut busy = String::new();
    let _ = extra.read_to_string(&mut busy);
    let r: Reply = serde_json::from_str(busy.trim_end()).expect("a reply");
    assert!(
        matches!(&r.outcome, Outcome::Err(e) if e.starts_with("busy")),
        "{busy:?}"
    );
    drop(idle);
    let mut h = Fake::default();
    std::thread::scope(|s| {
        let client = s.spawn(|| {
            // The idle clients' threads leave within a tick: retry while busy.
            let start = Instant::now();
            loop {
                match ctl(&sock, &["stats".to_string()]) {
                    Err(CtlError::Reply { .. }) | Ok(CtlOutcome::Err(_)) => {
                        assert!(start.elapsed() < Duration::from_secs(30), "busy");
                        std::thread::sleep(TICK);
                    }
                    r => return r.expect("ctl"),
                }
            }
        });
        let start = Instant::now();
        while !client.is_finished() {
            assert!(start.elapsed() < Duration::from_secs(60), "no reply");
            server.serve(&mut h);
            std::thread::sleep(Duration::from_millis(5));
        }
        match client.join().expect("client") {
            CtlOutcome::Ok(Answer::Stats(s)) => assert!(s.cpus.is_empty()),
            r => panic!("{r:?}"),
        }
    });
    drop(server);
    assert!(!sock.exists(), "removed on drop");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Sends `cmd` on `c` while the "run loop" (this thread) serves with `h` (bounded).
fn ask(server: &ControlServer, h: &mut dyn Handler, c: &mut CtlConn, cmd: Command) -> Outcome {
    std::thread::scope(|s| {
        let t = s.spawn(|| c.request(cmd).expect("reply"));
        let start = Instant::now();
        while !t.is_finished() {
            server.serve(h);
            std::thread::sleep(Duration::from_millis(2));
            assert!(start.elapsed() < Duration::from_secs(30), "no reply");
        }
        t.join().expect("client")
    })
}

/// C2: the claim is the handler's; a client's disconnect reaches it after its last
/// request, so a second client's `subscribe` queued after it succeeds. A `fetch`
/// answer's bytes follow its line and reach the client whole.
#[test]
fn gone_comes_after_the_clients_requests() {
    let (dir, sock) = temp_sock("gone");
    let server = ControlServer::bind(&sock).expect("bind");
    let h = &mut Fake::default();
    let t = Duration::from_secs(30);
    let mut a = CtlConn::connect(&sock, t).expect("a");
    let mut b = CtlConn::connect(&sock, t).expect("b");
    let fetch = Command::Fetch {
        token: 0,
        acks: Vec::new(),
        max_bytes: 1,
        knots: 0,
    };
    let sub = Command::Subscribe { partial: false };
    assert!(matches!(
        ask(&server, h, &mut b, fetch.clone()),
        Outcome::Err(_)
    ));
    assert_eq!(
        ask(&server, h, &mut a, sub.clone()),
        Outcome::Ok(Answer::Detached)
    );
    assert!(matches!(
        ask(&server, h, &mut b, sub.clone()),
        Outcome::Err(_)
    ));
    for _ in 0..2 {
        match ask(&server, h, &mut a, fetch.clone()) {
            Outcome::Ok(Answer::Pieces(p)) => assert_eq!(*p.payload(), [7, 8, 9]),
            o => panic!("{o:?}"),
        }
    }
    drop(a);
    let start = Instant::now();
    while h.gone.is_empty() {
        server.serve(h);
        std::thread::sleep(TICK);
        assert!(start.elapsed() < Duration::from_secs(30), "gone never came");
    }
    assert_eq!(ask(&server, h, &mut b, sub), Outcome::Ok(Answer::Detached));
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Sends `bytes` on a new connection and returns the reply line (the server thread
/// answers malformed and oversized lines itself; `stats` needs `serve`).
fn raw_reply(server: &ControlServer, sock: &Path, bytes: &[u8]) -> String {
    let mut c = UnixStream::connect(sock).expect("connect");
    c.set_read_timeout(Some(Duration::from_millis(20)))
        .expect("timeout");
    c.write_all(bytes).expect("send");
    let mut h = Fake::default();
    let mut got = Vec::new();
    let start = Instant::now();
    while !got.contains(&b'\n') {
        assert!(start.elapsed() < Duration::from_secs(30), "no reply");
        server.serve(&mut h);
        let mut b = [0u8; 4096];
        match c.read(&mut b) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&b[..n]),
            Err(_) => {}
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// A request line is at most MAX_LINE bytes with its newline: one byte more is
/// refused (and the connection closed), exactly at the bound it is served.
#[test]
fn the_line_bound_is_exact() {
    let (dir, sock) = temp_sock("line");
    let server = ControlServer::bind(&sock).expect("bind");
    let line = |len: usize| {
        let head = format!(r#"{{"v":{VERSION},"id":1,"cmd":"stats""#);
        let mut l = head.into_bytes();
        l.extend(std::iter::repeat_n(b' ', len - l.len() - 2));
        l.extend_from_slice(b"}\n");
        assert_eq!(l.len(), len);
        l
    };
    let ok = raw_reply(&server, &sock, &line(MAX_LINE));
    assert!(ok.contains(r#""kind":"stats""#), "{ok}");
    for len in [MAX_LINE + 1, MAX_LINE + 1000] {
        let r = raw_reply(&server, &sock, &line(len));
        assert!(r.contains("line too long"), "{len}: {r}");
    }
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Eight clients trickling a byte at a time hold no slot past LINE_DEADLINE: a
/// ninth client is served once their lines run out of time (bounded wait), and each
/// of them was told why it was disconnected.
#[test]
fn trickling_clients_do_not_keep_others_out() {
    let (dir, sock) = temp_sock("trickle");
    let server = ControlServer::bind(&sock).expect("bind");
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        let tricklers: Vec<_> = (0..MAX_CLIENTS)
            .map(|_| {
                let mut c = UnixStream::connect(&sock).expect("connect");
                let stop = &stop;
                s.spawn(move || {
                    c.set_read_timeout(Some(TICK)).expect("timeout");
                    let mut got = String::new();
                    // Bounded: the server disconnects it, or the test stops it.
                    for _ in 0..2000 {
                        if stop.load(Ordering::Relaxed) || c.write_all(b" ").is_err() {
                            break;
                        }
                        let mut b = [0u8; 512];
                        match c.read(&mut b) {
                            Ok(0) => break,
                            Ok(n) => got.push_str(&String::from_utf8_lossy(&b[..n])),
                            Err(_) => {}
                        }
                    }
                    got
                })
            })
            .collect();
        let start = Instant::now();
        let mut h = Fake::default();
        let served = loop {
            server.serve(&mut h);
            let mut c = CtlConn::connect(&sock, Duration::from_secs(30)).expect("connect");
            match c.request(Command::Stats) {
                Ok(_) => break true,
                Err(CtlError::Reply {
                    source: crate::control::protocol::ReplyError::Refused(why),
                    ..
                }) => assert!(why.starts_with("busy"), "{why}"),
                Err(e) => panic!("{e}"),
            }
            if start.elapsed() > 6 * LINE_DEADLINE {
                break false;
            }
            std::thread::sleep(TICK);
        };
        stop.store(true, Ordering::Relaxed);
        assert!(served, "the trickling clients kept the ninth out");
        for t in tricklers {
            let got = t.join().expect("trickler");
            assert!(got.contains("timeout: the request line"), "{got:?}");
        }
    });
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

/// C2: a request its client gave up on is never executed late.
#[test]
fn a_cancelled_request_is_not_executed() {
    let (rtx, _rrx) = mpsc::sync_channel(1);
    let jobs = Arc::new(Mutex::new(VecDeque::new()));
    let state = Arc::new(AtomicU8::new(CANCELLED));
    jobs.lock().expect("queue").push_back(Job::Run(Request {
        id: 1,
        cmd: Command::Stats,
        conn: 1,
        state,
        reply: rtx,
    }));
    let server = ControlServer {
        path: PathBuf::from("/nonexistent/hyptrace-test"),
        id: (0, 0),
        stop: Arc::new(AtomicBool::new(true)),
        jobs,
        waker: Arc::new(Mutex::new(None)),
        thread: None,
    };
    let mut h = Fake::default();
    assert_eq!(server.serve(&mut h), 1);
    assert!(h.executed.is_empty(), "{:?}", h.executed);
}

/// A stale socket is replaced, a regular file or a live socket refused.
#[test]
fn bind_checks_the_path() {
    let (dir, sock) = temp_sock("bind");
    drop(UnixListener::bind(&sock).expect("bind"));
    let server = ControlServer::bind(&sock).expect("stale replaced");
    let e = ControlServer::bind(&sock).expect_err("live");
    assert!(matches!(e, ControlError::InUse(_)), "{e}");
    drop(server);
    std::fs::write(&sock, b"x").expect("write");
    let e = ControlServer::bind(&sock).expect_err("file");
    assert!(matches!(e, ControlError::NotSocket(_)), "{e}");
    assert_eq!(std::fs::read(&sock).expect("kept"), b"x");
    let _ = std::fs::remove_dir_all(&dir);
}
