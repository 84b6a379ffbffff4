//! Fuzz target `trace_mem`: `hyptrace dump --trace-mem`'s reading of a trace memory
//! file (`hyptrace_reader::trace_file::parse` and `postmortem::walk_cpu`) on hostile
//! files: patched headers, positions, packs, control blocks, footers, commits and
//! data, and truncation anywhere.
//!
//! The fuzzer would hardly ever produce a file that passes the magics and exact
//! sizes, so the file is built valid first — a region initialised by
//! `RingGeometry::init_region`, written by the real `Writer`, behind a header as the
//! VMM writes it — and the input then patches and cuts it:
//!
//! ```text
//! byte 0     config: bit 0 cpus-1 (1..2), bits 1-2 pages-3 (3..6), bit 3 overwrite,
//!            bit 4 record a reader position (of nothing consumed), bits 5-7 cut the
//!            file at (k/8) of its length (0: no cut)
//! byte 1-2   events per CPU (u16, at most 4000), payloads of 0..=40 bytes
//! byte 3..   patches, each an opcode byte and operands (missing operands read 0):
//!            0 xor a byte anywhere (u32 offset, u8), 1 a footer word (page u8,
//!            field u8, u64), 2 a control-block word (cpu u8, field u8, u64),
//!            3 a header word (field u8, u64), 4 a page's commit (page u8, u64)
//! ```
//!
//! Checked, besides "never panics, never loops unboundedly": every page handed out is
//! a whole page whose commit fits the data area and decodes; at most the CPU's page
//! count of pages; and **while nothing was patched or cut**, no warning and
//! `events + lost + trailing_lost == entries + dropped` for every CPU (R1).
#![no_main]

use hyptrace_abi::layout::{Mode, RingGeometry, CTL_SIZE};
use hyptrace_abi::page::{self, COMMIT_OFFSET, PAGE_HEADER_SIZE};
use hyptrace_abi::{HeapMem, SharedMem};
use hyptrace_reader::postmortem::walk_cpu;
use hyptrace_reader::trace_file::{self, hdr};
use hyptrace_writer::Writer;
use libfuzzer_sys::fuzz_target;
use std::sync::atomic::Ordering::Relaxed;

const PAGE_SIZE: usize = 4096;
const MAX_OPS: usize = 64;

struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }
    fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | (u64::from(self.u32()) << 32)
    }
}

fn put(b: &mut [u8], off: usize, v: u64) {
    if let Some(w) = b.get_mut(off..off + 8) {
        w.copy_from_slice(&v.to_le_bytes());
    }
}

