//! Python bindings: conversions, exceptions and GIL release around the core library.
//! No I/O logic lives here; `python/tensorferry/` builds the user-facing API on top.
#![allow(clippy::needless_pass_by_value)] // pyo3 hands arguments over by value

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use tensorferry::format::{safetensors, Dtype, RawSpec};
use tensorferry::io::ProgressFn;
use tensorferry::pipeline::{Report, Target};
use tensorferry::plan::Extent;
use tensorferry::source::ObjectOptions;
use tensorferry::{
    Checkpoint, DeviceRegion, DirectPolicy, EngineChoice, Error, LoadOptions, Loader, SaveControl,
    SaveOptions, SaveReport, SaveSource, SaveTensor, Saver,
};

/// Maps a core error to the Python exception class of its kind, defined in
/// `tensorferry.errors` (each also derives from the matching built-in exception).
fn to_py(e: Error) -> PyErr {
    Python::attach(|py| {
        let (class, filename) = match &e {
            Error::NotFound { path } => ("NotFoundError", Some(path.clone())),
            Error::PermissionDenied { path } => ("PermissionDeniedError", Some(path.clone())),
            Error::InvalidFile { path, .. } => ("InvalidFileError", Some(path.clone())),
            Error::TensorNotFound { .. } => ("TensorNotFoundError", None),
            Error::Io { path, op, .. } if tensorferry::saver::WRITE_OPS.contains(op) => {
                ("WriteError", Some(path.clone()))
            }
            Error::Io { path, .. } | Error::UnexpectedEof { path, .. } => {
                ("ReadError", Some(path.clone()))
            }
            Error::InvalidArgument(_) => ("InvalidArgumentError", None),
            Error::Unsupported(_) => ("UnsupportedError", None),
            Error::Cuda(_) => ("CudaError", None),
            Error::OutOfMemory(_) => ("OutOfMemoryError", None),
            Error::Cancelled => ("CancelledError", None),
            _ => ("TensorferryError", None),
        };
        let message = e.to_string();
        let made = py
            .import("tensorferry.errors")
            .and_then(|m| m.getattr(class))
            .and_then(|cls| {
                let errno = match &e {
                    Error::NotFound { .. } => Some(2),
                    Error::PermissionDenied { .. } => Some(13),
                    _ => None,
                };
                match (errno, filename) {
                    // OSError subclasses take (errno, strerror, filename).
                    (Some(n), Some(f)) => cls.call1((n, message.clone(), f.display().to_string())),
                    _ => cls.call1((message.clone(),)),
                }
            });
        // `errno` of an OS error (ENOSPC, EIO...), for `except OSError as e: e.errno`.
        let made = made.and_then(|obj| {
            if let Error::Io { source, .. } = &e {
                if let Some(n) = source.raw_os_error() {
                    obj.setattr("errno", n)?;
                }
            }
            Ok(obj)
        });
        match made {
            Ok(obj) => PyErr::from_value(obj),
            Err(_) => PyRuntimeError::new_err(message),
        }
    })
}

/// Object store options: the defaults (`TENSORFERRY_OBJECT_*`, then `AWS_*`/`GOOGLE_*`/
/// `AZURE_*`) with `storage_options` (`object_store` config keys) applied over them.
/// Keys are sorted so equal dicts share one cached client.
fn object_options(storage_options: Option<HashMap<String, String>>) -> ObjectOptions {
    let mut o = LoadOptions::default().object;
    if let Some(map) = storage_options {
        let mut pairs: Vec<(String, String)> = map.into_iter().collect();
        pairs.sort();
        o.options.extend(pairs);
    }
    o
}

/// The option keys (never values) of object store options, sorted.
fn option_keys(o: &ObjectOptions) -> Vec<String> {
    o.options.iter().map(|(k, _)| k.clone()).collect()
}

fn dtype_of(name: &str) -> PyResult<Dtype> {
    name.parse::<Dtype>()
        .map_err(|e| to_py(Error::InvalidArgument(e.to_string())))
}

