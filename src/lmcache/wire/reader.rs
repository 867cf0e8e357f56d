//! The msgpack tokenizer under the decoders: `Tok` (one token; containers are headers only) and
//! `Reader`, a bounds-checked, non-recursive cursor over one frame with typed reads that report
//! schema mismatches as [`WireError::Field`] and bad msgpack as [`WireError::Malformed`].

use rmp::Marker;

use super::{field_err, Result, WireError};

/// One msgpack token. Containers are headers only: their elements follow as further tokens.
#[derive(Debug, Clone, Copy)]
pub(super) enum Tok<'a> {
    Nil,
    Bool(bool),
    UInt(u64),
    NegInt(i64),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Array(u32),
    Map(u32),
    Ext,
}

impl Tok<'_> {
    pub(super) fn kind(&self) -> &'static str {
        match self {
            Tok::Nil => "nil",
            Tok::Bool(_) => "bool",
            Tok::UInt(_) => "unsigned integer",
            Tok::NegInt(_) => "negative integer",
            Tok::Float(_) => "float",
            Tok::Str(_) => "str",
            Tok::Bin(_) => "bin",
            Tok::Array(_) => "array",
            Tok::Map(_) => "map",
            Tok::Ext => "ext",
        }
    }

    /// Number of values nested directly inside this token.
    fn children(&self) -> u64 {
        match self {
            Tok::Array(n) => u64::from(*n),
            Tok::Map(n) => 2 * u64::from(*n),
            _ => 0,
        }
    }
}

fn int_tok<'a>(v: i64) -> Tok<'a> {
    match u64::try_from(v) {
        Ok(u) => Tok::UInt(u),
        Err(_) => Tok::NegInt(v),
    }
}

/// Bounds-checked cursor over one frame. Never allocates based on untrusted lengths beyond the
/// bytes actually present, and never recurses.
pub(super) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    frame: usize,
}

impl<'a> Reader<'a> {
    pub(super) fn new(buf: &'a [u8], frame: usize) -> Self {
        Reader { buf, pos: 0, frame }
    }

    fn malformed(&self, detail: impl Into<String>) -> WireError {
        WireError::Malformed {
            frame: self.frame,
            detail: detail.into(),
        }
    }

    fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        match self.buf.get(self.pos..self.pos.saturating_add(n)) {
            Some(s) if s.len() == n => {
                self.pos += n;
                Ok(s)
            }
            _ => Err(self.malformed(format!(
                "truncated: need {n} bytes at offset {}, {} left",
                self.pos,
                self.remaining()
            ))),
        }
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.array::<1>()?[0])
    }

    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_be_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_be_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_be_bytes(self.array()?))
    }

    fn len32(&mut self) -> Result<usize> {
        // u32 always fits in usize on the 32/64-bit targets kvnode supports; saturate otherwise
        // (the following `take` then reports truncation).
        Ok(usize::try_from(self.u32()?).unwrap_or(usize::MAX))
    }

    /// Reads the next token.
    pub(super) fn next(&mut self) -> Result<Tok<'a>> {
        if self.remaining() == 0 {
            return Err(self.malformed(format!(
                "truncated: expected a value at offset {}",
                self.pos
            )));
        }
        let m = Marker::from_u8(self.u8()?);
        Ok(match m {
            Marker::FixPos(v) => Tok::UInt(u64::from(v)),
            Marker::FixNeg(v) => Tok::NegInt(i64::from(v)),
            Marker::Null => Tok::Nil,
            Marker::True => Tok::Bool(true),
            Marker::False => Tok::Bool(false),
            Marker::U8 => Tok::UInt(u64::from(self.u8()?)),
            Marker::U16 => Tok::UInt(u64::from(self.u16()?)),
            Marker::U32 => Tok::UInt(u64::from(self.u32()?)),
            Marker::U64 => Tok::UInt(self.u64()?),
            Marker::I8 => int_tok(i64::from(i8::from_be_bytes(self.array()?))),
            Marker::I16 => int_tok(i64::from(i16::from_be_bytes(self.array()?))),
            Marker::I32 => int_tok(i64::from(i32::from_be_bytes(self.array()?))),
            Marker::I64 => int_tok(i64::from_be_bytes(self.array()?)),
            Marker::F32 => Tok::Float(f64::from(f32::from_be_bytes(self.array()?))),
            Marker::F64 => Tok::Float(f64::from_be_bytes(self.array()?)),
            Marker::FixStr(n) => Tok::Str(self.take(usize::from(n))?),
            Marker::Str8 => {
                let n = usize::from(self.u8()?);
                Tok::Str(self.take(n)?)
            }
            Marker::Str16 => {
                let n = usize::from(self.u16()?);
                Tok::Str(self.take(n)?)
            }
            Marker::Str32 => {
                let n = self.len32()?;
                Tok::Str(self.take(n)?)
            }
            Marker::Bin8 => {
                let n = usize::from(self.u8()?);
                Tok::Bin(self.take(n)?)
            }
            Marker::Bin16 => {
                let n = usize::from(self.u16()?);
                Tok::Bin(self.take(n)?)
            }
            Marker::Bin32 => {
                let n = self.len32()?;
                Tok::Bin(self.take(n)?)
            }
            Marker::FixArray(n) => Tok::Array(u32::from(n)),
            Marker::Array16 => Tok::Array(u32::from(self.u16()?)),
            Marker::Array32 => Tok::Array(self.u32()?),
            Marker::FixMap(n) => Tok::Map(u32::from(n)),
            Marker::Map16 => Tok::Map(u32::from(self.u16()?)),
            Marker::Map32 => Tok::Map(self.u32()?),
            Marker::FixExt1 => self.ext(1)?,
            Marker::FixExt2 => self.ext(2)?,
            Marker::FixExt4 => self.ext(4)?,
            Marker::FixExt8 => self.ext(8)?,
            Marker::FixExt16 => self.ext(16)?,
            Marker::Ext8 => {
                let n = usize::from(self.u8()?);
                self.ext(n)?
            }
            Marker::Ext16 => {
                let n = usize::from(self.u16()?);
                self.ext(n)?
            }
            Marker::Ext32 => {
                let n = self.len32()?;
                self.ext(n)?
            }
            Marker::Reserved => {
                return Err(
                    self.malformed(format!("reserved marker 0xc1 at offset {}", self.pos - 1))
                )
            }
        })
    }

    /// Reads an ext body (type byte + `n` data bytes) after its header.
    fn ext(&mut self, n: usize) -> Result<Tok<'a>> {
        self.u8()?;
        self.take(n)?;
        Ok(Tok::Ext)
    }

    /// Skips everything nested inside `tok` (iteratively, so deep nesting cannot overflow the
    /// stack).
    fn skip_children(&mut self, tok: Tok<'a>) -> Result<()> {
        let mut pending = tok.children();
        while pending > 0 {
            pending -= 1;
            let t = self.next()?;
            pending = pending.saturating_add(t.children());
        }
        Ok(())
    }

    /// Skips one complete value.
    pub(super) fn skip_value(&mut self) -> Result<()> {
        let t = self.next()?;
        self.skip_children(t)
    }

    /// Requires that the whole frame was consumed.
    pub(super) fn finish(&self) -> Result<()> {
        match self.remaining() {
            0 => Ok(()),
            n => Err(self.malformed(format!(
                "{n} trailing bytes after the value at offset {}",
                self.pos
            ))),
        }
    }

    /// Upper bound for preallocating `n` elements: each needs at least one byte.
    pub(super) fn cap(&self, n: u32) -> usize {
        usize::try_from(n)
            .unwrap_or(usize::MAX)
            .min(self.remaining())
    }

    pub(super) fn read_u64(&mut self, field: &str) -> Result<u64> {
        let t = self.next()?;
        tok_u64(t, field)
    }

    pub(super) fn read_u32(&mut self, field: &str) -> Result<u32> {
        let t = self.next()?;
        tok_u32(t, field)
    }

    pub(super) fn read_opt_u64(&mut self, field: &str) -> Result<Option<u64>> {
        match self.next()? {
            Tok::Nil => Ok(None),
            t => tok_u64(t, field).map(Some),
        }
    }

    pub(super) fn read_opt_u32(&mut self, field: &str) -> Result<Option<u32>> {
        match self.next()? {
            Tok::Nil => Ok(None),
            t => tok_u32(t, field).map(Some),
        }
    }

    pub(super) fn read_str(&mut self, field: &str) -> Result<String> {
        match self.next()? {
            Tok::Str(raw) => std::str::from_utf8(raw)
                .map(str::to_string)
                .map_err(|_| field_err(field, "string is not valid UTF-8")),
            t => Err(type_err(field, "str", &t)),
        }
    }

    pub(super) fn read_bin(&mut self, field: &str) -> Result<Vec<u8>> {
        match self.next()? {
            Tok::Bin(raw) => Ok(raw.to_vec()),
            t => Err(type_err(field, "bin", &t)),
        }
    }

    pub(super) fn read_bool(&mut self, field: &str) -> Result<bool> {
        match self.next()? {
            Tok::Bool(b) => Ok(b),
            t => Err(type_err(field, "bool", &t)),
        }
    }

    pub(super) fn read_opt_bool(&mut self, field: &str) -> Result<Option<bool>> {
        match self.next()? {
            Tok::Nil => Ok(None),
            Tok::Bool(b) => Ok(Some(b)),
            t => Err(type_err(field, "bool or nil", &t)),
        }
    }

    pub(super) fn read_f64(&mut self, field: &str) -> Result<f64> {
        match self.next()? {
            Tok::Float(f) => Ok(f),
            // Precision loss above 2^53 is irrelevant for a timeout in seconds.
            Tok::UInt(u) => Ok(u as f64),
            Tok::NegInt(i) => Ok(i as f64),
            t => Err(type_err(field, "number", &t)),
        }
    }

    pub(super) fn read_array_len(&mut self, field: &str) -> Result<u32> {
        match self.next()? {
            Tok::Array(n) => Ok(n),
            t => Err(type_err(field, "array", &t)),
        }
    }

    pub(super) fn read_map_len(&mut self, field: &str) -> Result<u32> {
        match self.next()? {
            Tok::Map(n) => Ok(n),
            t => Err(type_err(field, "map", &t)),
        }
    }

    /// Reads a map key, which must be a string (as for msgspec structs / dataclasses).
    pub(super) fn read_key(&mut self, field: &str) -> Result<&'a [u8]> {
        match self.next()? {
            Tok::Str(raw) => Ok(raw),
            t => Err(field_err(
                field,
                format!("map key must be a str, got {}", t.kind()),
            )),
        }
    }
}

fn type_err(field: &str, expected: &str, got: &Tok<'_>) -> WireError {
    field_err(field, format!("expected {expected}, got {}", got.kind()))
}

fn tok_u64(t: Tok<'_>, field: &str) -> Result<u64> {
    match t {
        Tok::UInt(v) => Ok(v),
        Tok::NegInt(v) => Err(field_err(
            field,
            format!("negative value {v} for an unsigned field"),
        )),
        t => Err(type_err(field, "unsigned integer", &t)),
    }
}

fn tok_u32(t: Tok<'_>, field: &str) -> Result<u32> {
    let v = tok_u64(t, field)?;
    u32::try_from(v).map_err(|_| field_err(field, format!("value {v} does not fit in u32")))
}
