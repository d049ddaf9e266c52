//! CUDA, loaded at run time through cudarc: whether a driver is here, its devices, and
//! GPUDirect Storage's state. No call reaches the driver before its library is found, so a
//! machine without CUDA gets an error, never a panic.

use std::sync::OnceLock;

use cudarc::driver::{result, sys};

use crate::error::{Error, Result};

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
                ordinal: i as usize,
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