/// Opens a checkpoint (file, index or directory) and returns its layout as a dict:
/// `files`, `tensors` (name, dtype, shape, file index, file offset, length, begin, end;
/// sorted by name), `metadata`, `sharded`. `storage_options` configure object stores
/// (over the environment).
#[pyfunction]
#[pyo3(signature = (path, storage_options=None))]
fn open_checkpoint(
    py: Python<'_>,
    path: PathBuf,
    storage_options: Option<HashMap<String, String>>,
) -> PyResult<Py<PyDict>> {
    let object = object_options(storage_options);
    let ck = py
        .detach(|| Checkpoint::open_with(&path, &object))
        .map_err(to_py)?;
    let d = PyDict::new(py);
    d.set_item("path", ck.path.display().to_string())?;
    d.set_item(
        "files",
        ck.files
            .iter()
            .map(|f| f.display().to_string())
            .collect::<Vec<_>>(),
    )?;
    let tensors = PyList::empty(py);
    for t in &ck.tensors {
        tensors.append((
            t.name(),
            t.dtype().name(),
            t.shape().to_vec(),
            t.file,
            t.file_offset,
            t.len(),
            t.info.data_offsets.0,
            t.info.data_offsets.1,
        ))?;
    }
    d.set_item("tensors", tensors)?;
    d.set_item("metadata", ck.metadata.clone())?;
    d.set_item("sharded", ck.sharded)?;
    Ok(d.unbind())
}

/// Parses a safetensors header from in-memory bytes (the whole serialized file).
/// Returns `(data_start, [(name, dtype, shape, begin, end)] in file order, metadata)`.
#[pyfunction]
#[allow(clippy::type_complexity)]
fn parse_header(
    data: &[u8],
) -> PyResult<(
    u64,
    Vec<(String, &'static str, Vec<u64>, u64, u64)>,
    Option<std::collections::BTreeMap<String, String>>,
)> {
    let h = safetensors::parse_header(data, data.len() as u64)
        .map_err(|e| to_py(Error::invalid(std::path::Path::new("<bytes>"), e)))?;
    let tensors = h
        .tensors
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                t.dtype.name(),
                t.shape.clone(),
                t.data_offsets.0,
                t.data_offsets.1,
            )
        })
        .collect();
    Ok((h.data_start(), tensors, h.metadata))
}

/// Serializes a header as safetensors does. `tensors` is `[(name, dtype, shape)]`.
/// Returns `(header bytes incl. the 8-byte length, [(name, begin, end)] in data order)`.
#[pyfunction]
#[pyo3(signature = (tensors, metadata=None))]
#[allow(clippy::type_complexity)]
fn serialize_header(
    py: Python<'_>,
    tensors: Vec<(String, String, Vec<u64>)>,
    metadata: Option<std::collections::BTreeMap<String, String>>,
) -> PyResult<(Bound<'_, PyBytes>, Vec<(String, u64, u64)>)> {
    let typed: Vec<(String, Dtype, Vec<u64>)> = tensors
        .into_iter()
        .map(|(n, d, s)| Ok((n, dtype_of(&d)?, s)))
        .collect::<PyResult<_>>()?;
    let (bytes, infos) = safetensors::serialize_header(&typed, metadata.as_ref())
        .map_err(|e| to_py(Error::InvalidArgument(e.to_string())))?;
    let order = infos
        .into_iter()
        .map(|i| (i.name, i.data_offsets.0, i.data_offsets.1))
        .collect();
    Ok((PyBytes::new(py, &bytes), order))
}

/// Byte range `(offset, length)` of a raw tensor in a file, checked against its size.
#[pyfunction]
#[pyo3(signature = (path, dtype, num_elements=None, offset=0, storage_options=None))]
fn raw_range(
    py: Python<'_>,
    path: PathBuf,
    dtype: &str,
    num_elements: Option<u64>,
    offset: u64,
    storage_options: Option<HashMap<String, String>>,
) -> PyResult<(u64, u64)> {
    let dtype = dtype_of(dtype)?;
    let object = object_options(storage_options);
    py.detach(|| {
        let len = if tensorferry::source::is_url(&path) {
            tensorferry::source::ObjectFile::open(&path.to_string_lossy(), &object)?
                .len()
                .unwrap_or(0)
        } else {
            std::fs::metadata(&path)
                .map_err(|e| Error::io(&path, "stat", 0, e))?
                .len()
        };
        RawSpec {
            offset,
            num_elements,
            dtype,
        }
        .byte_range(len)
        .map_err(|e| Error::invalid(&path, e))
    })
    .map_err(to_py)
}

