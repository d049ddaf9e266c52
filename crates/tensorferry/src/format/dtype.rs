//! Element types as safetensors names them, with their sizes in bits.

use std::fmt;
use std::str::FromStr;

use super::FormatError;

/// An element type, as spelled in a safetensors header.
///
/// Sub-byte kinds (`F4`, `F6_*`) are packed: a tensor of them takes
/// `ceil(elements * bits / 8)` bytes, and safetensors requires that to be whole bytes.
#[allow(non_camel_case_types, missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Dtype {
    BOOL,
    F4,
    F6_E2M3,
    F6_E3M2,
    U8,
    I8,
    F8_E5M2,
    F8_E4M3,
    F8_E8M0,
    F8_E4M3FNUZ,
    F8_E5M2FNUZ,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    C64,
    F64,
    I64,
    U64,
}

impl Dtype {
    /// Every dtype, in the order safetensors declares them (which is also the order it
    /// sorts tensors of equal alignment by when writing).
    pub const ALL: [Dtype; 22] = [
        Dtype::BOOL,
        Dtype::F4,
        Dtype::F6_E2M3,
        Dtype::F6_E3M2,
        Dtype::U8,
        Dtype::I8,
        Dtype::F8_E5M2,
        Dtype::F8_E4M3,
        Dtype::F8_E8M0,
        Dtype::F8_E4M3FNUZ,
        Dtype::F8_E5M2FNUZ,
        Dtype::I16,
        Dtype::U16,
        Dtype::F16,
        Dtype::BF16,
        Dtype::I32,
        Dtype::U32,
        Dtype::F32,
        Dtype::C64,
        Dtype::F64,
        Dtype::I64,
        Dtype::U64,
    ];

    /// Size of one element in bits.
    pub const fn bits(self) -> u64 {
        match self {
            Dtype::F4 => 4,
            Dtype::F6_E2M3 | Dtype::F6_E3M2 => 6,
            Dtype::BOOL
            | Dtype::U8
            | Dtype::I8
            | Dtype::F8_E5M2
            | Dtype::F8_E4M3
            | Dtype::F8_E8M0
            | Dtype::F8_E4M3FNUZ
            | Dtype::F8_E5M2FNUZ => 8,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 16,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 32,
            Dtype::C64 | Dtype::F64 | Dtype::I64 | Dtype::U64 => 64,
        }
    }

    /// Size of one element in bytes, or `None` for sub-byte kinds.
    pub const fn size(self) -> Option<u64> {
        let bits = self.bits();
        if bits.is_multiple_of(8) {
            Some(bits / 8)
        } else {
            None
        }
    }

    /// The name used in safetensors headers (`"BF16"`).
    pub const fn name(self) -> &'static str {
        match self {
            Dtype::BOOL => "BOOL",
            Dtype::F4 => "F4",
            Dtype::F6_E2M3 => "F6_E2M3",
            Dtype::F6_E3M2 => "F6_E3M2",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8_E5M2 => "F8_E5M2",
            Dtype::F8_E4M3 => "F8_E4M3",
            Dtype::F8_E8M0 => "F8_E8M0",
            Dtype::F8_E4M3FNUZ => "F8_E4M3FNUZ",
            Dtype::F8_E5M2FNUZ => "F8_E5M2FNUZ",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::C64 => "C64",
            Dtype::F64 => "F64",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
        }
    }

    /// Bytes taken by `elements` elements, or an error when that overflows or is not a
    /// whole number of bytes (sub-byte kinds).
    pub fn bytes_for(self, elements: u64) -> Result<u64, FormatError> {
        let bits = elements
            .checked_mul(self.bits())
            .ok_or(FormatError::Overflow {
                what: "element count x dtype size".into(),
            })?;
        if bits % 8 != 0 {
            return Err(FormatError::MisalignedSubByte {
                dtype: self,
                elements,
            });
        }
        Ok(bits / 8)
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Dtype {
    type Err = FormatError;

    /// Parses a safetensors dtype name; lowercase and common aliases (`float32`, `bfloat16`)
    /// are accepted too, for command lines.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(d) = Dtype::ALL.iter().find(|d| d.name() == s) {
            return Ok(*d);
        }
        let alias = match s.to_ascii_lowercase().as_str() {
            "bool" => Dtype::BOOL,
            "u8" | "uint8" => Dtype::U8,
            "i8" | "int8" => Dtype::I8,
            "u16" | "uint16" => Dtype::U16,
            "i16" | "int16" => Dtype::I16,
            "f16" | "float16" | "half" => Dtype::F16,
            "bf16" | "bfloat16" => Dtype::BF16,
            "u32" | "uint32" => Dtype::U32,
            "i32" | "int32" => Dtype::I32,
            "f32" | "float32" | "float" => Dtype::F32,
            "u64" | "uint64" => Dtype::U64,
            "i64" | "int64" | "long" => Dtype::I64,
            "f64" | "float64" | "double" => Dtype::F64,
            "c64" | "complex64" => Dtype::C64,
            "f8_e4m3" | "float8_e4m3fn" => Dtype::F8_E4M3,
            "f8_e5m2" | "float8_e5m2" => Dtype::F8_E5M2,
            "f8_e8m0" | "float8_e8m0fnu" => Dtype::F8_E8M0,
            "f8_e4m3fnuz" | "float8_e4m3fnuz" => Dtype::F8_E4M3FNUZ,
            "f8_e5m2fnuz" | "float8_e5m2fnuz" => Dtype::F8_E5M2FNUZ,
            _ => {
                return Err(FormatError::UnknownDtype {
                    dtype: s.to_string(),
                })
            }
        };
        Ok(alias)
    }
}
