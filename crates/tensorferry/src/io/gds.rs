//! The GPUDirect Storage engine: cuFile reads from a file straight into CUDA memory, with
//! no staging slot. libcufile is loaded at run time (cudarc's loader does not look for
//! `libcufile.so.0`, the name the CUDA packages install), so a machine without it gets an
//! [`Error::Unsupported`], never a panic.
//!
//! Layers, bottom up: [`Cufile`] (the library and its entry points, thin `unsafe`
//! wrappers), [`Driver`] (`cuFileDriverOpen`, once per process), [`FileHandle`] and
//! [`BufRegistration`] (registrations undone on drop), and [`run`] (the engine).

use std::ffi::{c_int, c_void};
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use super::Control;
use crate::device::cuda::{self, Context, GdsState};
use crate::error::{Error, Result};
use crate::pipeline::Target;
use crate::plan::Extent;
use crate::settings;
use crate::source::LocalFile;

/// Where libcufile is looked for when [`settings::CUFILE_LIB`] is unset, in order.
pub const SEARCH_PATH: [&str; 4] = [
    "libcufile.so.0",
    "libcufile.so",
    "/usr/local/cuda/lib64/libcufile.so.0",
    "/usr/local/cuda/targets/x86_64-linux/lib/libcufile.so.0",
];

/// The directory nvidia-fs (the kernel half of GPUDirect Storage) appears under.
const NVIDIA_FS: &str = "/proc/driver/nvidia-fs";

// Minimal C layouts, copied from cufile.h (as bound by cudarc 0.19,
// src/cufile/sys/mod.rs). Enums are kept as plain integers so that a value this code does
// not know is never undefined behaviour.

/// `CUfileHandle_t` (cufile.h: `typedef void *CUfileHandle_t;`).
type RawHandle = *mut c_void;

/// `CUfileError_t` (cufile.h: `typedef struct CUfileError { CUfileOpError err; CUresult
/// cu_err; } CUfileError_t;`); both fields are C enums, 4 bytes each.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct CuFileError {
    err: u32,
    cu_err: u32,
}

/// The union inside `CUfileDescr_t` (cufile.h: `union { int fd; void *handle; } handle;`).
#[repr(C)]
#[derive(Clone, Copy)]
union DescrHandle {
    fd: c_int,
    handle: *mut c_void,
}

/// `CUfileDescr_t` (cufile.h: `{ CUfileFileHandleType type; union {...} handle; const
/// CUfileFSOps_t *fs_ops; }`).
#[repr(C)]
struct CuFileDescr {
    type_: u32,
    handle: DescrHandle,
    fs_ops: *const c_void,
}

/// `CU_FILE_HANDLE_TYPE_OPAQUE_FD` of `CUfileFileHandleType` (cufile.h).
const HANDLE_TYPE_OPAQUE_FD: u32 = 1;
/// `CU_FILE_SUCCESS` of `CUfileOpError` (cufile.h).
const CU_FILE_SUCCESS: u32 = 0;
/// `CU_FILE_CUDA_DRIVER_ERROR` of `CUfileOpError` (cufile.h): `cu_err` holds the detail.
const CU_FILE_CUDA_DRIVER_ERROR: u32 = 5011;

type DriverFn = unsafe extern "C" fn() -> CuFileError;
type HandleRegisterFn = unsafe extern "C" fn(*mut RawHandle, *mut CuFileDescr) -> CuFileError;
type HandleDeregisterFn = unsafe extern "C" fn(RawHandle);
type BufRegisterFn = unsafe extern "C" fn(*const c_void, usize, c_int) -> CuFileError;
type BufDeregisterFn = unsafe extern "C" fn(*const c_void) -> CuFileError;
/// `ssize_t cuFileRead(CUfileHandle_t fh, void *bufPtr_base, size_t size, off_t
/// file_offset, off_t bufPtr_offset)`.
type ReadFn = unsafe extern "C" fn(RawHandle, *mut c_void, usize, i64, i64) -> isize;

/// libcufile, loaded, with the entry points this crate uses.
pub struct Cufile {
    path: String,
    driver_open: DriverFn,
    driver_close: DriverFn,
    handle_register: HandleRegisterFn,
    handle_deregister: HandleDeregisterFn,
    buf_register: BufRegisterFn,
    buf_deregister: BufDeregisterFn,
    read: ReadFn,
    // Last: the entry points above are valid only while the library is loaded.
    _lib: libloading::Library,
}