/// Drops a file's pages from the page cache (for cold-load benchmarks).
#[pyfunction]
fn drop_cache(py: Python<'_>, path: PathBuf) -> PyResult<()> {
    py.detach(|| tensorferry::source::LocalFile::open(&path)?.drop_cache())
        .map_err(to_py)
}

/// Holds options and a staging pool; `read_into` runs one load with the GIL released.
#[pyclass(module = "tensorferry._native", frozen)]
struct NativeLoader {
    inner: Arc<Loader>,
}

fn report_dict(py: Python<'_>, r: &Report) -> PyResult<Py<PyDict>> {
    let d = PyDict::new(py);
    d.set_item("bytes", r.bytes)?;
    d.set_item("seconds", r.seconds)?;
    d.set_item("gbps", r.gbps())?;
    let files = PyList::empty(py);
    for f in &r.files {
        let fd = PyDict::new(py);
        fd.set_item("path", f.path.display().to_string())?;
        fd.set_item("engine", f.engine.to_string())?;
        fd.set_item("bytes", f.bytes)?;
        fd.set_item("resident", f.resident)?;
        files.append(fd)?;
    }
    d.set_item("files", files)?;
    Ok(d.unbind())
}

#[pymethods]
impl NativeLoader {
    #[new]
    #[pyo3(signature = (engine=None, threads=None, slot_size=None, slots=None, uring_depth=None, storage_options=None))]
    fn new(
        engine: Option<&str>,
        threads: Option<usize>,
        slot_size: Option<usize>,
        slots: Option<usize>,
        uring_depth: Option<u32>,
        storage_options: Option<HashMap<String, String>>,
    ) -> PyResult<Self> {
        let mut o = LoadOptions {
            object: object_options(storage_options),
            ..LoadOptions::default()
        };
        if let Some(e) = engine {
            o.engine = e.parse::<EngineChoice>().map_err(to_py)?;
        }
        if let Some(t) = threads {
            o.threads = t.max(1);
        }
        if let Some(s) = slot_size {
            o.slot_size = s;
        }
        if let Some(s) = slots {
            o.slots = s.max(1);
        }
        if let Some(d) = uring_depth {
            o.uring_depth = d.max(1);
        }
        Ok(Self {
            inner: Arc::new(Loader::new(o)),
        })
    }

    /// The options as a dict.
    fn options(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        let o = self.inner.options();
        let d = PyDict::new(py);
        d.set_item("engine", o.engine.to_string())?;
        d.set_item("threads", o.threads)?;
        d.set_item("slot_size", o.slot_size)?;
        d.set_item("slots", o.slots)?;
        d.set_item("uring_depth", o.uring_depth)?;
        d.set_item("storage_options", option_keys(&o.object))?;
        Ok(d.unbind())
    }

