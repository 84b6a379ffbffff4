//! The guest payload's ELF64 image, read with goblin and checked by us: statically
//! linked x86-64 executables, loaded at their physical addresses (which must equal
//! their virtual addresses, as guest memory is identity-mapped), entry point in an
//! executable segment. Placement in guest memory is checked by `memory_map`.

use thiserror::Error;

/// Why an image is not a loadable guest.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ElfError {
    /// Shorter than an ELF header or than what the headers describe.
    #[error("not an ELF file (too short)")]
    TooShort,
    /// Wrong magic.
    #[error("not an ELF file (bad magic)")]
    BadMagic,
    /// Not ELF64.
    #[error("not a 64-bit ELF file")]
    Not64Bit,
    /// Not little-endian.
    #[error("not a little-endian ELF file")]
    NotLittleEndian,
    /// Not x86-64.
    #[error("not an x86-64 ELF file (e_machine {0})")]
    NotX86_64(u16),
    /// Not ET_EXEC (e.g. a PIE or a shared object).
    #[error("not a static executable (ELF type {0}, want EXEC)")]
    NotExecutable(u16),
    /// Dynamically linked (a PT_INTERP segment names an interpreter).
    #[error("not a static executable (it asks for an interpreter, PT_INTERP)")]
    NotStatic,
    /// Program headers malformed.
    #[error("bad program headers: {0}")]
    BadProgramHeaders(&'static str),
    /// A segment's file range is outside the file, or its sizes are inconsistent.
    #[error("segment {0} is malformed: {1}")]
    BadSegment(usize, &'static str),
    /// No PT_LOAD segment with content.
    #[error("no loadable segment")]
    NoLoadableSegment,
    /// The entry point is not inside an executable loaded segment.
    #[error("entry point {0:#x} is not in an executable loadable segment")]
    BadEntry(u64),
}

/// One PT_LOAD segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Guest-physical load address.
    pub paddr: u64,
    /// Offset of its bytes in the file.
    pub offset: u64,
    /// Bytes copied from the file.
    pub filesz: u64,
    /// Bytes in memory (the rest is zeroed).
    pub memsz: u64,
}

/// A parsed, validated guest image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GuestImage {
    /// Entry point (guest-virtual = guest-physical).
    pub entry: u64,
    /// Loadable segments (memsz > 0).
    pub segments: Vec<Segment>,
    /// Lowest address loaded.
    pub start: u64,
    /// One past the highest address loaded.
    pub end: u64,
}

use goblin::container::Endian;
use goblin::elf::header::{EI_CLASS, EI_DATA, ELFCLASS64, ELFDATA2LSB, ELFMAG, EM_X86_64, ET_EXEC};
use goblin::elf::program_header::{PF_X, PT_INTERP, PT_LOAD};
use goblin::elf64::header::{Header, SIZEOF_EHDR};
use goblin::elf64::program_header::{ProgramHeader, SIZEOF_PHDR};

/// The ELF64 header (read by goblin), after our own checks of what goblin would accept
/// but we cannot load: not ELF, 32-bit, big-endian, another machine, not `ET_EXEC`.
fn header(elf: &[u8]) -> Result<Header, ElfError> {
    if elf.len() < ELFMAG.len() {
        return Err(ElfError::TooShort);
    }
    if elf[..ELFMAG.len()] != *ELFMAG {
        return Err(ElfError::BadMagic);
    }
    if elf.len() < SIZEOF_EHDR {
        return Err(ElfError::TooShort);
    }
    if elf[EI_CLASS] != ELFCLASS64 {
        return Err(ElfError::Not64Bit);
    }
    if elf[EI_DATA] != ELFDATA2LSB {
        return Err(ElfError::NotLittleEndian);
    }
    let h = Header::parse(elf).map_err(|_| ElfError::TooShort)?;
    if h.e_machine != EM_X86_64 {
        return Err(ElfError::NotX86_64(h.e_machine));
    }
    if h.e_type != ET_EXEC {
        return Err(ElfError::NotExecutable(h.e_type));
    }
    Ok(h)
}

/// The program header table (read by goblin), checked to lie inside the file.
fn program_headers(elf: &[u8], h: &Header) -> Result<Vec<ProgramHeader>, ElfError> {
    let phnum = usize::from(h.e_phnum);
    if phnum == 0 {
        return Err(ElfError::NoLoadableSegment);
    }
    if usize::from(h.e_phentsize) != SIZEOF_PHDR {
        return Err(ElfError::BadProgramHeaders("unexpected e_phentsize"));
    }
    let phoff = usize::try_from(h.e_phoff)
        .ok()
        .filter(|o| o.checked_add(phnum * SIZEOF_PHDR).is_some())
        .ok_or(ElfError::BadProgramHeaders("table offset out of range"))?;
    if phoff + phnum * SIZEOF_PHDR > elf.len() {
        return Err(ElfError::BadProgramHeaders(
            "table past the end of the file",
        ));
    }
    ProgramHeader::parse(elf, phoff, phnum, Endian::Little)
        .map_err(|_| ElfError::BadProgramHeaders("table past the end of the file"))
}

