//! CUDA, loaded at run time through cudarc: whether a driver is here, its devices, and
//! GPUDirect Storage's state. No call reaches the driver before its library is found, so a
//! machine without CUDA gets an error, never a panic.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Mutex, OnceLock};
use std::thread::JoinHandle;

use cudarc::driver::{result, sys, DriverError};

use crate::device::staging::{Slot, StagingPool};
use crate::error::{Error, Result};
use crate::pipeline::{Sink, Target};
use crate::plan::Read;

/// Loads and initialises the driver once; `Err` when there is none.
pub fn init() -> Result<()> {
    static INIT: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: only tries to dlopen the library; calls nothing in it.
        if !unsafe { sys::is_culib_present() } {
            return Err("no CUDA driver found (libcuda.so could not be loaded)".to_string());
        }
        result::init().map_err(|e| format!("cuInit failed: {e}"))
    })
    .clone()
    .map_err(Error::Unsupported)
}

/// One GPU as the driver describes it.
#[derive(Debug, Clone)]
pub struct GpuInfo {
    /// Ordinal.
    pub ordinal: usize,
    /// Product name.
    pub name: String,
    /// Total memory in bytes.
    pub total_mem: u64,
}

/// The driver's version (e.g. 13000 for 13.0).
pub fn driver_version() -> Result<i32> {
    init()?;
    let mut v = 0;
    // SAFETY: the driver is initialised; `v` is a valid out-pointer.
    unsafe { sys::cuDriverGetVersion(&raw mut v) }
        .result()
        .map_err(|e| Error::Cuda(e.to_string()))?;
    Ok(v)
}

/// The GPUs the driver sees.
pub fn devices() -> Result<Vec<GpuInfo>> {
    init()?;
    let n = result::device::get_count().map_err(|e| Error::Cuda(e.to_string()))?;
    (0..n)
        .map(|i| {
            let dev = result::device::get(i).map_err(|e| Error::Cuda(e.to_string()))?;
            let name = result::device::get_name(dev).map_err(|e| Error::Cuda(e.to_string()))?;
            // SAFETY: `dev` is a valid device handle from the driver.
            let total_mem = unsafe { result::device::total_mem(dev) }
                .map_err(|e| Error::Cuda(e.to_string()))? as u64;
            Ok(GpuInfo {
                ordinal: usize::try_from(i).unwrap_or_default(),
                name,
                total_mem,
            })
        })
        .collect()
}

/// GPUDirect Storage as this machine has it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GdsState {
    /// libcufile is not installed.
    NoLibrary,
    /// libcufile is here but nvidia-fs is not loaded: cuFile would run in compatibility
    /// mode (through the page cache), slower than the staging pipeline.
    Compat,
    /// libcufile and nvidia-fs: reads can go from NVMe straight to GPU memory.
    Real,
}

/// Finds libcufile (`libcufile.so.0`, then `libcufile.so`) and whether nvidia-fs is loaded.
pub fn gds_state() -> GdsState {
    // SAFETY: loading a shared library runs its initialisers; libcufile's are benign.
    let lib = ["libcufile.so.0", "libcufile.so"]
        .iter()
        .any(|n| unsafe { libloading::Library::new(n) }.is_ok());
    if !lib {
        GdsState::NoLibrary
    } else if std::path::Path::new("/proc/driver/nvidia-fs").exists() {
        GdsState::Real
    } else {
        GdsState::Compat
    }
}

/// Turns a driver error into ours (out-of-memory gets its own kind).
fn cu(what: &str) -> impl Fn(DriverError) -> Error + '_ {
    move |e: DriverError| {
        if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
            Error::OutOfMemory(format!("{what}: {e}"))
        } else {
            Error::Cuda(format!("{what}: {e}"))
        }
    }
}

/// A device's primary context (the one PyTorch and the runtime API use), retained once
/// per process and never released, so tensors from PyTorch and this library share it.
#[derive(Debug)]
pub struct Context {
    ordinal: usize,
    ctx: sys::CUcontext,
}

