//! tensorferry moves tensors between storage and memory as fast as the hardware allows.
//!
//! ```text
//!  request ─► format ─► plan ─► pipeline ───────────────────────────► destination
//!  (paths,    (header:   (extents  read stage (pread pool,   copy stage   (host buffers,
//!   names,     names,     → aligned io_uring O_DIRECT)  ──►  (sink)   ──►  device memory)
//!   device)    offsets)   reads)        │ staging slot         │ slot back to the pool
//! ```
//!
//! - [`format`]: safetensors headers, sharded indexes, raw files; pure, no I/O.
//! - [`plan`]: extents to large aligned reads and exact pieces.
//! - [`source`]: local files, residency; [`io`]: read engines; [`device`]: host buffers
//!   and the staging pool; [`pipeline`]: the stages joined, memory bounded by the pool.
//! - [`Loader`] and [`Checkpoint`]: the API; [`Saver`]: the store path (tensors in host
//!   or CUDA memory to safetensors files, sharded checkpoints and raw files, durably).
//!
//! ```no_run
//! use tensorferry::{Checkpoint, Loader};
//!
//! let ck = Checkpoint::open("model/")?; // a file, an index, or a directory
//! let (tensors, report) = Loader::default().load_checkpoint(&ck)?;
//! println!("{} tensors, {:.2} GB/s", tensors.len(), report.gbps());
//! # Ok::<(), tensorferry::Error>(())
//! ```
#![deny(missing_docs)]

#[cfg(not(target_pointer_width = "64"))]
compile_error!("tensorferry needs a 64-bit target (file offsets are used as usize)");

pub mod checkpoint;
pub mod checksum;
pub mod copy;
pub mod device;
mod error;
pub mod format;
pub mod io;
mod loader;
pub mod pipeline;
pub mod plan;
pub mod saver;
pub mod settings;
pub mod source;

pub use checkpoint::{Checkpoint, TensorEntry};
pub use device::Device;
pub use error::{Error, Result};
pub use format::{Dtype, FormatError};
pub use io::{Engine, EngineChoice};
pub use loader::{DeviceTensor, HostTensor, LoadOptions, Loader};
pub use pipeline::Report;
pub use saver::{
    DeviceRegion, DirectPolicy, SaveControl, SaveOptions, SaveReport, SaveSource, SaveTensor,
    SavedFile, Saver,
};

/// The README's examples, compiled as doctests so they stay true.
#[doc = include_str!("../../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
