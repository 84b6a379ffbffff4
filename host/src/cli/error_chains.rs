//! Each cause printed once (issue 38): no error's own text repeats the text of its
//! source, over representative errors of the output crate and of each layer of host/.

use std::error::Error;
use std::io;
use std::path::PathBuf;

use hyptrace_output::{DatError, DatProblem, OutputError};

use crate::bench::{BenchError, SubscriberError};
use crate::exit::chain;
use crate::flight::trace_mem::{FileProblem, TraceMemError};
use crate::pipeline::convert::ConvertError;
use crate::pipeline::plan::PlanError;
use crate::pipeline::run::RunError;

/// The first link of `e`'s chain whose text contains its source's text, as `(text,
/// source's text)`; `None` if every cause appears only in its own link.
fn repeated(e: &dyn Error) -> Option<(String, String)> {
    let mut cur = e;
    // Bounded: a cycle of sources would not end.
    for _ in 0..16 {
        let src = cur.source()?;
        let (a, b) = (cur.to_string(), src.to_string());
        if a.contains(&b) {
            return Some((a, b));
        }
        cur = src;
    }
    None
}

fn enospc() -> io::Error {
    io::Error::from_raw_os_error(libc::ENOSPC)
}

/// A chunk of a trace.dat zstd does not decompress.
fn bad_zstd() -> DatError {
    DatError::Format {
        offset: 4096,
        within: None,
        problem: DatProblem::Zstd(io::Error::other("Unknown frame descriptor")),
    }
}

/// A section whose id is not the one its option names, found inside the section.
fn bad_section() -> DatError {
    DatError::Format {
        offset: 8192,
        within: Some(24),
        problem: DatProblem::SectionId { id: 3, want: 16 },
    }
}

/// Representative errors with sources, from the output crate and host/'s layers.
fn errors() -> Vec<Box<dyn Error>> {
    let trace_mem = || TraceMemError {
        path: "/tmp/vm.trace".into(),
        why: FileProblem::Io {
            what: "cannot rename the new file into place",
            source: enospc(),
        },
    };
    let dat_io = || OutputError::Io {
        path: Some("/tmp/x.dat".into()),
        source: enospc(),
    };
    vec![
        Box::new(trace_mem()),
        Box::new(RunError::TraceMem(trace_mem())),
        Box::new(dat_io()),
        Box::new(OutputError::Compress {
            cpu: Some(3),
            source: io::Error::other("Destination buffer is too small"),
        }),
        Box::new(OutputError::ReadPart(Box::new(DatError::Io {
            path: "/tmp/b.dat".into(),
            source: enospc(),
        }))),
        Box::new(hyptrace_output::perfetto::decode_trace(b"\xff\xff").expect_err("not a trace")),
        Box::new(PlanError::ReadGuest {
            path: PathBuf::from("/nonexistent/g.elf"),
            source: io::Error::from(io::ErrorKind::NotFound),
        }),
        Box::new(BenchError::Sink(dat_io())),
        Box::new(BenchError::TempFile(enospc())),
        Box::new(BenchError::Subscriber(SubscriberError::Thread(enospc()))),
        Box::new(bad_zstd()),
        Box::new(bad_section()),
        Box::new(ConvertError::Input {
            name: "/tmp/x.dat".into(),
            source: bad_zstd().into(),
        }),
        Box::new(ConvertError::ReadInput {
            name: "/tmp/x.dat".into(),
            source: enospc(),
        }),
        Box::new(ConvertError::Unreadable {
            name: "/tmp/x.dat".into(),
            source: bad_section(),
        }),
        Box::new(OutputError::from(hyptrace_output::RawError::Io {
            path: Some("/tmp/x.raw".into()),
            source: enospc(),
        })),
        Box::new(ConvertError::Spool {
            dir: "/tmp".into(),
            source: enospc(),
        }),
    ]
}

#[test]
fn no_error_text_repeats_its_source() {
    for e in errors() {
        assert!(e.source().is_some(), "{e}: has a source to check");
        assert_eq!(repeated(e.as_ref()), None, "{e:?}");
    }
}

/// The chain prints each cause: the path once, the OS error once, in order.
#[test]
fn the_chain_names_each_cause_once() {
    let e = RunError::TraceMem(TraceMemError {
        path: "/tmp/vm.trace".into(),
        why: FileProblem::HardLinks(2),
    });
    let text = chain(&e);
    assert!(
        text.starts_with("--trace-mem /tmp/vm.trace: has 2 hard links"),
        "{text}"
    );
    assert_eq!(text.matches("/tmp/vm.trace").count(), 1, "{text}");
    let e = OutputError::Compress {
        cpu: Some(3),
        source: io::Error::other("Destination buffer is too small"),
    };
    assert_eq!(
        chain(&e),
        "zstd compression of cpu 3's data: Destination buffer is too small"
    );
}

/// A trace.dat's problem, and the cause under it, follow the input's name once each.
#[test]
fn a_malformed_input_names_the_file_then_each_cause() {
    let e = ConvertError::Input {
        name: "/tmp/x.dat".into(),
        source: bad_zstd().into(),
    };
    assert_eq!(
        chain(&e),
        "/tmp/x.dat: malformed trace.dat at offset 4096: zstd: Unknown frame descriptor"
    );
    let e = ConvertError::Unreadable {
        name: "/tmp/x.dat".into(),
        source: bad_section(),
    };
    assert_eq!(
        chain(&e),
        "/tmp/x.dat: damaged trace.dat, nothing is readable: malformed trace.dat at offset 8192 (byte 24 of the section there): section id 3, expected 16"
    );
    let e = ConvertError::ReadInput {
        name: "/tmp/x.dat".into(),
        source: enospc(),
    };
    assert_eq!(chain(&e), format!("/tmp/x.dat: {}", enospc()));
    let e = ConvertError::Input {
        name: "stdin".into(),
        source: hyptrace_output::RawError::Malformed {
            path: None,
            problem: hyptrace_output::RawProblem::Truncated,
        }
        .into(),
    };
    assert_eq!(chain(&e), "stdin: malformed raw page stream: truncated");
}

/// The check is not vacuous: an error printing its source in its own text is found.
#[test]
fn a_repeated_cause_is_found() {
    #[derive(Debug, thiserror::Error)]
    #[error("cannot write: {0}")]
    struct Loud(#[source] io::Error);
    let (text, source) = repeated(&Loud(enospc())).expect("repeats its source");
    assert_eq!(source, enospc().to_string());
    assert!(text.ends_with(&source), "{text}");
}