impl std::fmt::Debug for Cufile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cufile")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// Where this process would look for libcufile: [`settings::CUFILE_LIB`] alone when it is
/// set, else [`SEARCH_PATH`].
pub fn candidates() -> Vec<String> {
    match settings::var(settings::CUFILE_LIB) {
        Some(p) => vec![p],
        None => SEARCH_PATH.iter().map(ToString::to_string).collect(),
    }
}

/// Looks up `names` in `lib` (the first that exists) as a function of type `F`.
///
/// # Safety
/// `F` must be the symbol's true C signature, and the value must not outlive `lib`.
unsafe fn symbol<F: Copy>(lib: &libloading::Library, path: &str, names: &[&str]) -> Result<F> {
    for name in names {
        // SAFETY: the caller vouches for `F`; the symbol is copied out as a plain function
        // pointer, kept next to the library in `Cufile`.
        if let Ok(s) = unsafe { lib.get::<F>(name.as_bytes()) } {
            return Ok(*s);
        }
    }
    Err(Error::Unsupported(format!(
        "GPUDirect Storage: {path} has no symbol {} (too old a libcufile?)",
        names.join(" or ")
    )))
}

impl Cufile {
    /// Loads libcufile from [`candidates`] (the first that loads) and resolves its entry
    /// points. Not cached: see [`library`] for the process-wide instance.
    pub fn load() -> Result<Self> {
        let mut tried = Vec::new();
        for path in candidates() {
            // SAFETY: loading a shared library runs its initialisers; libcufile's only set
            // up its own state (it reads its configuration on cuFileDriverOpen).
            match unsafe { libloading::Library::new(&path) } {
                Ok(lib) => return Self::resolve(lib, path),
                // dlerror already names the file.
                Err(e) => tried.push(e.to_string()),
            }
        }
        let hint = if settings::var(settings::CUFILE_LIB).is_some() {
            format!("check {}", settings::CUFILE_LIB)
        } else {
            format!("set {} to its path", settings::CUFILE_LIB)
        };
        Err(Error::Unsupported(format!(
            "GPUDirect Storage: libcufile could not be loaded ({}); {hint}",
            tried.join("; ")
        )))
    }

    fn resolve(lib: libloading::Library, path: String) -> Result<Self> {
        // SAFETY (each lookup below): the types are the signatures of cufile.h, given
        // above next to each type; the pointers live in `Self` beside `lib`.
        unsafe {
            Ok(Self {
                driver_open: symbol(&lib, &path, &["cuFileDriverOpen\0"])?,
                // cufile.h (CUDA >= 11.8) maps cuFileDriverClose to cuFileDriverClose_v2.
                driver_close: symbol(
                    &lib,
                    &path,
                    &["cuFileDriverClose_v2\0", "cuFileDriverClose\0"],
                )?,
                handle_register: symbol(&lib, &path, &["cuFileHandleRegister\0"])?,
                handle_deregister: symbol(&lib, &path, &["cuFileHandleDeregister\0"])?,
                buf_register: symbol(&lib, &path, &["cuFileBufRegister\0"])?,
                buf_deregister: symbol(&lib, &path, &["cuFileBufDeregister\0"])?,
                read: symbol(&lib, &path, &["cuFileRead\0"])?,
                path,
                _lib: lib,
            })
        }
    }

    /// The path (or soname) the library was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    fn driver_open(&self) -> Result<()> {
        // SAFETY: no arguments; libcufile initialises CUDA and reads its configuration.
        check(unsafe { (self.driver_open)() }, "cuFileDriverOpen")
            .map_err(|e| Error::Unsupported(format!("GPUDirect Storage: {e}")))
    }

    /// `cuFileDriverClose`: releases the driver opened by [`driver`].
    ///
    /// # Safety
    /// No handle, buffer registration or read of this process may be in use or used
    /// afterwards, and [`driver`] must not be called again.
    pub unsafe fn close_driver(&self) -> Result<()> {
        // SAFETY: the caller guarantees nothing uses the driver any more.
        check(unsafe { (self.driver_close)() }, "cuFileDriverClose")
    }
}

/// Turns a `CUfileError_t` into ours.
fn check(e: CuFileError, what: &str) -> Result<()> {
    if e.err == CU_FILE_SUCCESS {
        return Ok(());
    }
    let detail = if e.err == CU_FILE_CUDA_DRIVER_ERROR {
        format!(" (CUDA error {})", e.cu_err)
    } else {
        String::new()
    };
    Err(Error::Cuda(format!(
        "{what} failed: {} ({}){detail}",
        op_error_name(e.err),
        e.err
    )))
}

