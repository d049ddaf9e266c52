//! The core API: a [`Loader`] holding options and a staging pool, loading checkpoints,
//! raw files and byte ranges into host memory or caller-given destinations.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use crate::checkpoint::{Checkpoint, TensorEntry};
use crate::checksum::{self, Check, VerifySink};
use crate::device::cuda::{self, CudaSink, DeviceBuffer};
use crate::device::host::AlignedBuf;
use crate::device::staging::StagingPool;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::format::{Dtype, RawSpec};
use crate::io::object::ObjectRun;
use crate::io::{EngineChoice, ProgressFn};
use crate::pipeline::{self, HostSink, Report, RunOptions, Sink, Target};
use crate::plan::Extent;
use crate::settings;
use crate::source::{is_url, LocalFile, ObjectFile, ObjectOptions};

/// Options of a [`Loader`]. `Default` reads the `TENSORFERRY_*` variables (see
/// [`crate::settings`]), falling back to built-in defaults.
#[derive(Clone)]
pub struct LoadOptions {
    /// Engine policy.
    pub engine: EngineChoice,
    /// Reader threads for the pread engines.
    pub threads: usize,
    /// Staging slot size in bytes.
    pub slot_size: usize,
    /// Number of staging slots.
    pub slots: usize,
    /// `io_uring` queue depth.
    pub uring_depth: u32,
    /// Called from reader threads with `(bytes done, bytes total)`.
    pub progress: Option<Arc<ProgressFn>>,
    /// Set to `true` to cancel a load in flight; it then fails with [`Error::Cancelled`].
    pub cancel: Option<Arc<AtomicBool>>,
    /// Bytes of one ranged GET from an object store (one GET may fill several slots).
    pub object_chunk: u64,
    /// Ranged GETs in flight at once.
    pub object_concurrency: usize,
    /// Object store client configuration (credentials, endpoint, retries, timeout).
    pub object: ObjectOptions,
    /// Checks each tensor that [`Loader::load_checkpoint`], [`Loader::load_tensors`] and
    /// [`Loader::load_checkpoint_cuda`] load against the xxh3-64 its file records (see
    /// [`crate::checksum`]), as its bytes pass through staging: a mismatch is an
    /// [`Error::InvalidFile`] naming the file and tensor, and so is a file saved without
    /// checksums. Such loads then always go through staging (no direct reads into host
    /// memory, no GPUDirect Storage). Whole tensors only: byte ranges and slices are not
    /// verified.
    pub verify: bool,
}

impl std::fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions")
            .field("engine", &self.engine)
            .field("threads", &self.threads)
            .field("slot_size", &self.slot_size)
            .field("slots", &self.slots)
            .field("uring_depth", &self.uring_depth)
            .field("object_chunk", &self.object_chunk)
            .field("object_concurrency", &self.object_concurrency)
            .field("object", &self.object)
            .field("verify", &self.verify)
            .finish_non_exhaustive()
    }
}

impl Default for LoadOptions {
    fn default() -> Self {
        let num = |name: &str| settings::var(name).and_then(|v| settings::parse_size(&v));
        // Page-cache reads stop scaling at about 16 threads; more only contend.
        let threads = num(settings::THREADS)
            .map_or_else(
                || settings::cores().min(settings::MAX_DEFAULT_THREADS),
                |n| n as usize,
            )
            .max(1);
        Self {
            engine: settings::var(settings::ENGINE)
                .and_then(|v| v.parse().ok())
                .unwrap_or_default(),
            threads,
            slot_size: num(settings::SLOT_SIZE).map_or(settings::DEFAULT_SLOT_SIZE, |n| n as usize),
            // Every reader holds a slot while it reads; the copy stage needs as many more
            // in flight, or readers wait on copies.
            slots: num(settings::SLOTS)
                .map_or(settings::DEFAULT_SLOTS.max(2 * threads), |n| n as usize)
                .max(1),
            uring_depth: num(settings::URING_DEPTH)
                .map_or(settings::DEFAULT_URING_DEPTH, |n| n as u32),
            progress: None,
            cancel: None,
            object_chunk: num(settings::OBJECT_CHUNK)
                .map_or(settings::DEFAULT_OBJECT_CHUNK, |n| n)
                .max(1),
            object_concurrency: num(settings::OBJECT_CONCURRENCY)
                .map_or(settings::DEFAULT_OBJECT_CONCURRENCY, |n| n as usize)
                .max(1),
            object: default_object_options(),
            verify: false,
        }
    }
}