/// A PT_LOAD segment, checked: sizes consistent, file range inside the file, address
/// range without overflow, loaded where it runs (vaddr = paddr: identity-mapped).
fn segment(i: usize, ph: &ProgramHeader, file_len: usize) -> Result<Segment, ElfError> {
    let seg = Segment {
        offset: ph.p_offset,
        paddr: ph.p_paddr,
        filesz: ph.p_filesz,
        memsz: ph.p_memsz,
    };
    if seg.filesz > seg.memsz {
        return Err(ElfError::BadSegment(i, "file size larger than memory size"));
    }
    if seg
        .offset
        .checked_add(seg.filesz)
        .is_none_or(|e| e > file_len as u64)
    {
        return Err(ElfError::BadSegment(
            i,
            "file range past the end of the file",
        ));
    }
    if seg.paddr.checked_add(seg.memsz).is_none() {
        return Err(ElfError::BadSegment(i, "address range overflows"));
    }
    if ph.p_vaddr != seg.paddr {
        return Err(ElfError::BadSegment(
            i,
            "virtual address differs from physical address",
        ));
    }
    Ok(seg)
}

impl GuestImage {
    /// Parses (with goblin) and validates `elf`: a static x86-64 ELF64 executable whose
    /// entry point is in an executable loaded segment. Placement inside guest memory is
    /// checked by the memory layout.
    pub fn parse(elf: &[u8]) -> Result<Self, ElfError> {
        let h = header(elf)?;
        let entry = h.e_entry;
        let mut segments = Vec::new();
        let mut entry_ok = false;
        for (i, ph) in program_headers(elf, &h)?.iter().enumerate() {
            if ph.p_type == PT_INTERP {
                return Err(ElfError::NotStatic);
            }
            if ph.p_type != PT_LOAD || ph.p_memsz == 0 {
                continue;
            }
            let seg = segment(i, ph, elf.len())?;
            if ph.p_flags & PF_X != 0 && entry >= seg.paddr && entry < seg.paddr + seg.memsz {
                entry_ok = true;
            }
            segments.push(seg);
        }
        if segments.is_empty() {
            return Err(ElfError::NoLoadableSegment);
        }
        if !entry_ok {
            return Err(ElfError::BadEntry(entry));
        }
        let start = segments.iter().map(|s| s.paddr).min().unwrap_or(0);
        let end = segments
            .iter()
            .map(|s| s.paddr + s.memsz)
            .max()
            .unwrap_or(0);
        Ok(Self {
            entry,
            segments,
            start,
            end,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_guest_parses() {
        let img = GuestImage::parse(crate::GUEST_ELF).expect("embedded guest parses");
        assert!(img.start >= crate::memory_map::LOW_END);
        assert!(img.entry >= img.start && img.entry < img.end);
    }

    #[test]
    fn rejects_garbage() {
        assert_eq!(GuestImage::parse(b""), Err(ElfError::TooShort));
        assert_eq!(GuestImage::parse(b"#!/bin/sh\n"), Err(ElfError::BadMagic));
        let mut e = crate::GUEST_ELF.to_vec();
        e[4] = 1;
        assert_eq!(GuestImage::parse(&e), Err(ElfError::Not64Bit));
        let mut e = crate::GUEST_ELF.to_vec();
        e[18] = 3; // EM_386
        assert_eq!(GuestImage::parse(&e), Err(ElfError::NotX86_64(3)));
        let mut e = crate::GUEST_ELF.to_vec();
        e[16] = 3; // ET_DYN
        assert_eq!(GuestImage::parse(&e), Err(ElfError::NotExecutable(3)));
        let e = &crate::GUEST_ELF[..200];
        assert!(GuestImage::parse(e).is_err());
    }

    /// Program header `i` of `e` (ELF64 little-endian), as (offset of the entry).
    fn phdr(e: &[u8], i: usize) -> usize {
        let phoff = u64::from_le_bytes(e[32..40].try_into().expect("8 bytes")) as usize;
        phoff + i * SIZEOF_PHDR
    }

    /// Our checks on what goblin reads: a truncated table, a dynamic executable, vaddr
    /// != paddr, an entry outside every executable segment, a segment past the file.
    #[test]
    fn rejects_unloadable_images() {
        let good = crate::GUEST_ELF;
        let load = (0..usize::from(u16::from_le_bytes([good[56], good[57]])))
            .find(|&i| good[phdr(good, i)..][..4] == PT_LOAD.to_le_bytes())
            .expect("a PT_LOAD");
        // The table runs past the end of the file.
        let mut e = good.to_vec();
        e[56..58].copy_from_slice(&u16::MAX.to_le_bytes());
        assert!(matches!(
            GuestImage::parse(&e),
            Err(ElfError::BadProgramHeaders(_))
        ));
        // A PT_INTERP: dynamically linked.
        let mut e = good.to_vec();
        let p = phdr(&e, load);
        e[p..p + 4].copy_from_slice(&PT_INTERP.to_le_bytes());
        assert_eq!(GuestImage::parse(&e), Err(ElfError::NotStatic));
        // vaddr != paddr.
        let mut e = good.to_vec();
        let p = phdr(&e, load);
        e[p + 16] ^= 0x10;
        assert!(matches!(
            GuestImage::parse(&e),
            Err(ElfError::BadSegment(i, m)) if i == load && m.contains("virtual")
        ));
        // File range past the end.
        let mut e = good.to_vec();
        let p = phdr(&e, load);
        e[p + 8..p + 16].copy_from_slice(&(good.len() as u64).to_le_bytes());
        assert!(matches!(
            GuestImage::parse(&e),
            Err(ElfError::BadSegment(_, _))
        ));
        // Entry point outside every executable segment.
        let mut e = good.to_vec();
        e[24..32].copy_from_slice(&1u64.to_le_bytes());
        assert_eq!(GuestImage::parse(&e), Err(ElfError::BadEntry(1)));
    }
}
