//! The pread engine: a pool of threads doing positioned reads, into staging slots or,
//! for host destinations read through the page cache, straight into the destination.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::{piece_bytes, Control, Deliver};
use crate::device::staging::StagingPool;
use crate::error::{Error, Result};
use crate::plan::{Piece, Read};
use crate::source::LocalFile;

/// Runs `reads` on `threads` threads, each read into a slot of `pool` and handed to
/// `deliver`. Stops at the first error (recorded in `ctl`).
pub fn run_staged(
    files: &[LocalFile],
    reads: &[Read],
    pool: &StagingPool,
    threads: usize,
    ctl: &Control,
    deliver: &Deliver,
) {
    let next = AtomicUsize::new(0);
    let worker = || {
        while !ctl.should_stop() {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(read) = reads.get(i) else { break };
            if let Err(e) = staged_one(&files[read.file], read, pool, deliver) {
                ctl.fail(e);
                break;
            }
            ctl.add(piece_bytes(read));
        }
    };
    run_workers(threads.min(reads.len()), &worker);
}

fn staged_one(file: &LocalFile, read: &Read, pool: &StagingPool, deliver: &Deliver) -> Result<()> {
    let mut slot = pool.acquire();
    let len = read.len as usize;
    if len > slot.capacity() {
        return Err(Error::InvalidArgument(format!(
            "read of {len} bytes exceeds the staging slot"
        )));
    }
    let got = file.read_at_most(&mut slot.as_mut_slice()[..len], read.offset)? as u64;
    if got < read.needed {
        return Err(Error::UnexpectedEof {
            path: file.path().to_path_buf(),
            at: read.offset + got,
            needed: read.needed - got,
        });
    }
    deliver(read, slot)
}

/// Runs `reads` on `threads` threads, reading each piece straight into the host memory
/// `dest_ptr` gives for it (no staging; buffered files only).
///
/// # Safety
/// `dest_ptr(piece)` must return memory valid for writes of `piece.len` bytes that no one
/// else accesses during the run.
pub unsafe fn run_direct_to_host(
    files: &[LocalFile],
    reads: &[Read],
    threads: usize,
    ctl: &Control,
    dest_ptr: &(dyn Fn(&Piece) -> *mut u8 + Sync),
) {
    let next = AtomicUsize::new(0);
    let worker = || {
        while !ctl.should_stop() {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(read) = reads.get(i) else { break };
            let file = &files[read.file];
            for p in &read.pieces {
                // SAFETY: the caller guarantees the destination range is valid and ours.
                let dst = unsafe { std::slice::from_raw_parts_mut(dest_ptr(p), p.len as usize) };
                if let Err(e) = file.read_exact_at(dst, read.offset + p.buf_offset) {
                    ctl.fail(e);
                    return;
                }
            }
            ctl.add(piece_bytes(read));
        }
    };
    run_workers(threads.min(reads.len()), &worker);
}

/// Runs `f` on `n` scoped threads (on the calling thread alone when `n <= 1`).
pub(crate) fn run_workers(n: usize, f: &(dyn Fn() + Sync)) {
    if n <= 1 {
        f();
        return;
    }
    std::thread::scope(|s| {
        for _ in 0..n {
            s.spawn(f);
        }
    });
}
