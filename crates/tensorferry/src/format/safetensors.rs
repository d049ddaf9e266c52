//! The safetensors header: parsed and validated from the file's first `8 + N` bytes alone.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

use super::{Dtype, FormatError};

/// Largest header the reference implementation accepts (100 MB).
pub const MAX_HEADER_SIZE: u64 = 100_000_000;

/// One tensor as the header describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// The tensor's name.
    pub name: String,
    /// Its element type.
    pub dtype: Dtype,
    /// Its shape (empty for a scalar).
    pub shape: Vec<u64>,
    /// `[begin, end)` relative to the start of the data section, as in the header.
    pub data_offsets: (u64, u64),
}

impl TensorInfo {
    /// Number of bytes the tensor takes.
    pub fn len(&self) -> u64 {
        self.data_offsets.1 - self.data_offsets.0
    }

    /// Whether the tensor holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of elements (product of the shape; 1 for a scalar).
    pub fn elements(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// A parsed, validated safetensors header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// `N`, the JSON header's length in bytes.
    pub header_len: u64,
    /// Tensors sorted by their offset in the data section (the file's order).
    pub tensors: Vec<TensorInfo>,
    /// The `__metadata__` map, if the file has one.
    pub metadata: Option<BTreeMap<String, String>>,
}

impl Header {
    /// Byte offset of the data section in the file (`8 + N`).
    pub fn data_start(&self) -> u64 {
        8 + self.header_len
    }

    /// Length of the data section (the end of the last tensor).
    pub fn data_len(&self) -> u64 {
        self.tensors.last().map_or(0, |t| t.data_offsets.1)
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Tensor names sorted by name, as `safe_open(...).keys()` gives them.
    pub fn sorted_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.tensors.iter().map(|t| t.name.as_str()).collect();
        names.sort_unstable();
        names
    }
}

/// Reads the header length `N` from the first 8 bytes and checks it against the bound and
/// the file's size. Returns `N`.
pub fn header_len(first8: &[u8], file_len: u64) -> Result<u64, FormatError> {
    let Some(bytes) = first8.get(..8) else {
        return Err(FormatError::HeaderTooSmall { file_len });
    };
    if file_len < 8 {
        return Err(FormatError::HeaderTooSmall { file_len });
    }
    let n = u64::from_le_bytes(bytes.try_into().expect("8 bytes"));
    if n > MAX_HEADER_SIZE {
        return Err(FormatError::HeaderTooLarge { len: n });
    }
    if n.checked_add(8).is_none_or(|end| end > file_len) {
        return Err(FormatError::HeaderPastEnd { len: n, file_len });
    }
    Ok(n)
}

/// Parses and validates a header from `prefix` (at least the file's first `8 + N` bytes)
/// of a file of `file_len` bytes. No other byte of the file is needed.
pub fn parse_header(prefix: &[u8], file_len: u64) -> Result<Header, FormatError> {
    let n = header_len(prefix, file_len)?;
    let end = 8 + n as usize;
    let json = prefix
        .get(8..end)
        .ok_or(FormatError::HeaderTooSmall { file_len })?;
    let text = std::str::from_utf8(json).map_err(|e| FormatError::HeaderNotUtf8 {
        offset: 8 + e.valid_up_to() as u64,
    })?;
    if !text.starts_with('{') {
        return Err(FormatError::HeaderNotJsonObject);
    }
    let raw: RawHeader = serde_json::from_str(text).map_err(|e| FormatError::HeaderJson {
        message: e.to_string(),
    })?;
    let mut metadata = None;
    let mut tensors = Vec::with_capacity(raw.0.len());
    let mut seen = std::collections::HashSet::with_capacity(raw.0.len());
    for (name, value) in raw.0 {
        if !seen.insert(name.clone()) {
            return Err(FormatError::DuplicateTensor { name });
        }
        if name == "__metadata__" {
            metadata = Some(parse_metadata(value)?);
            continue;
        }
        tensors.push(parse_entry(name, value)?);
    }
    tensors.sort_by(|a, b| {
        a.data_offsets
            .cmp(&b.data_offsets)
            .then_with(|| a.name.cmp(&b.name))
    });
    let data_len = validate(&tensors)?;
    let expected = (8 + n)
        .checked_add(data_len)
        .ok_or_else(|| FormatError::Overflow {
            what: "header + data section length".into(),
        })?;
    if expected != file_len {
        return Err(FormatError::DataLengthMismatch {
            expected,
            actual: file_len,
        });
    }
    Ok(Header {
        header_len: n,
        tensors,
        metadata,
    })
}

/// Checks offsets (contiguous from 0, no overlap, no hole) and sizes; returns the data
/// section's length.
fn validate(tensors: &[TensorInfo]) -> Result<u64, FormatError> {
    let mut cursor = 0u64;
    for t in tensors {
        let (begin, end) = t.data_offsets;
        if end < begin {
            return Err(FormatError::InvalidOffsets {
                name: t.name.clone(),
                begin,
                end,
            });
        }
        if begin < cursor {
            return Err(FormatError::Overlap {
                name: t.name.clone(),
                begin,
                previous_end: cursor,
            });
        }
        if begin > cursor {
            return Err(FormatError::Hole {
                name: t.name.clone(),
                begin,
                previous_end: cursor,
            });
        }
        let elements = t
            .shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| FormatError::Overflow {
                what: format!("shape of tensor {:?}", t.name),
            })?;
        let expected = t
            .dtype
            .bytes_for(elements)
            .map_err(|e| e.for_tensor(&t.name))?;
        if end - begin != expected {
            return Err(FormatError::SizeMismatch {
                name: t.name.clone(),
                expected,
                actual: end - begin,
            });
        }
        cursor = end;
    }
    Ok(cursor)
}

