//! The pipeline: choose an engine per file, plan its reads, run them through staging
//! slots (or straight into host memory), and hand each slot to the copy stage (the sink),
//! which gives it back when its copies are done. Memory is bounded by the pool.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use crate::device::cuda::GdsState;
use crate::device::staging::{Slot, StagingPool};
use crate::error::{Error, Result};
use crate::io::object::ObjectRun;
use crate::io::{self, Control, Engine, EngineChoice, ProgressFn, DIRECT_ALIGN};
use crate::plan::{self, Extent, PlanOptions, Read};
use crate::settings;
use crate::source::{is_url, local, LocalFile, ObjectFile, ObjectOptions};

/// A destination buffer, given by address. The caller keeps it alive and untouched for
/// the whole load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Host memory.
    Host {
        /// First byte.
        ptr: *mut u8,
        /// Length in bytes.
        len: u64,
    },
    /// CUDA device memory.
    Cuda {
        /// Device ordinal.
        device: usize,
        /// Device address.
        ptr: u64,
        /// Length in bytes.
        len: u64,
    },
}

impl Target {
    /// Length in bytes.
    pub fn len(&self) -> u64 {
        match *self {
            Target::Host { len, .. } | Target::Cuda { len, .. } => len,
        }
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

// SAFETY: a Target is an address; whoever creates one promises it stays valid and
// unaliased for the load (see `Loader::read_into`).
unsafe impl Send for Target {}
// SAFETY: as above.
unsafe impl Sync for Target {}

/// The copy stage: takes each filled slot and moves its pieces to their destinations.
pub trait Sink: Sync {
    /// Delivers the pieces of `read` held in `slot`. The sink owns the slot until its
    /// copies are complete, then drops it (which returns it to the pool).
    fn deliver(&self, read: &Read, slot: Slot) -> Result<()>;
    /// Host address of destination `dest` at `offset`, when reads may land there directly.
    fn host_ptr(&self, dest: usize, offset: u64) -> Option<*mut u8>;
    /// Waits for every copy delivered so far.
    fn finish(&self) -> Result<()>;
}

/// The copy stage for host destinations: a `memcpy` per piece.
pub struct HostSink<'a> {
    targets: &'a [Target],
}

impl<'a> HostSink<'a> {
    /// A sink over host targets.
    ///
    /// # Errors
    /// If a target is not host memory.
    pub fn new(targets: &'a [Target]) -> Result<Self> {
        if targets.iter().any(|t| !matches!(t, Target::Host { .. })) {
            return Err(Error::InvalidArgument(
                "host sink given a device target".into(),
            ));
        }
        Ok(Self { targets })
    }
}

impl Sink for HostSink<'_> {
    fn deliver(&self, read: &Read, slot: Slot) -> Result<()> {
        let src = slot.as_slice();
        for p in &read.pieces {
            let dst = self.host_ptr(p.dest, p.dest_offset).expect("host target");
            let from = &src[p.buf_offset as usize..(p.buf_offset + p.len) as usize];
            // SAFETY: the range was checked against the target's length before the run,
            // and pieces of one load never overlap in a destination.
            unsafe { std::ptr::copy_nonoverlapping(from.as_ptr(), dst, from.len()) };
        }
        Ok(())
    }

    fn host_ptr(&self, dest: usize, offset: u64) -> Option<*mut u8> {
        match self.targets[dest] {
            // SAFETY: offset <= len, checked before the run.
            Target::Host { ptr, .. } => Some(unsafe { ptr.add(offset as usize) }),
            Target::Cuda { .. } => None,
        }
    }

    fn finish(&self) -> Result<()> {
        Ok(())
    }
}

/// Settings of one run.
pub struct RunOptions<'a> {
    /// Engine policy.
    pub engine: EngineChoice,
    /// Reader threads for the pread engines.
    pub threads: usize,
    /// `io_uring` queue depth.
    pub uring_depth: u32,
    /// Largest buffered read straight into host memory.
    pub direct_chunk: u64,
    /// Set to cancel.
    pub cancel: Option<&'a AtomicBool>,
    /// Progress callback.
    pub progress: Option<&'a ProgressFn>,
    /// Shape of object store reads (GET size, concurrency, resumes).
    pub object: ObjectRun,
    /// Object store client configuration.
    pub object_options: &'a ObjectOptions,
    /// Every byte through staging and the sink (for `verify`): no read straight into
    /// host memory, no GPUDirect Storage.
    pub staged: bool,
}

/// What a load did.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Bytes delivered to destinations.
    pub bytes: u64,
    /// Wall time of the load.
    pub seconds: f64,
    /// Per file: its path, the engine it was read with, and its bytes.
    pub files: Vec<FileReport>,
}

