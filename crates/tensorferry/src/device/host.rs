//! Page-aligned host buffers that own their memory.

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use crate::error::{Error, Result};

/// A zero-initialised, page-aligned host buffer from an anonymous mapping. Its memory is
/// its own: dropping it frees it.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    map_len: usize,
}

// SAFETY: the buffer owns its mapping exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access is read-only through &[u8].
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A buffer of `len` zero bytes (pages are mapped lazily by the kernel). Buffers of
    /// 2 MiB or more start on a 2 MiB boundary, so that transparent huge pages can back
    /// all of them.
    pub fn zeroed(len: usize) -> Result<Self> {
        const HUGE: usize = 2 << 20;
        let map_len = len
            .max(1)
            .next_multiple_of(crate::source::local::page_size());
        let slack = if map_len >= HUGE { HUGE } else { 0 };
        // SAFETY: anonymous private mapping; the result is checked before use.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len + slack,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(Error::OutOfMemory(format!(
                "host buffer of {len} bytes: {}",
                std::io::Error::last_os_error()
            )));
        }
        let mut start = addr.cast::<u8>();
        if slack > 0 {
            // Trim the mapping to a 2 MiB-aligned `map_len` bytes.
            let head = start.align_offset(HUGE);
            // SAFETY: head and tail are the parts of our own new mapping outside
            // `start + head .. + map_len`; both lie within `map_len + slack` bytes.
            unsafe {
                if head > 0 {
                    libc::munmap(start.cast(), head);
                }
                let tail = slack - head;
                if tail > 0 {
                    libc::munmap(start.add(head + map_len).cast(), tail);
                }
                start = start.add(head);
            }
        }
        Ok(Self {
            ptr: NonNull::new(start).expect("mmap returned non-null"),
            len,
            map_len,
        })
    }

    /// Raw pointer to the first byte.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the mapping is at least `len` bytes, initialised (zero or written), and
        // lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping exactly once.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.map_len) };
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}