/// The name of a `CUfileOpError` value (cufile.h, CUDA 13.0).
fn op_error_name(code: u32) -> &'static str {
    match code {
        0 => "CU_FILE_SUCCESS",
        5001 => "CU_FILE_DRIVER_NOT_INITIALIZED",
        5002 => "CU_FILE_DRIVER_INVALID_PROPS",
        5003 => "CU_FILE_DRIVER_UNSUPPORTED_LIMIT",
        5004 => "CU_FILE_DRIVER_VERSION_MISMATCH",
        5005 => "CU_FILE_DRIVER_VERSION_READ_ERROR",
        5006 => "CU_FILE_DRIVER_CLOSING",
        5007 => "CU_FILE_PLATFORM_NOT_SUPPORTED",
        5008 => "CU_FILE_IO_NOT_SUPPORTED",
        5009 => "CU_FILE_DEVICE_NOT_SUPPORTED",
        5010 => "CU_FILE_NVFS_DRIVER_ERROR",
        5011 => "CU_FILE_CUDA_DRIVER_ERROR",
        5012 => "CU_FILE_CUDA_POINTER_INVALID",
        5013 => "CU_FILE_CUDA_MEMORY_TYPE_INVALID",
        5014 => "CU_FILE_CUDA_POINTER_RANGE_ERROR",
        5015 => "CU_FILE_CUDA_CONTEXT_MISMATCH",
        5016 => "CU_FILE_INVALID_MAPPING_SIZE",
        5017 => "CU_FILE_INVALID_MAPPING_RANGE",
        5018 => "CU_FILE_INVALID_FILE_TYPE",
        5019 => "CU_FILE_INVALID_FILE_OPEN_FLAG",
        5020 => "CU_FILE_DIO_NOT_SET",
        5022 => "CU_FILE_INVALID_VALUE",
        5023 => "CU_FILE_MEMORY_ALREADY_REGISTERED",
        5024 => "CU_FILE_MEMORY_NOT_REGISTERED",
        5025 => "CU_FILE_PERMISSION_DENIED",
        5026 => "CU_FILE_DRIVER_ALREADY_OPEN",
        5027 => "CU_FILE_HANDLE_NOT_REGISTERED",
        5028 => "CU_FILE_HANDLE_ALREADY_REGISTERED",
        5029 => "CU_FILE_DEVICE_NOT_FOUND",
        5030 => "CU_FILE_INTERNAL_ERROR",
        5031 => "CU_FILE_GETNEWFD_FAILED",
        5033 => "CU_FILE_NVFS_SETUP_ERROR",
        5034 => "CU_FILE_IO_DISABLED",
        5035 => "CU_FILE_BATCH_SUBMIT_FAILED",
        5036 => "CU_FILE_GPU_MEMORY_PINNING_FAILED",
        5037 => "CU_FILE_BATCH_FULL",
        5038 => "CU_FILE_ASYNC_NOT_SUPPORTED",
        5043 => "CU_FILE_NOMEM_ERROR",
        5044 => "CU_FILE_IO_ERROR",
        5045 => "CU_FILE_INTERNAL_BUF_REGISTER_ERROR",
        5047 => "CU_FILE_INVALID_CONTEXT_ERROR",
        5048 => "CU_FILE_NVFS_INTERNAL_DRIVER_ERROR",
        _ => "unknown cuFile error",
    }
}

/// libcufile, loaded once per process from [`candidates`] (the variable is read on the
/// first call only).
pub fn library() -> Result<&'static Cufile> {
    static LIB: OnceLock<std::result::Result<Cufile, String>> = OnceLock::new();
    match LIB.get_or_init(|| Cufile::load().map_err(unsupported_message)) {
        Ok(lib) => Ok(lib),
        Err(m) => Err(Error::Unsupported(m.clone())),
    }
}

fn unsupported_message(e: Error) -> String {
    match e {
        Error::Unsupported(m) => m,
        other => other.to_string(),
    }
}

/// The cuFile driver, opened: proof that `cuFileDriverOpen` succeeded in this process.
#[derive(Debug)]
pub struct Driver {
    lib: &'static Cufile,
}

