//! Memory layouts of KV objects: dtype names as PyTorch spells them, shapes, byte sizes.

use crate::error::{Error, Result};

/// Largest object the node accepts (a sanity bound on shapes; 4 GiB).
pub const MAX_OBJECT_BYTES: u64 = 4 << 30;

/// Element types an engine may register, spelled as PyTorch attribute names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// `float16`
    Float16,
    /// `bfloat16`
    Bfloat16,
    /// `float32`
    Float32,
    /// `float64`
    Float64,
    /// `float8_e4m3fn`
    Float8E4m3fn,
    /// `float8_e5m2`
    Float8E5m2,
    /// `int8`
    Int8,
    /// `uint8`
    Uint8,
    /// `int16`
    Int16,
    /// `int32`
    Int32,
    /// `int64`
    Int64,
}

impl Dtype {
    /// Parses a PyTorch dtype name (with or without the `torch.` prefix; `half`/`float`/`double` aliases).
    pub fn parse(name: &str) -> Result<Dtype> {
        let n = name.strip_prefix("torch.").unwrap_or(name);
        Ok(match n {
            "float16" | "half" => Dtype::Float16,
            "bfloat16" => Dtype::Bfloat16,
            "float32" | "float" => Dtype::Float32,
            "float64" | "double" => Dtype::Float64,
            "float8_e4m3fn" => Dtype::Float8E4m3fn,
            "float8_e5m2" => Dtype::Float8E5m2,
            "int8" => Dtype::Int8,
            "uint8" => Dtype::Uint8,
            "int16" | "short" => Dtype::Int16,
            "int32" | "int" => Dtype::Int32,
            "int64" | "long" => Dtype::Int64,
            _ => return Err(Error::invalid(format!("unknown dtype {name:?}"))),
        })
    }

    /// The canonical PyTorch name.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Float16 => "float16",
            Dtype::Bfloat16 => "bfloat16",
            Dtype::Float32 => "float32",
            Dtype::Float64 => "float64",
            Dtype::Float8E4m3fn => "float8_e4m3fn",
            Dtype::Float8E5m2 => "float8_e5m2",
            Dtype::Int8 => "int8",
            Dtype::Uint8 => "uint8",
            Dtype::Int16 => "int16",
            Dtype::Int32 => "int32",
            Dtype::Int64 => "int64",
        }
    }

    /// Bytes per element.
    pub fn item_bytes(self) -> u64 {
        match self {
            Dtype::Float8E4m3fn | Dtype::Float8E5m2 | Dtype::Int8 | Dtype::Uint8 => 1,
            Dtype::Float16 | Dtype::Bfloat16 | Dtype::Int16 => 2,
            Dtype::Float32 | Dtype::Int32 => 4,
            Dtype::Float64 | Dtype::Int64 => 8,
        }
    }
}

/// The layout of one KV object: a row-major tensor. Invariant: every dimension is non-zero and
/// `object_bytes() <= MAX_OBJECT_BYTES`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Layout {
    /// Tensor shape, outermost first.
    pub shape: Vec<u64>,
    /// Element type.
    pub dtype: Dtype,
    object_bytes: u64,
    fingerprint: u64,
}

impl Layout {
    /// A stable 64-bit fingerprint of shape and dtype (never 0; 0 means "unknown" in L2
    /// headers). Equal layouts have equal fingerprints across runs and machines. Computed once
    /// at construction (it is read on every commit when L2 is on).
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    fn compute_fingerprint(shape: &[u64], dtype: Dtype) -> u64 {
        let mut text = dtype.name().to_owned();
        for d in shape {
            text.push(',');
            text.push_str(&d.to_string());
        }
        let h = blake3::hash(text.as_bytes());
        let mut b = [0u8; 8];
        b.copy_from_slice(&h.as_bytes()[..8]);
        u64::from_le_bytes(b).max(1)
    }

