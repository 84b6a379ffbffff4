//! A small ELF64 loader for the guest payload: statically linked x86-64 executables,
//! loaded at their physical addresses (which must equal their virtual addresses, as
//! guest memory is identity-mapped).

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

const PT_LOAD: u32 = 1;
const PF_X: u32 = 1;
const ET_EXEC: u16 = 2;
const EM_X86_64: u16 = 62;
const PHDR_SIZE: usize = 56;

fn u16_at(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}
fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(b[off..off + 8].try_into().expect("8 bytes"))
}

impl GuestImage {
    /// Parses and validates `elf`. Placement inside guest memory is checked by the
    /// memory layout.
    pub fn parse(elf: &[u8]) -> Result<Self, ElfError> {
        if elf.len() < 4 {
            return Err(ElfError::TooShort);
        }
        if elf[..4] != *b"\x7fELF" {
            return Err(ElfError::BadMagic);
        }
        if elf.len() < 64 {
            return Err(ElfError::TooShort);
        }
        if elf[4] != 2 {
            return Err(ElfError::Not64Bit);
        }
        if elf[5] != 1 {
            return Err(ElfError::NotLittleEndian);
        }
        let e_type = u16_at(elf, 16);
        let machine = u16_at(elf, 18);
        if machine != EM_X86_64 {
            return Err(ElfError::NotX86_64(machine));
        }
        if e_type != ET_EXEC {
            return Err(ElfError::NotExecutable(e_type));
        }
        let entry = u64_at(elf, 24);
        let phoff = u64_at(elf, 32);
        let phentsize = usize::from(u16_at(elf, 54));
        let phnum = usize::from(u16_at(elf, 56));
        if phnum == 0 {
            return Err(ElfError::NoLoadableSegment);
        }
        if phentsize != PHDR_SIZE {
            return Err(ElfError::BadProgramHeaders("unexpected e_phentsize"));
        }
        let ph_end = usize::try_from(phoff)
            .ok()
            .and_then(|o| o.checked_add(phnum * PHDR_SIZE))
            .ok_or(ElfError::BadProgramHeaders("table offset out of range"))?;
        if ph_end > elf.len() {
            return Err(ElfError::BadProgramHeaders(
                "table past the end of the file",
            ));
        }

        let mut segments = Vec::new();
        let mut entry_ok = false;
        for i in 0..phnum {
            let ph = &elf[phoff as usize + i * PHDR_SIZE..][..PHDR_SIZE];
            if u32_at(ph, 0) != PT_LOAD {
                continue;
            }
            let flags = u32_at(ph, 4);
            let seg = Segment {
                offset: u64_at(ph, 8),
                paddr: u64_at(ph, 24),
                filesz: u64_at(ph, 32),
                memsz: u64_at(ph, 40),
            };
            let vaddr = u64_at(ph, 16);
            if seg.memsz == 0 {
                continue;
            }
            if seg.filesz > seg.memsz {
                return Err(ElfError::BadSegment(i, "file size larger than memory size"));
            }
            if seg
                .offset
                .checked_add(seg.filesz)
                .is_none_or(|e| e > elf.len() as u64)
            {
                return Err(ElfError::BadSegment(
                    i,
                    "file range past the end of the file",
                ));
            }
            if seg.paddr.checked_add(seg.memsz).is_none() {
                return Err(ElfError::BadSegment(i, "address range overflows"));
            }
            if vaddr != seg.paddr {
                return Err(ElfError::BadSegment(
                    i,
                    "virtual address differs from physical address",
                ));
            }
            if flags & PF_X != 0 && entry >= seg.paddr && entry < seg.paddr + seg.memsz {
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
}