    /// Reads `extents` `(file, offset, length, target, target_offset)` of `files` into
    /// `targets` `(kind, device, address, length)` (kind `"cpu"` or `"cuda"`). The load runs
    /// on a worker thread with the GIL released; this thread wakes every 50 ms to deliver
    /// `progress(done, total)` and to notice Ctrl-C, which cancels the load (the worker is
    /// always joined before returning, so no write outlives the call). `stream` is the
    /// caller's CUDA stream: copies start after work already queued on it. `verify`, one
    /// entry per extent, names the tensor that extent is all of, to check against the
    /// checksum its file records (`None`: not checked).
    #[pyo3(signature = (files, extents, targets, stream=None, progress=None, verify=None))]
    #[allow(clippy::too_many_arguments)] // the Python signature
    fn read_into(
        &self,
        py: Python<'_>,
        files: Vec<PathBuf>,
        extents: Vec<(usize, u64, u64, usize, u64)>,
        targets: Vec<(String, usize, u64, u64)>,
        stream: Option<u64>,
        progress: Option<Py<PyAny>>,
        verify: Option<Vec<Option<String>>>,
    ) -> PyResult<Py<PyDict>> {
        let targets: Vec<Target> = targets
            .into_iter()
            .map(|(kind, device, ptr, len)| match kind.as_str() {
                "cpu" => Ok(Target::Host {
                    ptr: ptr as usize as *mut u8,
                    len,
                }),
                "cuda" => Ok(Target::Cuda { device, ptr, len }),
                other => Err(to_py(Error::InvalidArgument(format!(
                    "target kind {other:?}"
                )))),
            })
            .collect::<PyResult<_>>()?;
        let extents: Vec<Extent> = extents
            .into_iter()
            .map(|(file, offset, len, dest, dest_offset)| Extent {
                file,
                offset,
                len,
                dest,
                dest_offset,
            })
            .collect();
        let total: u64 = extents.iter().map(|e| e.len).sum();
        let loader = Arc::clone(&self.inner);
        let report = run_detached(
            py,
            "tensorferry-load",
            progress,
            total,
            move |cancel, counter| {
                let checks = match &verify {
                    Some(names) => loader.checks_for(&files, &extents, names)?,
                    None => Vec::new(),
                };
                // SAFETY: the Python caller keeps the target tensors alive and unused until
                // this call returns, and this call never returns before the worker ends.
                unsafe {
                    loader.read_into_targets_checked(
                        &files,
                        &extents,
                        &targets,
                        stream,
                        Some(cancel),
                        Some(counter),
                        &checks,
                    )
                }
            },
        )?;
        report_dict(py, &report)
    }
}

// --- saving --------------------------------------------------------------------------

/// A tensor to save as Python gives it: `(name, dtype, shape, kind, device, address,
/// nbytes)`, kind `"cpu"` or `"cuda"`.
type TensorSpec = (String, String, Vec<u64>, String, usize, u64, u64);

/// Memory to save from, by address (resolved into borrows on the worker thread).
#[derive(Clone, Copy)]
enum RawSource {
    Host { ptr: usize, len: usize },
    Cuda { device: usize, ptr: u64, len: u64 },
}

impl RawSource {
    fn new(kind: &str, device: usize, ptr: u64, len: u64) -> PyResult<Self> {
        match kind {
            "cpu" => Ok(RawSource::Host {
                ptr: ptr as usize,
                len: len as usize,
            }),
            "cuda" => Ok(RawSource::Cuda { device, ptr, len }),
            other => Err(to_py(Error::InvalidArgument(format!(
                "source kind {other:?}: expected cpu or cuda"
            )))),
        }
    }

    /// # Safety
    /// The memory must be valid for reads of its length, unchanged, for `'a`.
    unsafe fn source<'a>(self) -> SaveSource<'a> {
        match self {
            RawSource::Host { len: 0, .. } => SaveSource::Host(&[]),
            // SAFETY: from this function's contract.
            RawSource::Host { ptr, len } => {
                SaveSource::Host(unsafe { std::slice::from_raw_parts(ptr as *const u8, len) })
            }
            // SAFETY: from this function's contract.
            RawSource::Cuda { device, ptr, len } => {
                SaveSource::Cuda(unsafe { DeviceRegion::new(device, ptr, len) })
            }
        }
    }
}

struct RawTensor {
    name: String,
    dtype: Dtype,
    shape: Vec<u64>,
    source: RawSource,
}

fn raw_tensors(tensors: Vec<TensorSpec>) -> PyResult<Vec<RawTensor>> {
    tensors
        .into_iter()
        .map(|(name, dtype, shape, kind, device, ptr, len)| {
            Ok(RawTensor {
                name,
                dtype: dtype_of(&dtype)?,
                shape,
                source: RawSource::new(&kind, device, ptr, len)?,
            })
        })
        .collect()
}

/// # Safety
/// As [`RawSource::source`], for every tensor.
unsafe fn save_tensors(raw: &[RawTensor]) -> Vec<SaveTensor<'_>> {
    raw.iter()
        .map(|t| SaveTensor {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            // SAFETY: forwarded from this function's contract.
            source: unsafe { t.source.source() },
        })
        .collect()
}