/// Object store options from the `TENSORFERRY_OBJECT_*` variables.
pub(crate) fn default_object_options() -> ObjectOptions {
    let num = |name: &str| settings::var(name).and_then(|v| v.trim().parse::<u64>().ok());
    let mut o = ObjectOptions::default();
    if let Some(n) = num(settings::OBJECT_RETRIES) {
        o.retries = n as usize;
    }
    if let Some(n) = num(settings::OBJECT_TIMEOUT) {
        o.timeout = std::time::Duration::from_secs(n.max(1));
    }
    o
}

/// A tensor loaded into host memory, owning its bytes.
#[derive(Debug)]
pub struct HostTensor {
    /// Its name (empty for raw loads).
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<u64>,
    /// The bytes, page-aligned.
    pub data: AlignedBuf,
}

/// A tensor loaded into CUDA memory allocated by this library, owning it.
pub struct DeviceTensor {
    /// Its name (empty for raw loads).
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<u64>,
    /// The device memory.
    pub data: DeviceBuffer,
}

/// Loads tensors. Holds options and a staging pool that is allocated on first use and
/// reused by every load; one loader may be shared by many threads.
pub struct Loader {
    opts: LoadOptions,
    pool: Mutex<Option<Arc<StagingPool>>>,
}

impl Default for Loader {
    fn default() -> Self {
        Self::new(LoadOptions::default())
    }
}

impl Loader {
    /// A loader with these options.
    pub fn new(opts: LoadOptions) -> Self {
        Self {
            opts,
            pool: Mutex::new(None),
        }
    }

    /// The loader's options.
    pub fn options(&self) -> &LoadOptions {
        &self.opts
    }

    /// The staging pool, allocated on first call.
    pub fn staging(&self) -> Result<Arc<StagingPool>> {
        let mut pool = self.pool.lock().expect("loader lock");
        if let Some(p) = pool.as_ref() {
            return Ok(Arc::clone(p));
        }
        let p = Arc::new(StagingPool::new(self.opts.slot_size, self.opts.slots)?);
        *pool = Some(Arc::clone(&p));
        Ok(p)
    }

    /// Loads every tensor of a checkpoint (file, index or directory) into host memory,
    /// sorted by name, with a report of what was read how.
    pub fn load_checkpoint(&self, ck: &Checkpoint) -> Result<(Vec<HostTensor>, Report)> {
        let names: Vec<&str> = ck
            .tensors
            .iter()
            .map(super::checkpoint::TensorEntry::name)
            .collect();
        self.load_tensors(ck, &names)
    }

    /// Loads the named tensors of a checkpoint into host memory, in the order asked.
    pub fn load_tensors(
        &self,
        ck: &Checkpoint,
        names: &[&str],
    ) -> Result<(Vec<HostTensor>, Report)> {
        let mut out = Vec::with_capacity(names.len());
        let mut extents = Vec::with_capacity(names.len());
        let mut entries = Vec::with_capacity(names.len());
        for (i, name) in names.iter().enumerate() {
            let t = ck.tensor(name)?;
            entries.push(t);
            out.push(HostTensor {
                name: t.name().to_string(),
                dtype: t.dtype(),
                shape: t.shape().to_vec(),
                data: AlignedBuf::zeroed(t.len() as usize)?,
            });
            extents.push(t.extent(i));
        }
        let checks = if self.opts.verify {
            checkpoint_checks(ck, &entries)?
        } else {
            Vec::new()
        };
        let mut dests = out.iter_mut().map(|t| &mut *t.data).collect::<Vec<_>>();
        let targets = host_targets(&mut dests);
        let sink = HostSink::new(&targets)?;
        // SAFETY: the targets are buffers we just allocated and own until return.
        let report =
            unsafe { self.run(&ck.files, &extents, &targets, &sink, None, None, &checks) }?;
        Ok((out, report))
    }