fuzz_target!(|data: &[u8]| {
    let mut inp = Input(data);
    let cfg = inp.u8();
    let cpus = 1 + u32::from(cfg & 1);
    let pages = 3 + u32::from((cfg >> 1) & 3);
    let mode = if cfg & 8 != 0 {
        Mode::Overwrite
    } else {
        Mode::Stop
    };
    let Ok(l) = RingGeometry::new(cpus, pages, PAGE_SIZE, mode, false) else {
        return;
    };
    let mem = HeapMem::new(l.region_size);
    l.init_region(&mem, 2_000_000, 7);
    let events = u64::from(inp.u16()) % 4001;
    for cpu in 0..cpus {
        let Ok(mut w) = Writer::attach(&mem, cpu) else {
            return;
        };
        let mut payload = [0u8; 40];
        for i in 0..events {
            let len = (i % 41) as usize;
            payload[..8.min(len)].copy_from_slice(&i.to_le_bytes()[..8.min(len)]);
            let _ = w.write(0, 1000 + i * 3, &payload[..len]);
        }
    }
    // The file: header, positions, region.
    let hlen = trace_file::header_size(cpus);
    let mut file = vec![0u8; hlen + trace_file::mapped_len(l.region_size)];
    put(&mut file, hdr::MAGIC, trace_file::MAGIC);
    put(
        &mut file,
        hdr::VERSION_HEADER_SIZE,
        u64::from(trace_file::VERSION) | ((hlen as u64) << 32),
    );
    put(
        &mut file,
        hdr::PAGE_SIZE_NR_CPUS,
        PAGE_SIZE as u64 | (u64::from(cpus) << 32),
    );
    put(&mut file, hdr::REGION_SIZE, l.region_size as u64);
    put(&mut file, hdr::TSC_KHZ, 2_000_000);
    put(&mut file, hdr::STATE, trace_file::STATE_RUNNING);
    put(&mut file, hdr::POS_OFF, trace_file::HEADER_FIXED as u64);
    put(&mut file, hdr::POS_STRIDE, trace_file::POS_STRIDE as u64);
    if cfg & 16 != 0 {
        for cpu in 0..cpus {
            let p = trace_file::HEADER_FIXED + cpu as usize * trace_file::POS_STRIDE;
            let reader = mem.load(l.ctl(cpu) + hyptrace_abi::layout::ctl::READER_PAGE, Relaxed);
            put(&mut file, p, 2);
            put(&mut file, p + 8, reader);
        }
    }
    mem.read_bytes(0, &mut file[hlen..hlen + l.region_size]);
    let written: Vec<u64> = (0..cpus)
        .map(|c| {
            let ctl = l.ctl(c);
            mem.load(ctl + hyptrace_abi::layout::ctl::ENTRIES, Relaxed)
                + mem.load(ctl + hyptrace_abi::layout::ctl::DROPPED, Relaxed)
        })
        .collect();

    let mut patched = false;
    for _ in 0..MAX_OPS {
        if inp.0.is_empty() {
            break;
        }
        patched = true;
        match inp.u8() % 5 {
            0 => {
                let off = inp.u32() as usize % file.len();
                file[off] ^= inp.u8();
            }
            1 => {
                let page = u32::from(inp.u8()) % (cpus * pages);
                let field = (usize::from(inp.u8()) % 12) * 8;
                let v = inp.u64();
                put(&mut file, hlen + l.footer_off(page) + field, v);
            }
            2 => {
                let cpu = u32::from(inp.u8()) % cpus;
                let field = (usize::from(inp.u8()) % (CTL_SIZE / 8)) * 8;
                let v = inp.u64();
                put(&mut file, hlen + l.ctl(cpu) + field, v);
            }
            3 => {
                let field = (usize::from(inp.u8()) % (hlen / 8)) * 8;
                let v = inp.u64();
                put(&mut file, field, v);
            }
            _ => {
                let page = u32::from(inp.u8()) % (cpus * pages);
                let v = inp.u64();
                put(&mut file, hlen + l.page_off(page) + COMMIT_OFFSET, v);
            }
        }
    }
    let cut = usize::from(cfg >> 5);
    if cut != 0 {
        patched = true;
        file.truncate(file.len() * cut / 8);
    }

    let Ok(img) = trace_file::parse(&file) else {
        assert!(patched, "a valid file did not parse");
        return;
    };
    assert!(patched || img.warnings.is_empty(), "{:?}", img.warnings);
    let gl = img.layout;
    for cpu in 0..gl.nr_cpus {
        let pos = img.positions.get(cpu as usize).copied().flatten();
        let mut handed = 0u64;
        let d = walk_cpu(&img.region, &gl, cpu, pos, |p| {
            handed += 1;
            assert_eq!(p.bytes.len(), gl.page_size);
            let (_, commit) = page::page_header(p.bytes).expect("header");
            let len = commit as usize;
            assert!(len <= gl.data_capacity(), "commit {len}");
            let data = &p.bytes[PAGE_HEADER_SIZE..PAGE_HEADER_SIZE + len];
            let n = page::Events::new(data, 0)
                .map(|e| e.expect("a handed-out page decodes"))
                .count() as u64;
            assert_eq!(n, p.events);
            assert!(n > 0);
            Ok::<(), ()>(())
        })
        .expect("no sink error");
        assert!(handed <= u64::from(gl.pages_per_cpu));
        assert_eq!(handed, d.pages);
        if !patched {
            assert!(d.warnings.is_empty(), "cpu {cpu}: {:?}", d.warnings);
            let total = d.events + d.lost + d.trailing_lost;
            assert_eq!(total, written[cpu as usize], "cpu {cpu}: {d:?}");
        }
    }
});
