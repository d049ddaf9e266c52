//! Raw flat files: a run of elements of one dtype at an offset, no header.

use super::{Dtype, FormatError};

/// A raw tensor in a file: `num_elements` elements of `dtype` starting at `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawSpec {
    /// Byte offset in the file.
    pub offset: u64,
    /// Number of elements; `None` means "to the end of the file".
    pub num_elements: Option<u64>,
    /// Element type.
    pub dtype: Dtype,
}

impl RawSpec {
    /// Resolves the byte range `(offset, len)` in a file of `file_len` bytes, checking that
    /// it fits and, when reading to the end, that the rest is whole elements.
    pub fn byte_range(&self, file_len: u64) -> Result<(u64, u64), FormatError> {
        let len = if let Some(n) = self.num_elements {
            self.dtype.bytes_for(n)?
        } else {
            let rest = file_len
                .checked_sub(self.offset)
                .ok_or(FormatError::RawPastEnd {
                    offset: self.offset,
                    len: 0,
                    file_len,
                })?;
            let bits = self.dtype.bits();
            if (rest * 8) % bits != 0 {
                return Err(FormatError::MisalignedSubByte {
                    dtype: self.dtype,
                    elements: rest * 8 / bits,
                });
            }
            rest
        };
        match self.offset.checked_add(len) {
            Some(end) if end <= file_len => Ok((self.offset, len)),
            _ => Err(FormatError::RawPastEnd {
                offset: self.offset,
                len,
                file_len,
            }),
        }
    }

    /// Number of elements in a byte length of this dtype.
    pub fn elements_in(&self, len: u64) -> u64 {
        len * 8 / self.dtype.bits()
    }
}