impl Report {
    /// Throughput in GB/s (10^9 bytes per second).
    pub fn gbps(&self) -> f64 {
        gbps(self.bytes, self.seconds)
    }
}

/// `bytes` over `seconds` in GB/s (10^9 bytes per second); 0 for no time.
pub fn gbps(bytes: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        bytes as f64 / seconds / 1e9
    } else {
        0.0
    }
}

/// One file's part of a [`Report`].
#[derive(Debug, Clone)]
pub struct FileReport {
    /// The file.
    pub path: PathBuf,
    /// The engine that read it.
    pub engine: Engine,
    /// Bytes delivered from it.
    pub bytes: u64,
    /// Fraction of the file in the page cache when the engine was chosen (auto only).
    pub resident: Option<f64>,
}

/// Chooses the engine for one file under `choice`, with the fallbacks logged.
/// `to_cuda` says whether the load's destinations are all CUDA memory (only then can
/// GPUDirect Storage read it).
///
/// # Errors
/// [`Error::Unsupported`] when `choice` is [`EngineChoice::Gds`] and the destinations are
/// host memory, or libcufile (or the CUDA driver) cannot be loaded.
pub fn choose_engine(
    path: &std::path::Path,
    choice: EngineChoice,
    file: &LocalFile,
    to_cuda: bool,
) -> Result<(Engine, Option<f64>)> {
    let cold_engine = || {
        if !local::supports_direct(path) {
            log::debug!(
                "{}: file system refuses O_DIRECT, using buffered pread",
                path.display()
            );
            return Engine::Pread;
        }
        match io::uring::available() {
            Ok(()) => Engine::Uring,
            Err(_) => Engine::PreadDirect,
        }
    };
    Ok(match choice {
        EngineChoice::Auto => {
            let resident = file.resident_fraction();
            let engine = if resident >= 0.5 {
                Engine::Pread
            } else if to_cuda && auto_gds(path) {
                Engine::Gds
            } else {
                cold_engine()
            };
            log::debug!(
                "{}: {:.0}% in page cache -> {engine}",
                path.display(),
                resident * 100.0
            );
            (engine, Some(resident))
        }
        EngineChoice::Pread => (Engine::Pread, None),
        EngineChoice::Direct => {
            if local::supports_direct(path) {
                (Engine::PreadDirect, None)
            } else {
                log::debug!("{}: O_DIRECT refused, using buffered pread", path.display());
                (Engine::Pread, None)
            }
        }
        EngineChoice::Uring => (cold_engine(), None),
        EngineChoice::Gds => {
            if !to_cuda {
                return Err(Error::Unsupported(format!(
                    "{}: engine gds reads straight into GPU memory, but this load's \
                     destinations are host memory (use auto, pread, direct or uring)",
                    path.display()
                )));
            }
            io::gds::driver()?;
            (Engine::Gds, None)
        }
    })
}

/// Whether `auto` should read `path` (not in the page cache, going to CUDA memory) with
/// GPUDirect Storage: only when it is real (nvidia-fs loaded), the file system takes
/// `O_DIRECT`, the cuFile driver opens and the file can be registered. In compatibility
/// mode cuFile reads through host bounce buffers (1.4-1.6 GB/s cold on the H200 machine,
/// against 2.1 for `io_uring` + staging), so auto keeps the staging pipeline there.
fn auto_gds(path: &std::path::Path) -> bool {
    static COMPAT_LOGGED: std::sync::Once = std::sync::Once::new();
    match io::gds::state() {
        GdsState::NoLibrary => false,
        GdsState::Compat => {
            COMPAT_LOGGED.call_once(|| {
                log::debug!(
                    "libcufile found but nvidia-fs is not loaded (GPUDirect Storage \
                     compatibility mode): auto keeps the staging pipeline"
                );
            });
            false
        }
        GdsState::Real => {
            if !local::supports_direct(path) {
                log::debug!("{}: O_DIRECT refused, not using GDS", path.display());
                return false;
            }
            // libcufile may refuse a file (its file system, or missing udev data):
            // register it once here, so that auto falls back instead of failing.
            let usable = io::gds::driver().and_then(|drv| {
                let f = LocalFile::open_direct(path)?;
                io::gds::FileHandle::register(drv, &f).map(drop)
            });
            match usable {
                Ok(()) => true,
                Err(e) => {
                    log::debug!("{}: not using GDS: {e}", path.display());
                    false
                }
            }
        }
    }
}

