//! The public error type, by what the caller can do about it, and the crate's `Result`.

use std::path::{Path, PathBuf};

use crate::format::FormatError;

/// The result type of every fallible operation in this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong, grouped by what the caller can do about it.
///
/// Every variant names the file (or URL) it concerns where there is one; messages are
/// lowercase and do not repeat the wrapped error's own words.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The file does not exist.
    #[error("{}: no such file", path.display())]
    NotFound {
        /// The missing file.
        path: PathBuf,
    },
    /// The file exists but may not be read or written.
    #[error("{}: permission denied", path.display())]
    PermissionDenied {
        /// The file.
        path: PathBuf,
    },
    /// The file is not a valid safetensors file, index or raw file of the size asked for.
    #[error("{}: {source}", path.display())]
    InvalidFile {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        #[source]
        source: FormatError,
    },
    /// A named tensor is not in the checkpoint.
    #[error("{}: no tensor named {name:?}", path.display())]
    TensorNotFound {
        /// The checkpoint (file, index or directory).
        path: PathBuf,
        /// The tensor asked for.
        name: String,
    },
    /// An operating-system error while reading or writing.
    #[error("{}: {op} at offset {offset}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done (`read`, `open`, `write`...).
        op: &'static str,
        /// Byte offset in the file where it happened (0 where there is none).
        offset: u64,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// The file ended before the bytes the plan needs (it is truncated, or changed size
    /// while being read).
    #[error("{}: file ended at offset {at} but {needed} bytes were expected there (truncated or changed while reading)", path.display())]
    UnexpectedEof {
        /// The file.
        path: PathBuf,
        /// Offset where the read came up short.
        at: u64,
        /// Bytes that were still expected.
        needed: u64,
    },
    /// The caller asked for something inconsistent (bad sizes, dtypes, options).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The platform lacks something the request needs (no CUDA driver, no `io_uring`, ...).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The CUDA driver reported an error.
    #[error("cuda: {0}")]
    Cuda(String),
    /// Memory (host or device) could not be allocated.
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    /// The operation was cancelled by the caller.
    #[error("cancelled")]
    Cancelled,
}

impl Error {
    /// Wraps an I/O error, turning `ENOENT` and `EACCES` into their own kinds.
    pub fn io(path: &Path, op: &'static str, offset: u64, source: std::io::Error) -> Self {
        match source.kind() {
            std::io::ErrorKind::NotFound => Self::NotFound {
                path: path.to_path_buf(),
            },
            std::io::ErrorKind::PermissionDenied => Self::PermissionDenied {
                path: path.to_path_buf(),
            },
            _ => Self::Io {
                path: path.to_path_buf(),
                op,
                offset,
                source,
            },
        }
    }

    /// A format error found in `path`.
    pub fn invalid(path: &Path, source: FormatError) -> Self {
        Self::InvalidFile {
            path: path.to_path_buf(),
            source,
        }
    }
}
