//! Read engines: a pread thread pool (buffered or `O_DIRECT`), `io_uring` with
//! `O_DIRECT` and registered buffers, and GPUDirect Storage (cuFile, straight into CUDA
//! memory); which one a file gets is a named policy.

pub mod gds;
pub mod object;
pub mod pread;
pub mod uring;
pub mod write;

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use crate::device::staging::Slot;
use crate::error::{Error, Result};
use crate::plan::Read;

/// The engine a caller asks for. `Auto` (the default) picks per file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EngineChoice {
    /// Per file: buffered pread when the page cache holds it, `io_uring` + `O_DIRECT` when
    /// not (pread + `O_DIRECT` where `io_uring` is unavailable); for CUDA destinations,
    /// GPUDirect Storage instead when it is real (nvidia-fs loaded).
    #[default]
    Auto,
    /// Buffered pread from a thread pool.
    Pread,
    /// pread with `O_DIRECT` from a thread pool.
    Direct,
    /// `io_uring` with `O_DIRECT` and registered buffers.
    Uring,
    /// `GPUDirect` Storage (cuFile); needs CUDA destinations and libcufile, else the load
    /// fails with [`Error::Unsupported`].
    Gds,
}

impl FromStr for EngineChoice {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "auto" => Self::Auto,
            "pread" | "buffered" => Self::Pread,
            "direct" | "pread-direct" => Self::Direct,
            "uring" | "io_uring" | "io-uring" => Self::Uring,
            "gds" | "cufile" => Self::Gds,
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "engine {s:?}: expected auto, pread, direct, uring or gds"
                )))
            }
        })
    }
}

impl fmt::Display for EngineChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Pread => "pread",
            Self::Direct => "direct",
            Self::Uring => "uring",
            Self::Gds => "gds",
        })
    }
}

/// The engine a file was actually read with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Engine {
    /// Buffered pread, thread pool.
    Pread,
    /// pread with `O_DIRECT`, thread pool.
    PreadDirect,
    /// `io_uring`, `O_DIRECT`, registered buffers.
    Uring,
    /// cuFile, straight into CUDA memory (no staging).
    Gds,
    /// Concurrent ranged GETs from an object store (S3, GCS, Azure, HTTP) into staging.
    Object,
}

impl Engine {
    /// Whether reads must be 4 KiB aligned (and the file opened with `O_DIRECT`).
    pub fn direct(self) -> bool {
        matches!(self, Engine::PreadDirect | Engine::Uring)
    }
}

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Pread => "pread",
            Self::PreadDirect => "pread+O_DIRECT",
            Self::Uring => "io_uring+O_DIRECT",
            Self::Gds => "gds",
            Self::Object => "ranged-get",
        })
    }
}

/// Alignment `O_DIRECT` needs for offsets, lengths and buffer addresses.
pub const DIRECT_ALIGN: u64 = 4096;

/// Called with each completed read and the slot holding its bytes; takes the slot.
pub type Deliver<'a> = dyn Fn(&Read, Slot) -> Result<()> + Sync + 'a;

/// Progress callback: `(bytes done, bytes total)`.
pub type ProgressFn = dyn Fn(u64, u64) + Send + Sync;

/// Shared state of one run: the first error, cancellation and progress.
pub struct Control<'a> {
    stop: AtomicBool,
    error: Mutex<Option<Error>>,
    user_cancel: Option<&'a AtomicBool>,
    done: AtomicU64,
    total: u64,
    progress: Option<&'a ProgressFn>,
}

impl<'a> Control<'a> {
    /// State for a run of `total` bytes.
    pub fn new(
        total: u64,
        user_cancel: Option<&'a AtomicBool>,
        progress: Option<&'a ProgressFn>,
    ) -> Self {
        Self {
            stop: AtomicBool::new(false),
            error: Mutex::new(None),
            user_cancel,
            done: AtomicU64::new(0),
            total,
            progress,
        }
    }

    /// Records an error (the first one wins) and stops the run.
    pub fn fail(&self, e: Error) {
        let mut slot = self.error.lock().expect("control lock");
        if slot.is_none() {
            *slot = Some(e);
        }
        self.stop.store(true, Ordering::Release);
    }

    /// Whether workers should stop (an error, or the caller cancelled).
    pub fn should_stop(&self) -> bool {
        if self.stop.load(Ordering::Acquire) {
            return true;
        }
        if self.user_cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
            self.fail(Error::Cancelled);
            return true;
        }
        false
    }

    /// Counts `bytes` as delivered and reports progress.
    pub fn add(&self, bytes: u64) {
        let done = self.done.fetch_add(bytes, Ordering::Relaxed) + bytes;
        if let Some(p) = self.progress {
            p(done, self.total);
        }
    }

    /// Bytes delivered so far.
    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    /// The run's outcome: the first error, if any.
    pub fn finish(&self) -> Result<()> {
        match self.error.lock().expect("control lock").take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Bytes of a read's pieces (what it delivers, not what it reads).
pub fn piece_bytes(read: &Read) -> u64 {
    read.pieces.iter().map(|p| p.len).sum()
}