// SAFETY: a CUcontext handle may be used from any thread (made current per thread).
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Context {
    /// The primary context of device `ordinal`.
    pub fn get(ordinal: usize) -> Result<&'static Context> {
        static CTXS: OnceLock<Mutex<HashMap<usize, &'static Context>>> = OnceLock::new();
        init()?;
        let mut map = CTXS
            .get_or_init(Default::default)
            .lock()
            .expect("context map");
        if let Some(c) = map.get(&ordinal) {
            return Ok(c);
        }
        let count = result::device::get_count().map_err(cu("cuDeviceGetCount"))?;
        if ordinal >= usize::try_from(count).unwrap_or(0) {
            return Err(Error::InvalidArgument(format!(
                "cuda:{ordinal}: only {count} CUDA device(s) here"
            )));
        }
        let dev = result::device::get(i32::try_from(ordinal).unwrap_or(i32::MAX))
            .map_err(cu("cuDeviceGet"))?;
        // SAFETY: `dev` comes from cuDeviceGet.
        let ctx =
            unsafe { result::primary_ctx::retain(dev) }.map_err(cu("cuDevicePrimaryCtxRetain"))?;
        let c: &'static Context = Box::leak(Box::new(Context { ordinal, ctx }));
        map.insert(ordinal, c);
        Ok(c)
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Makes this context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        // SAFETY: `ctx` is a retained primary context, valid for the process.
        unsafe { result::ctx::set_current(self.ctx) }.map_err(cu("cuCtxSetCurrent"))
    }

    /// `(free, total)` device memory in bytes.
    pub fn mem_info(&self) -> Result<(u64, u64)> {
        self.bind()?;
        let (free, total) = result::mem_get_info().map_err(cu("cuMemGetInfo"))?;
        Ok((free as u64, total as u64))
    }
}

/// An owned CUDA stream (non-blocking with respect to the legacy default stream).
pub struct Stream(sys::CUstream);

// SAFETY: stream handles are thread-safe in the driver API.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

impl Stream {
    /// A new stream in the current context.
    pub fn new() -> Result<Self> {
        result::stream::create(result::stream::StreamKind::NonBlocking)
            .map(Stream)
            .map_err(cu("cuStreamCreate"))
    }

    /// The raw handle.
    pub fn raw(&self) -> sys::CUstream {
        self.0
    }

    /// Waits for everything queued on the stream.
    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: a live stream.
        unsafe { result::stream::synchronize(self.0) }.map_err(cu("cuStreamSynchronize"))
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: our own stream, destroyed once; pending work completes first (driver).
        let _ = unsafe { result::stream::destroy(self.0) };
    }
}

/// An owned CUDA event (timing disabled).
pub struct Event(sys::CUevent);

// SAFETY: event handles are thread-safe in the driver API.
unsafe impl Send for Event {}

impl Event {
    fn new() -> Result<Self> {
        result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map(Event)
            .map_err(cu("cuEventCreate"))
    }
    fn record(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: live event and stream of the current context.
        unsafe { result::event::record(self.0, stream) }.map_err(cu("cuEventRecord"))
    }
    fn synchronize(&self) -> Result<()> {
        // SAFETY: a live event.
        unsafe { result::event::synchronize(self.0) }.map_err(cu("cuEventSynchronize"))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: our own event, destroyed once.
        let _ = unsafe { result::event::destroy(self.0) };
    }
}

/// Device memory allocated by this library (for Rust callers; Python callers give
/// tensors allocated by PyTorch). Freed on drop.
pub struct DeviceBuffer {
    ctx: &'static Context,
    ptr: sys::CUdeviceptr,
    len: usize,
}

// SAFETY: a device address; the driver API is thread-safe.
unsafe impl Send for DeviceBuffer {}
// SAFETY: as above.
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// Allocates `len` bytes on `ctx`'s device.
    pub fn alloc(ctx: &'static Context, len: usize) -> Result<Self> {
        ctx.bind()?;
        // SAFETY: context bound; a zero-byte request is bumped to one byte.
        let ptr = unsafe { result::malloc_sync(len.max(1)) }.map_err(cu(&format!(
            "allocating {len} bytes on cuda:{}",
            ctx.ordinal
        )))?;
        Ok(Self { ctx, ptr, len })
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `src` (pageable host memory) into the start of the buffer, synchronously.
    pub fn copy_from_host(&mut self, src: &[u8]) -> Result<()> {
        if src.len() > self.len {
            return Err(Error::InvalidArgument(format!(
                "{} bytes do not fit a {}-byte buffer",
                src.len(),
                self.len
            )));
        }
        self.ctx.bind()?;
        if !src.is_empty() {
            // SAFETY: the buffer is live and at least `src.len()` bytes long.
            unsafe { result::memcpy_htod_sync(self.ptr, src) }.map_err(cu("cuMemcpyHtoD"))?;
        }
        Ok(())
    }

    /// Copies the buffer to host memory (synchronously).
    pub fn to_host(&self) -> Result<Vec<u8>> {
        self.ctx.bind()?;
        let mut out = vec![0u8; self.len];
        if self.len > 0 {
            // SAFETY: `out` has `len` bytes; the buffer is live and `len` long.
            unsafe { result::memcpy_dtoh_sync(&mut out, self.ptr) }.map_err(cu("cuMemcpyDtoH"))?;
        }
        Ok(out)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            // SAFETY: our own allocation, freed once.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// Page-locks the staging pool's memory with `cuMemHostRegister` (once per pool), so
/// host-to-device copies from it run at full PCIe speed and asynchronously.
pub fn register_pool(pool: &StagingPool) -> Result<()> {
    init()?;
    pool.populate();
    pool.register_once(|ptr, len| {
        let t = std::time::Instant::now();
        // Registration needs a current context; the pool is portable across devices.
        Context::get(0)?.bind()?;
        // SAFETY: `ptr..ptr+len` is the pool's live anonymous mapping.
        unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE) }
            .result()
            .map_err(cu(&format!("registering {len} bytes of staging memory")))?;
        log::debug!(
            "registered {len} bytes of staging memory in {:.1} ms",
            t.elapsed().as_secs_f64() * 1e3
        );
        let addr = ptr as usize;
        Ok(Box::new(move || {
            // SAFETY: unregistering the registration made above, once, before unmapping.
            let _ = unsafe { sys::cuMemHostUnregister(addr as *mut std::ffi::c_void) }.result();
        }))
    })
}

