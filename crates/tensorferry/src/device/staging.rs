//! The staging pool: a fixed set of page-aligned slots that reads land in before their
//! bytes are copied to the destination. Memory stays bounded by the pool.

use std::sync::{Arc, Condvar, Mutex, Once};

use crate::device::host::AlignedBuf;
use crate::error::Result;

/// A bounded pool of equal, page-aligned slots carved from one anonymous mapping.
pub struct StagingPool {
    inner: Arc<Inner>,
}

struct Inner {
    // Kept for its memory; slots point into it.
    mem: Mutex<AlignedBuf>,
    base: *mut u8,
    slot_size: usize,
    count: usize,
    free: Mutex<Vec<usize>>,
    returned: Condvar,
    /// Undoes a driver registration (e.g. `cuMemHostUnregister`) before unmapping.
    unregister: Mutex<Option<Unregister>>,
    populated: Once,
}

/// Faults in `len` bytes at `addr` (inside the pool's mapping) for writing, keeping their
/// contents: `MADV_POPULATE_WRITE` (Linux 5.14), else an atomic no-op write per page.
fn populate_range(addr: usize, len: usize) {
    const MADV_POPULATE_WRITE: libc::c_int = 23;
    // SAFETY: advice on part of our own mapping; it changes no contents.
    if unsafe { libc::madvise(addr as *mut libc::c_void, len, MADV_POPULATE_WRITE) } != 0 {
        touch_pages(addr, len);
    }
}

