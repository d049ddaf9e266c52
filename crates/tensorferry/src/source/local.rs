//! Local files: open (buffered or `O_DIRECT`), size, page-cache residency, positioned reads.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// An open local file with its size.
#[derive(Debug)]
pub struct LocalFile {
    path: PathBuf,
    file: File,
    len: u64,
    direct: bool,
}

impl LocalFile {
    /// Opens `path` for buffered reads.
    pub fn open(path: &Path) -> Result<Self> {
        Self::open_with(path, false)
    }

    /// Opens `path` with `O_DIRECT` (reads must then be aligned to 4 KiB in offset, length
    /// and memory address).
    pub fn open_direct(path: &Path) -> Result<Self> {
        Self::open_with(path, true)
    }

    fn open_with(path: &Path, direct: bool) -> Result<Self> {
        let mut opts = OpenOptions::new();
        opts.read(true);
        if direct {
            opts.custom_flags(libc::O_DIRECT);
        }
        let file = opts.open(path).map_err(|e| Error::io(path, "open", 0, e))?;
        let meta = file.metadata().map_err(|e| Error::io(path, "stat", 0, e))?;
        if meta.is_dir() {
            return Err(Error::InvalidArgument(format!(
                "{} is a directory",
                path.display()
            )));
        }
        Ok(Self {
            path: path.to_path_buf(),
            file,
            len: meta.len(),
            direct,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's size when it was opened.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the file is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the file was opened with `O_DIRECT`.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// The underlying file.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Reads into `buf` at `offset` until `buf` is full or the file ends; returns the
    /// number of bytes read. Retries on `EINTR` and short reads.
    pub fn read_at_most(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        let mut done = 0;
        while done < buf.len() {
            match self.file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io(&self.path, "read", offset + done as u64, e)),
            }
        }
        Ok(done)
    }

    /// Reads exactly `buf.len()` bytes at `offset`, or fails naming the file and offset.
    pub fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let n = self.read_at_most(buf, offset)?;
        if n < buf.len() {
            return Err(Error::UnexpectedEof {
                path: self.path.clone(),
                at: offset + n as u64,
                needed: (buf.len() - n) as u64,
            });
        }
        Ok(())
    }

    /// Fraction (0.0-1.0) of the file's pages that are in the page cache, from `mincore`
    /// on a read-only mapping. Empty files count as resident.
    pub fn resident_fraction(&self) -> f64 {
        resident_fraction(&self.file, self.len)
    }

    /// Asks the kernel to drop this file's pages from the page cache (for cold-read
    /// benchmarks). Dirty pages are not dropped.
    pub fn drop_cache(&self) -> Result<()> {
        // SAFETY: plain syscall on an open descriptor.
        let rc =
            unsafe { libc::posix_fadvise(self.file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        if rc != 0 {
            return Err(Error::io(
                &self.path,
                "fadvise",
                0,
                std::io::Error::from_raw_os_error(rc),
            ));
        }
        Ok(())
    }
}

/// Fraction of `len` bytes of `file` resident in the page cache.
fn resident_fraction(file: &File, len: u64) -> f64 {
    if len == 0 {
        return 1.0;
    }
    let page = page_size();
    let map_len = len as usize;
    // SAFETY: a private read-only mapping of an open file; never dereferenced, only
    // passed to mincore and unmapped below.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        return 0.0;
    }
    let pages = map_len.div_ceil(page);
    // A full scan of a large file costs tens of milliseconds (a 4 GB file is a million
    // pages): look at RESIDENCY_WINDOWS evenly spaced windows instead, which is as good an
    // estimate for choosing an engine and costs well under a millisecond.
    let window_pages = if pages <= RESIDENCY_WINDOWS * RESIDENCY_WINDOW_PAGES {
        pages
    } else {
        RESIDENCY_WINDOW_PAGES
    };
    let windows = pages.div_ceil(window_pages).min(RESIDENCY_WINDOWS);
    let mut vec = vec![0u8; window_pages];
    let (mut seen, mut resident) = (0usize, 0usize);
    for w in 0..windows {
        let first = if windows == 1 {
            0
        } else {
            w * (pages - window_pages) / (windows - 1)
        };
        let n = window_pages.min(pages - first);
        // SAFETY: the window lies inside the mapping, and `vec` has a byte per page of it.
        let rc = unsafe {
            libc::mincore(
                addr.cast::<u8>().add(first * page).cast(),
                n * page,
                vec.as_mut_ptr(),
            )
        };
        if rc != 0 {
            seen = 0;
            break;
        }
        seen += n;
        resident += vec[..n].iter().filter(|&&b| b & 1 == 1).count();
    }
    // SAFETY: unmapping the mapping made above, exactly once.
    unsafe { libc::munmap(addr, map_len) };
    if seen == 0 {
        return 0.0;
    }
    resident as f64 / seen as f64
}

/// Windows sampled by the residency estimate.
const RESIDENCY_WINDOWS: usize = 64;
/// Pages per sampled window (256 KiB of 4 KiB pages).
const RESIDENCY_WINDOW_PAGES: usize = 64;

/// The system's page size.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(n).unwrap_or(4096).max(4096)
}

/// Whether the file system holding `path` accepts `O_DIRECT` reads (tmpfs, for one, does
/// not). Tries a real aligned read.
pub fn supports_direct(path: &Path) -> bool {
    let Ok(f) = LocalFile::open_direct(path) else {
        return false;
    };
    let Ok(mut buf) = crate::device::host::AlignedBuf::zeroed(4096) else {
        return false;
    };
    f.read_at_most(&mut buf, 0).is_ok()
}