/// The copy stage for CUDA destinations: `cuMemcpyHtoDAsync` from the slot into every
/// destination piece, on a few streams, then an event; a reclaimer thread (started on the
/// first slot) gives each slot back to the pool when its event completes. `finish` waits
/// for all copies. Streams and events are reused across loads (kept per device).
pub struct CudaSink<'a> {
    ctx: &'static Context,
    targets: &'a [Target],
    streams: Vec<Stream>,
    next: AtomicUsize,
    state: Mutex<Reclaim>,
}

#[derive(Default)]
struct Reclaim {
    tx: Option<Sender<(Event, Slot)>>,
    handle: Option<JoinHandle<Result<()>>>,
    finished: bool,
}

/// Streams and events kept per device between loads (creating them costs more than a
/// small load).
#[derive(Default)]
struct Spares {
    streams: Mutex<Vec<Stream>>,
    events: Mutex<Vec<Event>>,
}

fn spares(ordinal: usize) -> &'static Spares {
    static SPARES: OnceLock<Mutex<HashMap<usize, &'static Spares>>> = OnceLock::new();
    let mut map = SPARES
        .get_or_init(Default::default)
        .lock()
        .expect("spares map");
    map.entry(ordinal)
        .or_insert_with(|| Box::leak(Box::default()))
}

impl<'a> CudaSink<'a> {
    /// A sink into `targets` (all on device `ordinal`) using `streams` streams. If
    /// `after` is given (the caller's stream), copies start only after the work already
    /// queued on it, so memory the caller's allocator just reused is safe to overwrite.
    pub fn new(
        ordinal: usize,
        targets: &'a [Target],
        streams: usize,
        after: Option<sys::CUstream>,
    ) -> Result<Self> {
        for t in targets {
            match t {
                Target::Cuda { device, .. } if *device == ordinal => {}
                _ => {
                    return Err(Error::InvalidArgument(format!(
                        "CUDA sink for cuda:{ordinal} given another target"
                    )))
                }
            }
        }
        let ctx = Context::get(ordinal)?;
        ctx.bind()?;
        let spare = spares(ordinal);
        let mut mine = Vec::with_capacity(streams.max(1));
        {
            let mut pool = spare.streams.lock().expect("stream pool");
            while mine.len() < streams.max(1) {
                match pool.pop() {
                    Some(s) => mine.push(s),
                    None => break,
                }
            }
        }
        while mine.len() < streams.max(1) {
            mine.push(Stream::new()?);
        }
        let sink = Self {
            ctx,
            targets,
            streams: mine,
            next: AtomicUsize::new(0),
            state: Mutex::new(Reclaim::default()),
        };
        if let Some(caller) = after {
            let ev = sink.event()?;
            ev.record(caller)?;
            for s in &sink.streams {
                // SAFETY: live stream and event of the current context.
                unsafe {
                    result::stream::wait_event(
                        s.raw(),
                        ev.0,
                        sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                    )
                }
                .map_err(cu("cuStreamWaitEvent"))?;
            }
            spare.events.lock().expect("event pool").push(ev);
        }
        Ok(sink)
    }

    fn event(&self) -> Result<Event> {
        match spares(self.ctx.ordinal)
            .events
            .lock()
            .expect("event pool")
            .pop()
        {
            Some(e) => Ok(e),
            None => Event::new(),
        }
    }