/// Loads libcufile and the CUDA driver and opens the cuFile driver, once per process (it
/// stays open until the process exits). `Err` ([`Error::Unsupported`]) when any is missing.
pub fn driver() -> Result<&'static Driver> {
    static DRIVER: OnceLock<std::result::Result<Driver, String>> = OnceLock::new();
    match DRIVER.get_or_init(|| {
        let lib = library().map_err(unsupported_message)?;
        cuda::init().map_err(|e| format!("GPUDirect Storage: {}", unsupported_message(e)))?;
        let t = std::time::Instant::now();
        lib.driver_open().map_err(unsupported_message)?;
        log::debug!(
            "cuFileDriverOpen ({}) in {:.1} ms",
            lib.path(),
            t.elapsed().as_secs_f64() * 1e3
        );
        Ok(Driver { lib })
    }) {
        Ok(d) => Ok(d),
        Err(m) => Err(Error::Unsupported(m.clone())),
    }
}

impl Driver {
    /// The library the driver was opened from.
    pub fn library(&self) -> &'static Cufile {
        self.lib
    }
}

/// GPUDirect Storage as this process would use it: like [`cuda::gds_state`], but finding
/// libcufile through [`candidates`]. Computed once.
pub fn state() -> GdsState {
    static STATE: OnceLock<GdsState> = OnceLock::new();
    *STATE.get_or_init(|| {
        if library().is_err() {
            GdsState::NoLibrary
        } else if Path::new(NVIDIA_FS).exists() {
            GdsState::Real
        } else {
            GdsState::Compat
        }
    })
}

/// A file registered with cuFile (`cuFileHandleRegister`); deregistered on drop.
pub struct FileHandle<'a> {
    lib: &'static Cufile,
    raw: RawHandle,
    file: &'a LocalFile,
}

// SAFETY: cuFile handles may be used from any thread, and cuFileRead on one handle from
// many threads at once (the cuFile API reference: "the APIs are thread safe").
unsafe impl Send for FileHandle<'_> {}
// SAFETY: as above.
unsafe impl Sync for FileHandle<'_> {}

impl<'a> FileHandle<'a> {
    /// Registers `file` (best opened with `O_DIRECT`) with the open driver.
    pub fn register(driver: &Driver, file: &'a LocalFile) -> Result<Self> {
        let lib = driver.lib;
        let mut descr = CuFileDescr {
            type_: HANDLE_TYPE_OPAQUE_FD,
            handle: DescrHandle {
                fd: file.file().as_raw_fd(),
            },
            fs_ops: std::ptr::null(),
        };
        let mut fh: RawHandle = std::ptr::null_mut();
        // SAFETY: `descr` names an open descriptor that outlives the handle (`'a`), and
        // both pointers are valid for the call.
        let e = unsafe { (lib.handle_register)(&raw mut fh, &raw mut descr) };
        check(e, "cuFileHandleRegister").map_err(|e| {
            Error::Unsupported(format!(
                "{}: GPUDirect Storage refused the file: {e} (libcufile's cufile.log says why)",
                file.path().display()
            ))
        })?;
        Ok(Self { lib, raw: fh, file })
    }

    /// One `cuFileRead`: up to `len` bytes at `file_offset` into device memory at
    /// `dev_base + dev_offset`. Returns the count read (0 at the end of the file).
    ///
    /// # Safety
    /// `dev_base` must be a device allocation (or a registered buffer) of the context
    /// current on this thread, with `dev_offset + len` bytes valid for writes that no one
    /// else touches during the call.
    pub unsafe fn read(
        &self,
        dev_base: u64,
        dev_offset: u64,
        file_offset: u64,
        len: usize,
    ) -> Result<usize> {
        let path = self.file.path();
        let (Ok(foff), Ok(doff)) = (i64::try_from(file_offset), i64::try_from(dev_offset)) else {
            return Err(Error::InvalidArgument(format!(
                "{}: offset {file_offset} (device offset {dev_offset}) too large for cuFileRead",
                path.display()
            )));
        };
        // SAFETY: a registered handle; the caller vouches for the destination.
        let n = unsafe { (self.lib.read)(self.raw, dev_base as *mut c_void, len, foff, doff) };
        match n {
            n if n >= 0 => Ok(n.unsigned_abs()),
            // -1: a system error, in errno.
            -1 => Err(Error::io(
                path,
                "cuFileRead",
                file_offset,
                std::io::Error::last_os_error(),
            )),
            // Below -1: the negated CUfileOpError.
            n => Err(Error::Cuda(format!(
                "{}: cuFileRead of {len} bytes at offset {file_offset} failed: {} ({})",
                path.display(),
                op_error_name(n.unsigned_abs() as u32),
                n.unsigned_abs()
            ))),
        }
    }