    /// Loads every tensor of a checkpoint into memory allocated on CUDA device `ordinal`,
    /// sorted by name. When this returns, every copy is complete.
    pub fn load_checkpoint_cuda(
        &self,
        ck: &Checkpoint,
        ordinal: usize,
    ) -> Result<(Vec<DeviceTensor>, Report)> {
        let ctx = cuda::Context::get(ordinal)?;
        let mut out = Vec::with_capacity(ck.tensors.len());
        let mut extents = Vec::with_capacity(ck.tensors.len());
        let mut targets = Vec::with_capacity(ck.tensors.len());
        for (i, t) in ck.tensors.iter().enumerate() {
            // Out of memory part way: the buffers allocated so far are freed with `out`.
            let data = DeviceBuffer::alloc(ctx, t.len() as usize).map_err(|e| match e {
                Error::OutOfMemory(m) => Error::OutOfMemory(format!(
                    "{}: tensor {:?} ({i} of {} allocated before it were freed): {m}",
                    ck.files[t.file].display(),
                    t.name(),
                    ck.tensors.len()
                )),
                e => e,
            })?;
            targets.push(Target::Cuda {
                device: ordinal,
                ptr: data.ptr(),
                len: t.len(),
            });
            out.push(DeviceTensor {
                name: t.name().to_string(),
                dtype: t.dtype(),
                shape: t.shape().to_vec(),
                data,
            });
            extents.push(t.extent(i));
        }
        let checks = if self.opts.verify {
            checkpoint_checks(ck, &ck.tensors.iter().collect::<Vec<_>>())?
        } else {
            Vec::new()
        };
        // SAFETY: the targets are buffers we just allocated and own until return.
        let report = unsafe {
            self.read_into_targets_checked(&ck.files, &extents, &targets, None, None, None, &checks)
        }?;
        Ok((out, report))
    }

