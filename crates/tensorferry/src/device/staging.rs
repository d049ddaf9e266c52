//! The staging pool: a fixed set of page-aligned slots that reads land in before their
//! bytes are copied to the destination. Memory stays bounded by the pool.

use std::sync::{Arc, Condvar, Mutex};

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
}