    /// Reads exactly `len` bytes at `file_offset` into `dev_base + dev_offset`, looping
    /// over short reads; the file ending first is [`Error::UnexpectedEof`].
    ///
    /// # Safety
    /// As [`FileHandle::read`].
    pub unsafe fn read_exact(
        &self,
        dev_base: u64,
        dev_offset: u64,
        file_offset: u64,
        len: u64,
    ) -> Result<()> {
        let mut done = 0u64;
        while done < len {
            // SAFETY: a sub-range of the caller's range.
            let n = unsafe {
                self.read(
                    dev_base,
                    dev_offset + done,
                    file_offset + done,
                    (len - done) as usize,
                )
            }?;
            if n == 0 {
                return Err(Error::UnexpectedEof {
                    path: self.file.path().to_path_buf(),
                    at: file_offset + done,
                    needed: len - done,
                });
            }
            done += n as u64;
        }
        Ok(())
    }
}

impl Drop for FileHandle<'_> {
    fn drop(&mut self) {
        // SAFETY: our own registration, undone once; no read uses it any more (reads
        // borrow `self`).
        unsafe { (self.lib.handle_deregister)(self.raw) };
    }
}

/// Device memory registered with cuFile (`cuFileBufRegister`), which lets real GPUDirect
/// Storage DMA into it without bounce buffers; deregistered on drop.
pub struct BufRegistration {
    lib: &'static Cufile,
    ctx: &'static Context,
    ptr: u64,
}

impl BufRegistration {
    /// Registers `len` bytes at device address `ptr` of `ctx`'s device.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be a live device allocation of `ctx` that outlives the
    /// registration.
    pub unsafe fn new(driver: &Driver, ctx: &'static Context, ptr: u64, len: u64) -> Result<Self> {
        ctx.bind()?;
        // SAFETY: the caller vouches for the range; the context is current.
        let e = unsafe { (driver.lib.buf_register)(ptr as *const c_void, len as usize, 0) };
        check(e, "cuFileBufRegister")?;
        Ok(Self {
            lib: driver.lib,
            ctx,
            ptr,
        })
    }
}

impl Drop for BufRegistration {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: our own registration, undone once, while the memory is still live.
            let e = unsafe { (self.lib.buf_deregister)(self.ptr as *const c_void) };
            if let Err(e) = check(e, "cuFileBufDeregister") {
                log::debug!("{e}");
            }
        }
    }
}

/// One cuFileRead's worth of an extent.
#[derive(Debug, Clone, Copy)]
struct Chunk {
    file: usize,
    offset: u64,
    len: u64,
    dest: usize,
    dest_offset: u64,
}

/// Splits extents at file offsets that are multiples of `chunk` (so middle chunks are
/// aligned), skipping empty ones.
fn chunks(extents: &[Extent], chunk: u64) -> Vec<Chunk> {
    let chunk = chunk.max(super::DIRECT_ALIGN);
    let mut out = Vec::new();
    for e in extents.iter().filter(|e| e.len > 0) {
        let mut done = 0;
        while done < e.len {
            let at = e.offset + done;
            let len = (chunk - at % chunk).min(e.len - done);
            out.push(Chunk {
                file: e.file,
                offset: at,
                len,
                dest: e.dest,
                dest_offset: e.dest_offset + done,
            });
            done += len;
        }
    }
    out
}

/// The GDS engine: reads `extents` of `files` straight into the CUDA `targets` with
/// cuFileRead, in chunks of `chunk` bytes spread over `threads` threads, each with its
/// target's context bound. Errors, cancellation and progress go through `ctl`.
///
/// Before reading, each device's context is synchronised: cuFileRead is ordered with no
/// stream, and the targets may be memory whose previous user's work is still queued.
/// Targets are registered with `cuFileBufRegister` when nvidia-fs is loaded (a refusal
/// only costs speed, and is logged at debug level) and deregistered before returning.
///
/// # Safety
/// Every target must be device memory valid for writes of its length, untouched by anyone
/// else until this returns; extents must fit their targets.
pub unsafe fn run(
    files: &[LocalFile],
    extents: &[Extent],
    targets: &[Target],
    threads: usize,
    chunk: u64,
    ctl: &Control,
) {
    // SAFETY: forwarded from this function's contract.
    if let Err(e) = unsafe { run_inner(files, extents, targets, threads, chunk, ctl) } {
        ctl.fail(e);
    }
}

