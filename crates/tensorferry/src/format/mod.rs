//! On-disk layouts: safetensors headers, sharded-checkpoint indexes, raw flat files.
//!
//! Pure code: everything here works on bytes already read, so it can be fuzzed and
//! property-tested alone. Reading those bytes is the `source` layer's job.

mod dtype;
pub mod index;
pub mod raw;
pub mod safetensors;

pub use dtype::Dtype;
pub use index::Index;
pub use raw::RawSpec;
pub use safetensors::{Header, TensorInfo};

/// What is wrong with a file's layout. Wrapped in [`crate::Error::InvalidFile`], which
/// adds the file's path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FormatError {
    /// The file is shorter than the 8-byte header length.
    #[error("file of {file_len} bytes is too small for a safetensors header")]
    HeaderTooSmall {
        /// The file's size.
        file_len: u64,
    },
    /// The header length is over the 100 MB bound.
    #[error("header length {len} is over the 100 MB limit")]
    HeaderTooLarge {
        /// The declared length.
        len: u64,
    },
    /// The header length points past the end of the file.
    #[error("header length {len} goes past the end of the file ({file_len} bytes)")]
    HeaderPastEnd {
        /// The declared length.
        len: u64,
        /// The file's size.
        file_len: u64,
    },
    /// The header is not UTF-8.
    #[error("header is not valid UTF-8 (at byte {offset})")]
    HeaderNotUtf8 {
        /// File offset of the first bad byte.
        offset: u64,
    },
    /// The header does not start with `{`.
    #[error("header is not a JSON object")]
    HeaderNotJsonObject,
    /// The header is not valid JSON (or not the expected shape).
    #[error("header is not valid JSON: {message}")]
    HeaderJson {
        /// `serde_json`'s description.
        message: String,
    },
    /// A tensor name appears twice.
    #[error("tensor {name:?} appears more than once")]
    DuplicateTensor {
        /// The repeated name.
        name: String,
    },
    /// A tensor entry is malformed (missing field, negative or non-integer dimension...).
    #[error("tensor {name:?}: {message}")]
    BadEntry {
        /// The tensor.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// A dtype name that safetensors does not define.
    #[error("unknown dtype {dtype}")]
    UnknownDtype {
        /// The name found.
        dtype: String,
    },
    /// `__metadata__` is not a map of strings to strings.
    #[error("__metadata__ must map strings to strings{}", key.as_ref().map(|k| format!(" (key {k:?})")).unwrap_or_default())]
    BadMetadata {
        /// The offending key, if it is one value that is wrong.
        key: Option<String>,
    },
    /// A computation on sizes overflowed 64 bits.
    #[error("{what} overflows 64 bits")]
    Overflow {
        /// What was being computed.
        what: String,
    },
    /// Sub-byte elements that do not fill whole bytes.
    #[error("{elements} elements of {dtype} are not a whole number of bytes")]
    MisalignedSubByte {
        /// The dtype.
        dtype: Dtype,
        /// The element count.
        elements: u64,
    },
    /// `end < begin`.
    #[error("tensor {name:?}: data_offsets [{begin}, {end}] end before they begin")]
    InvalidOffsets {
        /// The tensor.
        name: String,
        /// Begin offset.
        begin: u64,
        /// End offset.
        end: u64,
    },
    /// A tensor starts before the previous one ends.
    #[error("tensor {name:?}: data starting at {begin} overlaps the previous tensor (ending at {previous_end})")]
    Overlap {
        /// The tensor.
        name: String,
        /// Its begin offset.
        begin: u64,
        /// Where the previous tensor ends.
        previous_end: u64,
    },
    /// A gap between two tensors.
    #[error("tensor {name:?}: data starts at {begin}, leaving a hole after offset {previous_end}")]
    Hole {
        /// The tensor.
        name: String,
        /// Its begin offset.
        begin: u64,
        /// Where the previous tensor ends.
        previous_end: u64,
    },
    /// The byte range does not match shape x dtype.
    #[error(
        "tensor {name:?}: shape and dtype need {expected} bytes but data_offsets span {actual}"
    )]
    SizeMismatch {
        /// The tensor.
        name: String,
        /// Bytes implied by shape and dtype.
        expected: u64,
        /// Bytes in the range.
        actual: u64,
    },
    /// The file's size does not match header + data section.
    #[error("file should be {expected} bytes (header + data) but is {actual}")]
    DataLengthMismatch {
        /// 8 + N + data length.
        expected: u64,
        /// The file's size.
        actual: u64,
    },
    /// An index file that is malformed.
    #[error("invalid index: {message}")]
    BadIndex {
        /// What is wrong.
        message: String,
    },
    /// A shard name that would leave the checkpoint's directory.
    #[error("shard name {shard:?} leaves the checkpoint directory (absolute or with '..')")]
    UnsafeShardName {
        /// The name found.
        shard: String,
    },
    /// `verify` was asked of a file saved without checksums.
    #[error("the file has no tensorferry checksums (no \"tensorferry.xxh3_64\" metadata; save it with checksums=True), so it cannot be verified")]
    NoChecksums,
    /// The recorded checksums are malformed, or lack a tensor.
    #[error("invalid tensorferry checksums: {reason}")]
    BadChecksums {
        /// What is wrong.
        reason: String,
    },
    /// A tensor's bytes do not match the checksum recorded for it.
    #[error("checksum mismatch in tensor {name:?}: recorded xxh3-64 {expected}, data hashes to {actual} (the file is corrupt or was modified)")]
    ChecksumMismatch {
        /// The tensor.
        name: String,
        /// The recorded digest (hex).
        expected: String,
        /// The digest of the bytes read (hex).
        actual: String,
    },
    /// A raw-file request that does not fit the file.
    #[error("raw read of {len} bytes at offset {offset} goes past the end of the file ({file_len} bytes)")]
    RawPastEnd {
        /// Offset asked for.
        offset: u64,
        /// Bytes asked for.
        len: u64,
        /// The file's size.
        file_len: u64,
    },
}

impl FormatError {
    /// Adds a tensor name to size errors that lack one.
    pub(crate) fn for_tensor(self, name: &str) -> Self {
        match self {
            FormatError::Overflow { what } => FormatError::Overflow {
                what: format!("{what} of tensor {name:?}"),
            },
            FormatError::MisalignedSubByte { .. } => FormatError::BadEntry {
                name: name.to_string(),
                message: self.to_string(),
            },
            other => other,
        }
    }
}
