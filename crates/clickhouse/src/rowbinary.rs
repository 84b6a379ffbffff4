//! ClickHouse's RowBinary format, as far as the tables here need it: little-endian
//! integers, strings as a LEB128 length then the bytes (any bytes: a quote, a newline, a
//! NUL or invalid UTF-8 is data, never syntax), arrays as a LEB128 count then the items.

/// Appends an unsigned LEB128 (a length or a count).
pub fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    // At most 10 bytes: 7 bits each.
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return;
        }
        out.push(b | 0x80);
    }
}

/// Appends a `String` (any bytes).
pub fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

/// Appends a `UInt8`.
pub fn put_u8(out: &mut Vec<u8>, v: u8) {
    out.push(v);
}

/// Appends a `UInt16`.
pub fn put_u16(out: &mut Vec<u8>, v: u16) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Appends a `UInt32`.
pub fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Appends an `Int32`.
pub fn put_i32(out: &mut Vec<u8>, v: i32) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Appends a `UInt64`.
pub fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Appends an `Int64`.
pub fn put_i64(out: &mut Vec<u8>, v: i64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Appends an `Array(String)`.
pub fn put_bytes_array<'a>(out: &mut Vec<u8>, items: impl ExactSizeIterator<Item = &'a [u8]>) {
    put_varint(out, items.len() as u64);
    for b in items {
        put_bytes(out, b);
    }
}

/// Appends an `Array(Int64)`.
pub fn put_i64_array(out: &mut Vec<u8>, items: impl ExactSizeIterator<Item = i64>) {
    put_varint(out, items.len() as u64);
    for v in items {
        put_i64(out, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints() {
        let enc = |v| {
            let mut o = Vec::new();
            put_varint(&mut o, v);
            o
        };
        assert_eq!(enc(0), [0]);
        assert_eq!(enc(127), [0x7f]);
        assert_eq!(enc(128), [0x80, 0x01]);
        assert_eq!(enc(300), [0xac, 0x02]);
        assert_eq!(enc(u64::MAX).len(), 10);
        assert_eq!(*enc(u64::MAX).last().unwrap(), 0x01);
    }

    /// Hostile strings are length-prefixed bytes, exactly as given: nothing is quoted,
    /// escaped or cut.
    #[test]
    fn hostile_strings_are_data() {
        for s in [
            &b"it's \"quoted\"\\"[..],
            b"line\nbreak\r\ttab",
            b"nul\0inside\0",
            b"\xff\xfe invalid \xc3(",
            b"'); DROP TABLE events; --",
            b"",
        ] {
            let mut o = Vec::new();
            put_bytes(&mut o, s);
            assert_eq!(o[0] as usize, s.len());
            assert_eq!(&o[1..], s);
        }
        let long = vec![b'\''; 200];
        let mut o = Vec::new();
        put_bytes(&mut o, &long);
        assert_eq!(&o[..2], [0xc8, 0x01]);
        assert_eq!(&o[2..], &long[..]);
    }

    #[test]
    fn arrays_and_integers() {
        let mut o = Vec::new();
        put_bytes_array(&mut o, [&b"a"[..], b"\n"].into_iter());
        put_i64_array(&mut o, [-1i64, 2].into_iter());
        put_u16(&mut o, 0x0102);
        put_i32(&mut o, -2);
        let mut want = vec![2, 1, b'a', 1, b'\n', 2];
        want.extend_from_slice(&(-1i64).to_le_bytes());
        want.extend_from_slice(&2i64.to_le_bytes());
        want.extend_from_slice(&[2, 1, 0xfe, 0xff, 0xff, 0xff]);
        assert_eq!(o, want);
    }
}