    /// A validated layout.
    pub fn new(shape: Vec<u64>, dtype: Dtype) -> Result<Layout> {
        let mut n: u64 = dtype.item_bytes();
        for &d in &shape {
            if d == 0 {
                return Err(Error::invalid(format!(
                    "shape {shape:?} has a zero dimension"
                )));
            }
            n = n
                .checked_mul(d)
                .filter(|&b| b <= MAX_OBJECT_BYTES)
                .ok_or_else(|| {
                    Error::invalid(format!(
                        "shape {shape:?} x {} exceeds {MAX_OBJECT_BYTES} bytes",
                        dtype.name()
                    ))
                })?;
        }
        Ok(Layout {
            fingerprint: Self::compute_fingerprint(&shape, dtype),
            shape,
            dtype,
            object_bytes: n,
        })
    }

    /// LMCache's engine-driven layout: `[2, layers, slots, hidden]`, or `[layers, slots, hidden]`
    /// when `use_mla` (one KV plane); `slots` is the chunk's token count, or fewer physical
    /// slots under decode-context parallelism (LMCache 0.5.6 `num_physical_slots`).
    pub fn engine_driven(
        num_layers: u32,
        slots_per_chunk: u32,
        hidden_dim: u32,
        dtype: Dtype,
        use_mla: bool,
    ) -> Result<Layout> {
        let mut shape = Vec::with_capacity(4);
        if !use_mla {
            shape.push(2);
        }
        shape.extend([
            u64::from(num_layers),
            u64::from(slots_per_chunk),
            u64::from(hidden_dim),
        ]);
        Layout::new(shape, dtype)
    }

    /// Logical byte size of one object (`product(shape) * item_bytes`).
    pub fn object_bytes(&self) -> u64 {
        self.object_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_are_stable_and_tell_layouts_apart() {
        let a = Layout::new(vec![2, 2, 16, 256], Dtype::Float32).unwrap();
        let same = Layout::new(vec![2, 2, 16, 256], Dtype::Float32).unwrap();
        let other_dtype = Layout::new(vec![2, 2, 16, 512], Dtype::Bfloat16).unwrap();
        let other_shape = Layout::new(vec![2, 4, 16, 128], Dtype::Float32).unwrap();
        assert_eq!(a.object_bytes(), other_dtype.object_bytes());
        assert_eq!(a.fingerprint(), same.fingerprint());
        assert_ne!(a.fingerprint(), other_dtype.fingerprint());
        assert_ne!(a.fingerprint(), other_shape.fingerprint());
        assert_ne!(a.fingerprint(), 0, "0 means unknown in L2 headers");
        // Written into L2 headers: must not change between versions.
        assert_eq!(a.fingerprint(), 0xd14b_7f85_7d9a_2399);
    }

    #[test]
    fn dtype_names() {
        assert_eq!(Dtype::parse("bfloat16").unwrap().item_bytes(), 2);
        assert_eq!(Dtype::parse("torch.float32").unwrap(), Dtype::Float32);
        assert_eq!(Dtype::parse("float8_e4m3fn").unwrap().item_bytes(), 1);
        let e = Dtype::parse("float13").unwrap_err();
        assert_eq!(e.kind, crate::error::ErrorKind::InvalidRequest);
    }

    #[test]
    fn engine_driven_shapes() {
        let l = Layout::engine_driven(2, 16, 16, Dtype::Float32, false).unwrap();
        assert_eq!(l.shape, vec![2, 2, 16, 16]);
        assert_eq!(l.object_bytes(), 2 * 2 * 16 * 16 * 4);
        let m = Layout::engine_driven(32, 256, 1024, Dtype::Bfloat16, true).unwrap();
        assert_eq!(m.shape, vec![32, 256, 1024]);
        let big = Layout::engine_driven(32, 256, 1024, Dtype::Bfloat16, false).unwrap();
        assert_eq!(big.object_bytes(), 32 << 20);
        assert!(Layout::engine_driven(0, 256, 1024, Dtype::Bfloat16, false).is_err());
        assert!(Layout::new(vec![1 << 40, 1 << 40], Dtype::Int8).is_err());
    }
}