/// Runs one load: `extents` of `paths` into `targets` through `sink`.
///
/// # Safety
/// Every target must be valid for writes of its length, and untouched by anyone else,
/// until this returns.
pub unsafe fn run(
    paths: &[PathBuf],
    extents: &[Extent],
    targets: &[Target],
    sink: &dyn Sink,
    pool: &StagingPool,
    opts: &RunOptions,
) -> Result<Report> {
    let start = Instant::now();
    check_extents(paths, extents, targets)?;
    let total: u64 = extents.iter().map(|e| e.len).sum();
    let ctl = Control::new(total, opts.cancel, opts.progress);
    // Object store URLs and local files go to their own engines; each side sees its
    // files under indices of its own.
    let (remote_paths, remote_extents, remote_reports) = split(paths, extents, true);
    let (local_paths, local_extents, _) = split(paths, extents, false);
    let mut reports = Vec::new();
    if !local_extents.is_empty() || remote_extents.is_empty() {
        // SAFETY: forwarded from this function's contract.
        reports = unsafe {
            run_local(
                &local_paths,
                &local_extents,
                targets,
                sink,
                pool,
                opts,
                &ctl,
            )?
        };
    }
    if !remote_extents.is_empty() && !ctl.should_stop() {
        run_remote(&remote_paths, &remote_extents, sink, pool, opts, &ctl)?;
        reports.extend(remote_reports);
    }
    let finished = sink.finish();
    ctl.finish()?;
    finished?;
    Ok(Report {
        bytes: total,
        seconds: start.elapsed().as_secs_f64(),
        files: reports,
    })
}

/// The paths that are (`remote`) or are not URLs, and the extents of those, renumbered,
/// with a report line per file read.
fn split(
    paths: &[PathBuf],
    extents: &[Extent],
    remote: bool,
) -> (Vec<PathBuf>, Vec<Extent>, Vec<FileReport>) {
    let mut index = vec![None; paths.len()];
    let mut sub = Vec::new();
    for (i, p) in paths.iter().enumerate() {
        if is_url(p) == remote {
            index[i] = Some(sub.len());
            sub.push(p.clone());
        }
    }
    let ext: Vec<Extent> = extents
        .iter()
        .filter_map(|e| index[e.file].map(|file| Extent { file, ..*e }))
        .collect();
    let reports = sub
        .iter()
        .enumerate()
        .filter_map(|(i, p)| {
            let bytes: u64 = ext.iter().filter(|e| e.file == i).map(|e| e.len).sum();
            (bytes > 0).then(|| FileReport {
                path: p.clone(),
                engine: Engine::Object,
                bytes,
                resident: None,
            })
        })
        .collect();
    (sub, ext, reports)
}

/// Reads object store extents: slot-sized reads, grouped into ranged GETs.
fn run_remote(
    paths: &[PathBuf],
    extents: &[Extent],
    sink: &dyn Sink,
    pool: &StagingPool,
    opts: &RunOptions,
    ctl: &Control,
) -> Result<()> {
    let objects = paths
        .iter()
        .map(|p| ObjectFile::at(&p.to_string_lossy(), opts.object_options))
        .collect::<Result<Vec<_>>>()?;
    let reads = plan::plan(
        extents,
        PlanOptions {
            align: 1,
            max_read: pool.slot_size() as u64,
            max_gap: 64 * 1024,
        },
    );
    let deliver = |read: &Read, slot: Slot| sink.deliver(read, slot);
    let t = Instant::now();
    io::object::run(&objects, &reads, pool, opts.object, ctl, &deliver);
    let bytes: u64 = extents.iter().map(|e| e.len).sum();
    log::debug!(
        "ranged-get: {bytes} bytes in {:.1} ms ({:.2} GB/s)",
        t.elapsed().as_secs_f64() * 1e3,
        bytes as f64 / t.elapsed().as_secs_f64() / 1e9
    );
    Ok(())
}