    /// Reads `extents` of `paths` into `targets`, all host memory or all on one CUDA
    /// device, choosing the copy stage to match. For CUDA targets, `after` is the caller's
    /// stream (a `CUstream` as an integer): copies start after the work queued on it. When
    /// this returns, every byte has landed (the copies are synchronised), so the targets
    /// are ready on every stream.
    ///
    /// # Safety
    /// Every target must be valid for writes of its length, and untouched by anyone else,
    /// until this returns.
    pub unsafe fn read_into_targets(
        &self,
        paths: &[PathBuf],
        extents: &[Extent],
        targets: &[Target],
        after: Option<u64>,
    ) -> Result<Report> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.read_into_targets_with(paths, extents, targets, after, None, None) }
    }

    /// [`Loader::read_into_targets`] with a cancel flag and a progress callback for this
    /// call alone (they override the loader's own).
    ///
    /// # Safety
    /// As [`Loader::read_into_targets`].
    pub unsafe fn read_into_targets_with(
        &self,
        paths: &[PathBuf],
        extents: &[Extent],
        targets: &[Target],
        after: Option<u64>,
        cancel: Option<&AtomicBool>,
        progress: Option<&ProgressFn>,
    ) -> Result<Report> {
        // SAFETY: forwarded from this function's contract.
        unsafe {
            self.read_into_targets_checked(paths, extents, targets, after, cancel, progress, &[])
        }
    }

    /// [`Loader::read_into_targets_with`] that also verifies `checks` (whole tensors, see
    /// [`Loader::checks_for`]) as their bytes pass through staging; the load then always
    /// goes through staging. A mismatch is an [`Error::InvalidFile`] naming the file and
    /// tensor.
    ///
    /// # Safety
    /// As [`Loader::read_into_targets`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn read_into_targets_checked(
        &self,
        paths: &[PathBuf],
        extents: &[Extent],
        targets: &[Target],
        after: Option<u64>,
        cancel: Option<&AtomicBool>,
        progress: Option<&ProgressFn>,
        checks: &[Check],
    ) -> Result<Report> {
        let device = match targets.first() {
            Some(Target::Cuda { device, .. }) => Some(*device),
            _ => None,
        };
        match device {
            None => {
                let sink = HostSink::new(targets)?;
                // SAFETY: forwarded from this function's contract.
                unsafe { self.run(paths, extents, targets, &sink, cancel, progress, checks) }
            }
            Some(ordinal) => {
                cuda::register_pool(&*self.staging()?)?;
                let sink = CudaSink::new(
                    ordinal,
                    targets,
                    settings::STREAMS_DEFAULT,
                    after.map(|s| s as cudarc::driver::sys::CUstream),
                )?;
                // SAFETY: forwarded from this function's contract.
                unsafe { self.run(paths, extents, targets, &sink, cancel, progress, checks) }
            }
        }
    }

    /// The checks that verify the extents given a tensor name in `names` (one entry per
    /// extent; `None` is not checked): each such extent must be all of that tensor of its
    /// file, whose header must record checksums.
    pub fn checks_for(
        &self,
        paths: &[PathBuf],
        extents: &[Extent],
        names: &[Option<String>],
    ) -> Result<Vec<Check>> {
        if names.len() != extents.len() {
            return Err(Error::InvalidArgument(format!(
                "{} names to verify for {} extents",
                names.len(),
                extents.len()
            )));
        }
        let mut opened: std::collections::HashMap<
            usize,
            (Checkpoint, std::collections::BTreeMap<String, u64>),
        > = std::collections::HashMap::new();
        let mut checks = Vec::new();
        for (e, name) in extents.iter().zip(names) {
            let Some(name) = name else { continue };
            let path = paths.get(e.file).ok_or_else(|| {
                Error::InvalidArgument(format!("extent {e:?} names a missing file"))
            })?;
            if let std::collections::hash_map::Entry::Vacant(slot) = opened.entry(e.file) {
                let ck = Checkpoint::open_with(path, &self.opts.object)?;
                let sums =
                    checksum::parse(path, ck.headers.first().and_then(|h| h.metadata.as_ref()))?;
                slot.insert((ck, sums));
            }
            let (ck, sums) = &opened[&e.file];
            let t = ck.tensor(name)?;
            if t.file_offset != e.offset || t.len() != e.len {
                return Err(Error::InvalidArgument(format!(
                    "{}: verify applies to whole-tensor loads, but {} bytes at offset {} are \
                     not all of tensor {name:?}",
                    path.display(),
                    e.len,
                    e.offset
                )));
            }
            let digest = *sums.get(name).ok_or_else(|| {
                Error::invalid(
                    path,
                    crate::FormatError::BadChecksums {
                        reason: format!("no checksum recorded for tensor {name:?}"),
                    },
                )
            })?;
            checks.push(Check {
                path: path.clone(),
                name: name.clone(),
                dest: e.dest,
                dest_offset: e.dest_offset,
                len: e.len,
                digest,
            });
        }
        Ok(checks)
    }

    /// Loads a raw flat file (or part of it) into host memory.
    pub fn load_raw(&self, path: &Path, spec: RawSpec) -> Result<(HostTensor, Report)> {
        let mut v = self.load_raws(&[(path.to_path_buf(), spec)])?;
        let t = v.0.pop().expect("one tensor");
        Ok((t, v.1))
    }

    /// Loads several raw files (or ranges) in one submission.
    pub fn load_raws(&self, specs: &[(PathBuf, RawSpec)]) -> Result<(Vec<HostTensor>, Report)> {
        let mut paths: Vec<PathBuf> = Vec::new();
        let mut out = Vec::with_capacity(specs.len());
        let mut extents = Vec::with_capacity(specs.len());
        for (i, (path, spec)) in specs.iter().enumerate() {
            let file_len = if is_url(path) {
                let f = ObjectFile::open(&path.to_string_lossy(), &self.opts.object)?;
                f.len().unwrap_or(0)
            } else {
                LocalFile::open(path)?.len()
            };
            let (offset, len) = spec
                .byte_range(file_len)
                .map_err(|e| Error::invalid(path, e))?;
            let file = paths.iter().position(|p| p == path).unwrap_or_else(|| {
                paths.push(path.clone());
                paths.len() - 1
            });
            out.push(HostTensor {
                name: String::new(),
                dtype: spec.dtype,
                shape: vec![spec.elements_in(len)],
                data: AlignedBuf::zeroed(len as usize)?,
            });
            extents.push(Extent {
                file,
                offset,
                len,
                dest: i,
                dest_offset: 0,
            });
        }
        let report = self.read_into_host(
            &paths,
            &extents,
            &mut out.iter_mut().map(|t| &mut *t.data).collect::<Vec<_>>(),
        )?;
        Ok((out, report))
    }

    /// Reads `extents` of `paths` into host buffers (`dests[extent.dest]`).
    pub fn read_into_host(
        &self,
        paths: &[PathBuf],
        extents: &[Extent],
        dests: &mut [&mut [u8]],
    ) -> Result<Report> {
        let targets = host_targets(dests);
        let sink = HostSink::new(&targets)?;
        // SAFETY: the targets are the caller's exclusive borrows, alive for this call.
        unsafe { self.read_into(paths, extents, &targets, &sink) }
    }

    /// Reads `extents` of `paths` into `targets` through `sink` (the copy stage).
    ///
    /// # Safety
    /// Every target must be valid for writes of its length, and untouched by anyone else,
    /// until this returns.
    pub unsafe fn read_into(
        &self,
        paths: &[PathBuf],
        extents: &[Extent],
        targets: &[Target],
        sink: &dyn Sink,
    ) -> Result<Report> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.run(paths, extents, targets, sink, None, None, &[]) }
    }

    #[allow(clippy::too_many_arguments)]
    unsafe fn run(
        &self,
        paths: &[PathBuf],
        extents: &[Extent],
        targets: &[Target],
        sink: &dyn Sink,
        cancel: Option<&AtomicBool>,
        progress: Option<&ProgressFn>,
        checks: &[Check],
    ) -> Result<Report> {
        let pool = self.staging()?;
        let verify = if checks.is_empty() {
            None
        } else {
            Some(VerifySink::new(sink, checks)?)
        };
        let run = RunOptions {
            engine: self.opts.engine,
            threads: self.opts.threads,
            uring_depth: self.opts.uring_depth,
            direct_chunk: settings::DIRECT_CHUNK,
            cancel: cancel.or(self.opts.cancel.as_deref()),
            progress: progress.or(self.opts.progress.as_deref()),
            object: ObjectRun {
                chunk: self.opts.object_chunk,
                concurrency: self.opts.object_concurrency,
                retries: self.opts.object.retries,
            },
            object_options: &self.opts.object,
            staged: verify.is_some(),
        };
        let sink: &dyn Sink = match &verify {
            Some(v) => v,
            None => sink,
        };
        // SAFETY: forwarded from this function's contract.
        let report = unsafe { pipeline::run(paths, extents, targets, sink, &pool, &run) }?;
        if let Some(v) = &verify {
            v.verify()?;
        }
        Ok(report)
    }

    /// Checks that `device` can be loaded to here (a CUDA device needs a driver).
    pub fn check_device(device: Device) -> Result<()> {
        match device {
            Device::Cpu => Ok(()),
            Device::Cuda(n) => cuda::Context::get(n).map(|_| ()),
        }
    }
}