/// The fallback of [`populate_range`]: a write fault per page that keeps its byte.
fn touch_pages(addr: usize, len: usize) {
    for page in (addr..addr + len).step_by(4096) {
        // SAFETY: `page` is inside the pool's live mapping; `fetch_or(0)` writes back the
        // byte it reads atomically, so a slot in use by another thread keeps its data.
        unsafe { std::sync::atomic::AtomicU8::from_ptr(page as *mut u8) }
            .fetch_or(0, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Undoes a registration of the pool's memory.
pub type Unregister = Box<dyn FnOnce() + Send>;

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(undo) = self.unregister.lock().map(|mut u| u.take()).ok().flatten() {
            undo();
        }
    }
}

// SAFETY: `base` points into `mem`, which lives as long as `Inner`; each slot's bytes are
// accessed only by the holder of its `Slot` guard.
unsafe impl Send for Inner {}
// SAFETY: as above.
unsafe impl Sync for Inner {}

impl StagingPool {
    /// A pool of `count` slots of `slot_size` bytes (rounded up to 4 KiB).
    pub fn new(slot_size: usize, count: usize) -> Result<Self> {
        let slot_size = slot_size.max(4096).next_multiple_of(4096);
        let count = count.max(1);
        let mut mem = AlignedBuf::zeroed(slot_size * count)?;
        let base = mem.as_mut_ptr();
        // Transparent huge pages make pinning (cuMemHostRegister, io_uring buffer
        // registration) much cheaper: a 2 MiB page is pinned as one. Advice only; the
        // pool works without it.
        // SAFETY: advice on our own mapping.
        unsafe { libc::madvise(base.cast(), slot_size * count, libc::MADV_HUGEPAGE) };
        Ok(Self {
            inner: Arc::new(Inner {
                mem: Mutex::new(mem),
                base,
                slot_size,
                count,
                free: Mutex::new((0..count).rev().collect()),
                returned: Condvar::new(),
                unregister: Mutex::new(None),
                populated: Once::new(),
            }),
        })
    }

    /// Size of each slot in bytes.
    pub fn slot_size(&self) -> usize {
        self.inner.slot_size
    }

    /// Number of slots.
    pub fn count(&self) -> usize {
        self.inner.count
    }

    /// Total bytes of the pool.
    pub fn bytes(&self) -> usize {
        self.inner.slot_size * self.inner.count
    }

    /// Base address and length of the whole pool (for registering it with a driver).
    pub fn region(&self) -> (*mut u8, usize) {
        let _keep = self.inner.mem.lock();
        (self.inner.base, self.bytes())
    }

    /// Backs the whole pool with memory now (once), from several threads, without
    /// changing its contents. Pinning (`cuMemHostRegister`, io_uring buffer registration)
    /// faults every page in one thread while it holds the driver's lock: on the H200
    /// machine 26-34 ms for 128 MiB, against 4 ms once the pages are present.
    pub fn populate(&self) {
        self.inner.populated.call_once(|| {
            let t = std::time::Instant::now();
            let len = self.bytes();
            let threads = std::thread::available_parallelism()
                .map_or(1, std::num::NonZero::get)
                .min(8)
                .min(len.div_ceil(8 << 20))
                .max(1);
            let chunk = len.div_ceil(threads).next_multiple_of(2 << 20);
            let base = self.inner.base as usize;
            std::thread::scope(|s| {
                for start in (0..len).step_by(chunk) {
                    let n = chunk.min(len - start);
                    s.spawn(move || populate_range(base + start, n));
                }
            });
            log::debug!(
                "populated {len} bytes of staging memory in {:.1} ms ({threads} threads)",
                t.elapsed().as_secs_f64() * 1e3
            );
        });
    }

    /// Registers the pool's memory with a driver once: `register(base, len)` runs on the
    /// first call only and returns what undoes it when the pool is freed. Later calls
    /// return `Ok` at once.
    pub fn register_once(
        &self,
        register: impl FnOnce(*mut u8, usize) -> Result<Unregister>,
    ) -> Result<()> {
        let mut slot = self.inner.unregister.lock().expect("staging pool lock");
        if slot.is_none() {
            *slot = Some(register(self.inner.base, self.bytes())?);
        }
        Ok(())
    }

    /// Address of slot `i` (for registering fixed buffers).
    pub fn slot_ptr(&self, i: usize) -> *mut u8 {
        assert!(i < self.inner.count);
        // SAFETY: i < count, so the offset is inside the mapping.
        unsafe { self.inner.base.add(i * self.inner.slot_size) }
    }

    /// Takes a slot, waiting until one is free.
    pub fn acquire(&self) -> Slot {
        let mut free = self.inner.free.lock().expect("staging pool lock");
        loop {
            if let Some(i) = free.pop() {
                return Slot {
                    inner: Arc::clone(&self.inner),
                    index: i,
                };
            }
            free = self.inner.returned.wait(free).expect("staging pool lock");
        }
    }

    /// Takes a slot if one is free now.
    pub fn try_acquire(&self) -> Option<Slot> {
        let mut free = self.inner.free.lock().expect("staging pool lock");
        free.pop().map(|i| Slot {
            inner: Arc::clone(&self.inner),
            index: i,
        })
    }

    /// Number of slots free now.
    pub fn available(&self) -> usize {
        self.inner.free.lock().expect("staging pool lock").len()
    }
}

/// Exclusive use of one slot; it returns to the pool when dropped. Whoever holds the
/// guard (a read in flight, a copy not yet complete) owns the slot's bytes.
pub struct Slot {
    inner: Arc<Inner>,
    index: usize,
}

impl Slot {
    /// The slot's index in its pool (its `io_uring` fixed-buffer index).
    pub fn index(&self) -> usize {
        self.index
    }

    /// Size of the slot in bytes.
    pub fn capacity(&self) -> usize {
        self.inner.slot_size
    }

    /// Pointer to the slot's first byte.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        // SAFETY: index < count, inside the mapping.
        unsafe { self.inner.base.add(self.index * self.inner.slot_size) }
    }

    /// The slot's bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the guard gives exclusive use of these bytes, which live as long as the
        // pool's mapping (kept alive by `inner`).
        unsafe {
            std::slice::from_raw_parts(
                self.inner.base.add(self.index * self.inner.slot_size),
                self.inner.slot_size,
            )
        }
    }

    /// The slot's bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let len = self.inner.slot_size;
        // SAFETY: as in `as_slice`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr(), len) }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut free = self.inner.free.lock().expect("staging pool lock");
        free.push(self.index);
        self.inner.returned.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_aligned_bounded_and_returned_on_drop() {
        let pool = StagingPool::new(5000, 2).unwrap();
        assert_eq!(pool.slot_size(), 8192);
        let mut a = pool.acquire();
        let b = pool.acquire();
        assert!(pool.try_acquire().is_none());
        assert_eq!(a.as_mut_ptr() as usize % 4096, 0);
        drop(b);
        assert_eq!(pool.available(), 1);
        let c = pool.try_acquire().unwrap();
        assert_ne!(c.index(), a.index());
    }

    #[test]
    fn populate_keeps_the_data_of_slots_in_use_and_big_pools_start_on_2_mib() {
        let pool = StagingPool::new(3 << 20, 3).unwrap();
        assert_eq!(pool.region().0 as usize % (2 << 20), 0);
        let mut a = pool.acquire();
        let pattern: Vec<u8> = (0..a.capacity()).map(|i| (i * 31 % 251) as u8).collect();
        a.as_mut_slice().copy_from_slice(&pattern);
        pool.populate();
        pool.populate();
        assert_eq!(a.as_slice(), &pattern[..]);
        // The fallback for kernels without MADV_POPULATE_WRITE keeps the data too.
        touch_pages(a.as_mut_ptr() as usize, a.capacity());
        assert_eq!(a.as_slice(), &pattern[..]);
        let b = pool.acquire();
        assert!(b.as_slice().iter().all(|&x| x == 0));
    }
}