fn save_report_dict(py: Python<'_>, r: &SaveReport) -> PyResult<Py<PyDict>> {
    let d = PyDict::new(py);
    d.set_item("bytes", r.bytes)?;
    d.set_item("seconds", r.seconds)?;
    d.set_item("gbps", r.gbps())?;
    let files = PyList::empty(py);
    for f in &r.files {
        let fd = PyDict::new(py);
        fd.set_item("path", f.path.display().to_string())?;
        fd.set_item("bytes", f.bytes)?;
        fd.set_item("direct", f.direct)?;
        files.append(fd)?;
    }
    d.set_item("files", files)?;
    Ok(d.unbind())
}

/// Runs `job` on a worker thread with the GIL released, as `NativeLoader.read_into` does:
/// this thread wakes every 50 ms to deliver `progress(done, total)` and to notice Ctrl-C,
/// which cancels the job; the worker is always joined before returning, so no access to
/// the caller's memory outlives the call.
fn run_detached<T: Send + 'static>(
    py: Python<'_>,
    name: &str,
    progress: Option<Py<PyAny>>,
    total_hint: u64,
    job: impl FnOnce(&AtomicBool, &ProgressFn) -> tensorferry::Result<T> + Send + 'static,
) -> PyResult<T> {
    let cancel = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let total = Arc::new(AtomicU64::new(total_hint));
    let (tx, rx) = mpsc::channel();
    let (c, d, t) = (Arc::clone(&cancel), Arc::clone(&done), Arc::clone(&total));
    let worker = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let counter = move |n: u64, of: u64| {
                t.store(of, Ordering::Relaxed);
                d.store(n, Ordering::Relaxed);
            };
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(&c, &counter)));
            let _ = tx.send(r);
        })
        .map_err(|e| PyRuntimeError::new_err(format!("spawning the {name} thread: {e}")))?;
    let progress_cb = progress.as_ref().map(|p| p.clone_ref(py));
    let (tot, dn) = (Arc::clone(&total), Arc::clone(&done));
    let (outcome, interrupted) = py.detach(move || {
        let mut interrupted: Option<PyErr> = None;
        let outcome = loop {
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(r) => break r,
                Err(mpsc::RecvTimeoutError::Timeout) => Python::attach(|py| {
                    if interrupted.is_none() {
                        if let Err(e) = py.check_signals() {
                            cancel.store(true, Ordering::Relaxed);
                            interrupted = Some(e);
                        }
                    }
                    if let Some(cb) = &progress_cb {
                        let args = (dn.load(Ordering::Relaxed), tot.load(Ordering::Relaxed));
                        if let Err(e) = cb.call1(py, args) {
                            cancel.store(true, Ordering::Relaxed);
                            interrupted.get_or_insert(e);
                        }
                    }
                }),
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    break Err(Box::new("worker thread ended without a result")
                        as Box<dyn std::any::Any + Send>)
                }
            }
        };
        (outcome, interrupted)
    });
    let _ = worker.join();
    if let Some(e) = interrupted {
        return Err(e);
    }
    match outcome {
        Ok(Ok(v)) => {
            if let Some(cb) = &progress {
                let t = total.load(Ordering::Relaxed);
                cb.call1(py, (t, t))?;
            }
            Ok(v)
        }
        Ok(Err(e)) => Err(to_py(e)),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Err(internal_error(&what))
        }
    }
}

/// A Rust panic, as `tensorferry.TensorferryError` (never a crash or a `PanicException`).
fn internal_error(what: &str) -> PyErr {
    let message = format!("internal error (please report it): {what}");
    Python::attach(|py| {
        py.import("tensorferry.errors")
            .and_then(|m| m.getattr("TensorferryError"))
            .and_then(|cls| cls.call1((message.clone(),)))
            .map_or_else(
                |_| PyRuntimeError::new_err(message.clone()),
                PyErr::from_value,
            )
    })
}