/// The checks of whole tensors `entries` of `ck` loaded to destinations `0..`, each at
/// offset 0; fails when a file records no checksums (or none for a tensor).
fn checkpoint_checks(ck: &Checkpoint, entries: &[&TensorEntry]) -> Result<Vec<Check>> {
    let mut sums = std::collections::HashMap::new();
    let mut checks = Vec::with_capacity(entries.len());
    for (i, t) in entries.iter().enumerate() {
        let path = &ck.files[t.file];
        if let std::collections::hash_map::Entry::Vacant(slot) = sums.entry(t.file) {
            slot.insert(checksum::parse(path, ck.headers[t.file].metadata.as_ref())?);
        }
        let digest = *sums[&t.file].get(t.name()).ok_or_else(|| {
            Error::invalid(
                path,
                crate::FormatError::BadChecksums {
                    reason: format!("no checksum recorded for tensor {:?}", t.name()),
                },
            )
        })?;
        checks.push(Check {
            path: path.clone(),
            name: t.name().to_string(),
            dest: i,
            dest_offset: 0,
            len: t.len(),
            digest,
        });
    }
    Ok(checks)
}

/// Host buffers as pipeline targets (addresses of the caller's exclusive borrows).
fn host_targets(dests: &mut [&mut [u8]]) -> Vec<Target> {
    dests
        .iter_mut()
        .map(|d| Target::Host {
            ptr: d.as_mut_ptr(),
            len: d.len() as u64,
        })
        .collect()
}