fn parse_metadata(value: serde_json::Value) -> Result<BTreeMap<String, String>, FormatError> {
    let serde_json::Value::Object(map) = value else {
        return Err(FormatError::BadMetadata { key: None });
    };
    map.into_iter()
        .map(|(k, v)| match v {
            serde_json::Value::String(s) => Ok((k, s)),
            _ => Err(FormatError::BadMetadata { key: Some(k) }),
        })
        .collect()
}

#[derive(Deserialize)]
struct RawEntry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

fn parse_entry(name: String, value: serde_json::Value) -> Result<TensorInfo, FormatError> {
    let raw: RawEntry = serde_json::from_value(value).map_err(|e| FormatError::BadEntry {
        name: name.clone(),
        message: e.to_string(),
    })?;
    let dtype = raw
        .dtype
        .parse::<Dtype>()
        .ok()
        .filter(|d| d.name() == raw.dtype);
    let Some(dtype) = dtype else {
        return Err(FormatError::UnknownDtype {
            dtype: format!("{} (tensor {name:?})", raw.dtype),
        });
    };
    Ok(TensorInfo {
        name,
        dtype,
        shape: raw.shape,
        data_offsets: raw.data_offsets,
    })
}

/// The header's top-level object with its keys in file order and duplicates kept, so
/// that a repeated tensor name is an error rather than silently the last one.
struct RawHeader(Vec<(String, serde_json::Value)>);

impl<'de> Deserialize<'de> for RawHeader {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = RawHeader;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object of tensors")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawHeader, A::Error> {
                let mut entries = Vec::with_capacity(map.size_hint().unwrap_or(0).min(4096));
                while let Some(entry) = map.next_entry::<String, serde_json::Value>()? {
                    entries.push(entry);
                }
                Ok(RawHeader(entries))
            }
        }
        deserializer.deserialize_map(V)
    }
}

/// Serializes a header the way the reference implementation writes it: tensors sorted by
/// alignment (dtype size, largest first) then name, `__metadata__` first, no spaces, and
/// padded with spaces to a multiple of 8 bytes. Returns the `8 + N` byte prefix and the
/// tensors in the order their data must follow.
pub fn serialize_header(
    tensors: &[(String, Dtype, Vec<u64>)],
    metadata: Option<&BTreeMap<String, String>>,
) -> Result<(Vec<u8>, Vec<TensorInfo>), FormatError> {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    // safetensors sorts by dtype descending (its enum order), then by name.
    order.sort_by(|&a, &b| {
        tensors[b]
            .1
            .cmp(&tensors[a].1)
            .then_with(|| tensors[a].0.cmp(&tensors[b].0))
    });
    let mut out = String::from("{");
    if let Some(meta) = metadata {
        out.push_str("\"__metadata__\":");
        out.push_str(&serde_json::to_string(meta).expect("string map"));
    }
    let mut infos = Vec::with_capacity(tensors.len());
    let mut offset = 0u64;
    for i in order {
        let (name, dtype, shape) = &tensors[i];
        let elements = shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| FormatError::Overflow {
                what: format!("shape of tensor {name:?}"),
            })?;
        let len = dtype.bytes_for(elements).map_err(|e| e.for_tensor(name))?;
        let end = offset
            .checked_add(len)
            .ok_or_else(|| FormatError::Overflow {
                what: format!("data offsets of tensor {name:?}"),
            })?;
        let info = TensorInfo {
            name: name.clone(),
            dtype: *dtype,
            shape: shape.clone(),
            data_offsets: (offset, end),
        };
        offset = end;
        if out.len() > 1 {
            out.push(',');
        }
        out.push_str(&serde_json::to_string(name).expect("string"));
        out.push_str(":{\"dtype\":");
        out.push_str(&serde_json::to_string(dtype.name()).expect("string"));
        out.push_str(",\"shape\":");
        out.push_str(&serde_json::to_string(shape).expect("ints"));
        out.push_str(",\"data_offsets\":");
        out.push_str(
            &serde_json::to_string(&[info.data_offsets.0, info.data_offsets.1]).expect("ints"),
        );
        out.push('}');
        infos.push(info);
    }
    out.push('}');
    let pad = (8 - out.len() % 8) % 8;
    out.extend(std::iter::repeat_n(' ', pad));
    let mut bytes = Vec::with_capacity(8 + out.len());
    bytes.extend_from_slice(&(out.len() as u64).to_le_bytes());
    bytes.extend_from_slice(out.as_bytes());
    Ok((bytes, infos))
}