/// Reads local extents with the engine each file gets.
///
/// # Safety
/// As [`run`].
unsafe fn run_local(
    paths: &[PathBuf],
    extents: &[Extent],
    targets: &[Target],
    sink: &dyn Sink,
    pool: &StagingPool,
    opts: &RunOptions,
    ctl: &Control,
) -> Result<Vec<FileReport>> {
    let start = Instant::now();
    let mut wanted = vec![false; paths.len()];
    for e in extents.iter().filter(|e| e.len > 0) {
        wanted[e.file] = true;
    }
    if opts.staged && opts.engine == EngineChoice::Gds {
        return Err(Error::Unsupported(
            "verify hashes the bytes in staging, which engine gds bypasses (use auto, pread, \
             direct or uring)"
                .into(),
        ));
    }
    let to_cuda = !opts.staged
        && !targets.is_empty()
        && targets.iter().all(|t| matches!(t, Target::Cuda { .. }));
    // Open each file once, buffered; choose its engine; reopen with O_DIRECT if needed.
    let mut files = Vec::with_capacity(paths.len());
    let mut engines = Vec::with_capacity(paths.len());
    let mut reports = Vec::new();
    for (i, path) in paths.iter().enumerate() {
        let f = LocalFile::open(path)?;
        let (engine, resident) = if wanted[i] {
            choose_engine(path, opts.engine, &f, to_cuda)?
        } else {
            (Engine::Pread, None)
        };
        let f = if engine.direct() {
            LocalFile::open_direct(path)?
        } else if engine == Engine::Gds {
            // GDS proper needs O_DIRECT; compatibility mode takes a buffered descriptor.
            LocalFile::open_direct(path).unwrap_or_else(|e| {
                log::debug!(
                    "{}: no O_DIRECT for GDS ({e}), registering it buffered",
                    path.display()
                );
                f
            })
        } else {
            f
        };
        files.push(f);
        engines.push(engine);
        if wanted[i] {
            let bytes = extents.iter().filter(|e| e.file == i).map(|e| e.len).sum();
            reports.push(FileReport {
                path: path.clone(),
                engine,
                bytes,
                resident,
            });
        }
    }
    log::debug!(
        "opened {} file(s) and chose engines in {:.1} ms",
        paths.len(),
        start.elapsed().as_secs_f64() * 1e3
    );
    let deliver = |read: &Read, slot: Slot| sink.deliver(read, slot);
    let all_host = !opts.staged && targets.iter().all(|t| matches!(t, Target::Host { .. }));
    for engine in [
        Engine::Gds,
        Engine::Uring,
        Engine::PreadDirect,
        Engine::Pread,
    ] {
        let group: Vec<Extent> = extents
            .iter()
            .filter(|e| engines[e.file] == engine)
            .copied()
            .collect();
        if group.is_empty() || ctl.should_stop() {
            continue;
        }
        let slot = pool.slot_size() as u64;
        let group_start = Instant::now();
        let group_bytes: u64 = group.iter().map(|e| e.len).sum();
        match engine {
            Engine::Object => unreachable!("object store files are read by run_remote"),
            Engine::Gds => {
                // SAFETY: targets are valid and exclusive (this function's contract), the
                // extents were checked against them, and a file gets Gds only when every
                // target is CUDA memory.
                unsafe {
                    io::gds::run(
                        &files,
                        &group,
                        targets,
                        opts.threads,
                        settings::GDS_CHUNK,
                        ctl,
                    );
                };
            }
            Engine::Pread if all_host => {
                let reads = plan::plan(
                    &group,
                    PlanOptions {
                        align: 1,
                        max_read: opts.direct_chunk.max(1),
                        max_gap: 0,
                    },
                );
                let dest =
                    |p: &plan::Piece| sink.host_ptr(p.dest, p.dest_offset).expect("host target");
                // SAFETY: targets are valid and exclusive (this function's contract) and
                // pieces never overlap.
                unsafe { io::pread::run_direct_to_host(&files, &reads, opts.threads, ctl, &dest) };
            }
            Engine::Pread => {
                let reads = plan::plan(
                    &group,
                    PlanOptions {
                        align: 1,
                        max_read: slot,
                        max_gap: 64 * 1024,
                    },
                );
                io::pread::run_staged(&files, &reads, pool, opts.threads, ctl, &deliver);
            }
            Engine::PreadDirect | Engine::Uring => {
                let reads = plan::plan(
                    &group,
                    PlanOptions {
                        align: DIRECT_ALIGN,
                        max_read: slot,
                        max_gap: 1 << 20,
                    },
                );
                if engine == Engine::Uring {
                    io::uring::run(&files, &reads, pool, opts.uring_depth, ctl, &deliver);
                } else {
                    io::pread::run_staged(&files, &reads, pool, opts.threads, ctl, &deliver);
                }
            }
        }
        log::debug!(
            "{engine}: {group_bytes} bytes in {:.1} ms ({:.2} GB/s)",
            group_start.elapsed().as_secs_f64() * 1e3,
            group_bytes as f64 / group_start.elapsed().as_secs_f64() / 1e9
        );
    }
    Ok(reports)
}

fn check_extents(paths: &[PathBuf], extents: &[Extent], targets: &[Target]) -> Result<()> {
    for e in extents {
        if e.file >= paths.len() || e.dest >= targets.len() {
            return Err(Error::InvalidArgument(format!(
                "extent {e:?} names a missing file or destination"
            )));
        }
        let fits = e
            .dest_offset
            .checked_add(e.len)
            .is_some_and(|end| end <= targets[e.dest].len());
        if !fits || e.offset.checked_add(e.len).is_none() {
            return Err(Error::InvalidArgument(format!(
                "{}: {} bytes at offset {} do not fit destination {} ({} bytes at offset {})",
                paths[e.file].display(),
                e.len,
                e.offset,
                e.dest,
                targets[e.dest].len(),
                e.dest_offset
            )));
        }
    }
    Ok(())
}