/// Holds save options, a staging pool and CUDA streams; every save runs with the GIL
/// released (see `run_detached`).
#[pyclass(module = "tensorferry._native", frozen)]
struct NativeSaver {
    inner: Arc<Saver>,
}

#[pymethods]
impl NativeSaver {
    #[new]
    #[pyo3(signature = (threads=None, slot_size=None, slots=None, direct=None, streams=None, storage_options=None))]
    fn new(
        threads: Option<usize>,
        slot_size: Option<usize>,
        slots: Option<usize>,
        direct: Option<&str>,
        streams: Option<usize>,
        storage_options: Option<HashMap<String, String>>,
    ) -> PyResult<Self> {
        let mut o = SaveOptions {
            object: object_options(storage_options),
            ..SaveOptions::default()
        };
        if let Some(t) = threads {
            o.threads = t.max(1);
        }
        if let Some(s) = slot_size {
            o.slot_size = s;
        }
        if let Some(s) = slots {
            o.slots = s.max(1);
        }
        if let Some(d) = direct {
            o.direct = d.parse::<DirectPolicy>().map_err(to_py)?;
        }
        if let Some(s) = streams {
            o.streams = s.max(1);
        }
        Ok(Self {
            inner: Arc::new(Saver::new(o)),
        })
    }

    /// The options as a dict.
    fn options(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        let o = self.inner.options();
        let d = PyDict::new(py);
        d.set_item("threads", o.threads)?;
        d.set_item("slot_size", o.slot_size)?;
        d.set_item("slots", o.slots)?;
        d.set_item("direct", o.direct.to_string())?;
        d.set_item("streams", o.streams)?;
        d.set_item("storage_options", option_keys(&o.object))?;
        Ok(d.unbind())
    }

    /// Saves `tensors` `[(name, dtype, shape, kind, device, address, nbytes)]` as one
    /// safetensors file, durably. The caller keeps the memory alive and unchanged (CUDA
    /// work on it complete) until this returns.
    #[pyo3(signature = (path, tensors, metadata=None, progress=None, checksums=false))]
    fn save_safetensors(
        &self,
        py: Python<'_>,
        path: PathBuf,
        tensors: Vec<TensorSpec>,
        metadata: Option<BTreeMap<String, String>>,
        progress: Option<Py<PyAny>>,
        checksums: bool,
    ) -> PyResult<Py<PyDict>> {
        let raw = raw_tensors(tensors)?;
        let saver = Arc::clone(&self.inner);
        let report = run_detached(
            py,
            "tensorferry-save",
            progress,
            0,
            move |cancel, counter| {
                // SAFETY: the Python caller keeps the memory alive and unchanged until this
                // call returns, and it never returns before the worker ends.
                let list = unsafe { save_tensors(&raw) };
                saver.save_safetensors_with(
                    &path,
                    &list,
                    metadata.as_ref(),
                    SaveControl {
                        cancel: Some(cancel),
                        progress: Some(counter),
                        checksums,
                    },
                )
            },
        )?;
        save_report_dict(py, &report)
    }

    /// Saves `tensors` (as for `save_safetensors`) as a sharded checkpoint in `directory`:
    /// `metadata` in the shards' headers, `index_metadata` in the index (or, for a single
    /// file, in its header too).
    #[pyo3(signature = (directory, tensors, max_shard_size, metadata=None, index_metadata=None, progress=None, checksums=false))]
    #[allow(clippy::too_many_arguments)] // the Python signature
    fn save_sharded(
        &self,
        py: Python<'_>,
        directory: PathBuf,
        tensors: Vec<TensorSpec>,
        max_shard_size: u64,
        metadata: Option<BTreeMap<String, String>>,
        index_metadata: Option<BTreeMap<String, String>>,
        progress: Option<Py<PyAny>>,
        checksums: bool,
    ) -> PyResult<Py<PyDict>> {
        let raw = raw_tensors(tensors)?;
        let saver = Arc::clone(&self.inner);
        let report = run_detached(
            py,
            "tensorferry-save",
            progress,
            0,
            move |cancel, counter| {
                // SAFETY: as in `save_safetensors`.
                let list = unsafe { save_tensors(&raw) };
                saver.save_sharded_with(
                    &directory,
                    &list,
                    max_shard_size,
                    metadata.as_ref(),
                    index_metadata.as_ref(),
                    SaveControl {
                        cancel: Some(cancel),
                        progress: Some(counter),
                        checksums,
                    },
                )
            },
        )?;
        save_report_dict(py, &report)
    }