    /// Hands `(event, slot)` to the reclaimer, starting it on first use.
    fn reclaim_later(&self, event: Event, slot: Slot) -> Result<()> {
        let mut st = self.state.lock().expect("reclaim state");
        if st.finished {
            event.synchronize()?;
            return Ok(());
        }
        if st.tx.is_none() {
            let (tx, rx) = channel::<(Event, Slot)>();
            let ctx = self.ctx;
            let handle = std::thread::Builder::new()
                .name("tensorferry-reclaim".into())
                .spawn(move || -> Result<()> {
                    ctx.bind()?;
                    let spare = spares(ctx.ordinal);
                    let mut first_err = None;
                    for (event, slot) in rx {
                        // The slot goes back only once the copies reading it are done.
                        if let Err(e) = event.synchronize() {
                            first_err.get_or_insert(e);
                            // Never hand back a slot a failed context may still read.
                            std::mem::forget(slot);
                            continue;
                        }
                        drop(slot);
                        spare.events.lock().expect("event pool").push(event);
                    }
                    first_err.map_or(Ok(()), Err)
                })
                .map_err(|e| Error::Unsupported(format!("spawning the reclaimer thread: {e}")))?;
            st.tx = Some(tx);
            st.handle = Some(handle);
        }
        st.tx
            .as_ref()
            .expect("reclaimer started")
            .send((event, slot))
            .map_err(|_| Error::Cuda("reclaimer thread stopped".into()))
    }
}

impl Sink for CudaSink<'_> {
    fn deliver(&self, read: &Read, mut slot: Slot) -> Result<()> {
        self.ctx.bind()?;
        let stream = &self.streams[self.next.fetch_add(1, Ordering::Relaxed) % self.streams.len()];
        let base = slot.as_mut_ptr();
        let mut result = Ok(());
        for p in &read.pieces {
            let Target::Cuda { ptr, .. } = self.targets[p.dest] else {
                unreachable!("checked in new")
            };
            // SAFETY: the source lies inside the slot (plan invariant), the destination
            // range was checked against the target's length, and the slot is kept until
            // the event recorded after these copies completes.
            let r = unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    ptr + p.dest_offset,
                    base.add(p.buf_offset as usize).cast(),
                    p.len as usize,
                    stream.raw(),
                )
            }
            .result()
            .map_err(cu("cuMemcpyHtoDAsync"));
            if r.is_err() {
                result = r;
                break;
            }
        }
        let event = self.event();
        match event.and_then(|ev| ev.record(stream.raw()).and(result).map(|()| ev)) {
            Ok(ev) => self.reclaim_later(ev, slot),
            Err(e) => {
                // Some copies may be queued: wait for them before the slot can go back.
                let _ = stream.synchronize();
                Err(e)
            }
        }
    }

    fn host_ptr(&self, _dest: usize, _offset: u64) -> Option<*mut u8> {
        None
    }

    fn finish(&self) -> Result<()> {
        let handle = {
            let mut st = self.state.lock().expect("reclaim state");
            st.finished = true;
            drop(st.tx.take());
            st.handle.take()
        };
        let reclaimed = match handle {
            Some(h) => h
                .join()
                .map_err(|_| Error::Cuda("reclaimer thread panicked".into()))?,
            None => Ok(()),
        };
        self.ctx.bind()?;
        for s in &self.streams {
            s.synchronize()?;
        }
        reclaimed
    }
}

impl Drop for CudaSink<'_> {
    fn drop(&mut self) {
        if self.finish().is_ok() {
            // Idle and healthy: keep the streams for the next load.
            spares(self.ctx.ordinal)
                .streams
                .lock()
                .expect("stream pool")
                .append(&mut self.streams);
        }
    }
}

// --- device-to-host copies (the store path) ----------------------------------------

impl Event {
    /// A new event (timing disabled) in the current context.
    pub fn create() -> Result<Self> {
        Self::new()
    }

    /// Records the event on `stream` (of the current context).
    pub fn record_on(&self, stream: &Stream) -> Result<()> {
        self.record(stream.raw())
    }

    /// Blocks until the work queued before the event's record has completed.
    pub fn wait(&self) -> Result<()> {
        self.synchronize()
    }
}

/// Queues a copy of `len` bytes from device address `src` to host memory `dst` on
/// `stream` (`cuMemcpyDtoHAsync`). The copy is asynchronous when `dst` is page-locked
/// (e.g. a staging pool given to [`register_pool`]).
///
/// # Safety
/// `src` must be device memory valid for reads of `len` bytes, and `dst` host memory valid
/// for writes of `len` bytes, both until the copy completes (wait on the stream or on an
/// event recorded after it). The stream's context must be current.
pub unsafe fn copy_dtoh_async(dst: *mut u8, src: u64, len: usize, stream: &Stream) -> Result<()> {
    // SAFETY: forwarded from this function's contract.
    unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, stream.raw()) }
        .result()
        .map_err(cu("cuMemcpyDtoHAsync"))
}

impl DeviceBuffer {
    /// The ordinal of the device holding the buffer.
    pub fn device(&self) -> usize {
        self.ctx.ordinal
    }
}