unsafe fn run_inner(
    files: &[LocalFile],
    extents: &[Extent],
    targets: &[Target],
    threads: usize,
    chunk: u64,
    ctl: &Control,
) -> Result<()> {
    let work = chunks(extents, chunk);
    if work.is_empty() {
        return Ok(());
    }
    let drv = driver()?;
    let cuda_target = |dest: usize| match targets[dest] {
        Target::Cuda { device, ptr, len } => Ok((device, ptr, len)),
        Target::Host { .. } => Err(Error::InvalidArgument(
            "the gds engine was given a host destination".into(),
        )),
    };
    // Register each file read from, once.
    let mut handles: Vec<Option<FileHandle>> = files.iter().map(|_| None).collect();
    for c in &work {
        if handles[c.file].is_none() {
            handles[c.file] = Some(FileHandle::register(drv, &files[c.file])?);
        }
    }
    // Order after queued work, and register destinations (real GDS only).
    let mut devices: Vec<usize> = Vec::new();
    let mut dests: Vec<usize> = Vec::new();
    for c in &work {
        let (device, _, _) = cuda_target(c.dest)?;
        if !devices.contains(&device) {
            devices.push(device);
        }
        if !dests.contains(&c.dest) {
            dests.push(c.dest);
        }
    }
    for &d in &devices {
        let ctx = Context::get(d)?;
        ctx.bind()?;
        cudarc::driver::result::ctx::synchronize()
            .map_err(|e| Error::Cuda(format!("cuCtxSynchronize on cuda:{d}: {e}")))?;
    }
    let mut registered = Vec::new();
    if Path::new(NVIDIA_FS).exists() {
        for &dest in &dests {
            let (device, ptr, len) = cuda_target(dest)?;
            // SAFETY: the target is live device memory for the whole run (our contract),
            // and the registration is dropped before we return.
            match unsafe { BufRegistration::new(drv, Context::get(device)?, ptr, len) } {
                Ok(r) => registered.push(r),
                Err(e) => log::debug!("destination {dest} ({len} bytes) not registered: {e}"),
            }
        }
    }
    let next = AtomicUsize::new(0);
    let worker = || {
        let mut bound = None;
        while !ctl.should_stop() {
            let Some(c) = work.get(next.fetch_add(1, Ordering::Relaxed)) else {
                break;
            };
            let r = cuda_target(c.dest).and_then(|(device, ptr, _)| {
                if bound != Some(device) {
                    Context::get(device)?.bind()?;
                    bound = Some(device);
                }
                let h = handles[c.file].as_ref().expect("registered above");
                // SAFETY: the chunk lies inside its target (checked by the caller), which
                // is device memory of the bound context, ours for the run.
                unsafe { h.read_exact(ptr, c.dest_offset, c.offset, c.len) }
            });
            if let Err(e) = r {
                ctl.fail(e);
                return;
            }
            ctl.add(c.len);
        }
    };
    super::pread::run_workers(threads.max(1).min(work.len()), &worker);
    drop(registered);
    drop(handles);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_match_cufile_h() {
        assert_eq!(std::mem::size_of::<CuFileError>(), 8);
        assert_eq!(std::mem::size_of::<CuFileDescr>(), 24);
        assert_eq!(std::mem::offset_of!(CuFileDescr, handle), 8);
        assert_eq!(std::mem::offset_of!(CuFileDescr, fs_ops), 16);
    }

    #[test]
    fn chunks_split_at_aligned_file_offsets() {
        let e = Extent {
            file: 0,
            offset: 100,
            len: 10_000,
            dest: 1,
            dest_offset: 7,
        };
        let c = chunks(&[e], 4096);
        assert_eq!(
            c.iter().map(|c| (c.offset, c.len)).collect::<Vec<_>>(),
            [(100, 3996), (4096, 4096), (8192, 1908)]
        );
        assert_eq!(c[1].dest_offset, 7 + 3996);
        assert_eq!(c.iter().map(|c| c.len).sum::<u64>(), 10_000);
        assert!(chunks(&[Extent { len: 0, ..e }], 4096).is_empty());
    }

    #[test]
    fn error_codes_are_named() {
        assert!(check(
            CuFileError {
                err: 5020,
                cu_err: 0
            },
            "x"
        )
        .unwrap_err()
        .to_string()
        .contains("CU_FILE_DIO_NOT_SET"));
        assert!(check(CuFileError { err: 0, cu_err: 0 }, "x").is_ok());
    }
}