    /// Writes `source` `(kind, device, address, nbytes)` into `path` at `offset` (created
    /// if missing, not truncated, not synced). Returns the bytes written.
    fn write_at(
        &self,
        py: Python<'_>,
        path: PathBuf,
        offset: u64,
        source: (String, usize, u64, u64),
    ) -> PyResult<u64> {
        let raw = RawSource::new(&source.0, source.1, source.2, source.3)?;
        let saver = Arc::clone(&self.inner);
        let report = run_detached(py, "tensorferry-write", None, 0, move |cancel, counter| {
            // SAFETY: as in `save_safetensors`.
            let src = unsafe { raw.source() };
            saver.write_at_with(
                &path,
                offset,
                &src,
                SaveControl {
                    cancel: Some(cancel),
                    progress: Some(counter),
                    ..SaveControl::default()
                },
            )
        })?;
        Ok(report.bytes)
    }
}

/// What this machine offers: io_uring, CUDA driver and devices, GDS.
#[pyfunction]
fn doctor(py: Python<'_>) -> PyResult<Py<PyDict>> {
    let d = PyDict::new(py);
    d.set_item(
        "io_uring",
        tensorferry::io::uring::available()
            .as_ref()
            .err()
            .cloned()
            .unwrap_or_else(|| "available".into()),
    )?;
    match tensorferry::device::cuda::devices() {
        Ok(g) => d.set_item(
            "gpus",
            g.iter()
                .map(|x| (x.ordinal, x.name.clone(), x.total_mem))
                .collect::<Vec<_>>(),
        )?,
        Err(e) => d.set_item("cuda", e.to_string())?,
    }
    d.set_item(
        "gds",
        format!("{:?}", tensorferry::device::cuda::gds_state()).to_lowercase(),
    )?;
    d.set_item("cores", tensorferry::settings::cores())?;
    Ok(d.unbind())
}

/// Writes the library's log records to stderr when `TENSORFERRY_LOG` asks for them
/// (`error`, `warn`, `info`, `debug`, `trace`).
struct StderrLog;

impl log::Log for StderrLog {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        m.target().starts_with("tensorferry")
    }
    fn log(&self, r: &log::Record<'_>) {
        if self.enabled(r.metadata()) {
            // CLOCK_MONOTONIC seconds, as Python's time.monotonic(): the two logs interleave.
            let mut ts = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            // SAFETY: clock_gettime writes the timespec we own.
            unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &raw mut ts) };
            eprintln!(
                "[tensorferry {} {}.{:06}] {}",
                r.level(),
                ts.tv_sec,
                ts.tv_nsec / 1000,
                r.args()
            );
        }
    }
    fn flush(&self) {}
}

static STDERR_LOG: StderrLog = StderrLog;

fn init_log() {
    let level = match tensorferry::settings::var(tensorferry::settings::LOG).as_deref() {
        Some("error") => log::LevelFilter::Error,
        Some("warn") => log::LevelFilter::Warn,
        Some("info") => log::LevelFilter::Info,
        Some("debug") => log::LevelFilter::Debug,
        Some("trace") => log::LevelFilter::Trace,
        _ => return,
    };
    if log::set_logger(&STDERR_LOG).is_ok() {
        log::set_max_level(level);
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    init_log();
    m.add_class::<NativeLoader>()?;
    m.add_class::<NativeSaver>()?;
    m.add_function(wrap_pyfunction!(open_checkpoint, m)?)?;
    m.add_function(wrap_pyfunction!(parse_header, m)?)?;
    m.add_function(wrap_pyfunction!(serialize_header, m)?)?;
    m.add_function(wrap_pyfunction!(raw_range, m)?)?;
    m.add_function(wrap_pyfunction!(drop_cache, m)?)?;
    m.add_function(wrap_pyfunction!(doctor, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
