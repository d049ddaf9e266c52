//! The write engine, the read pipeline run backwards: a file laid out as segments (host or
//! device memory at file offsets) is planned into writes, which a pool of writer threads
//! runs. Host memory is written straight from where it lies (buffered files) or gathered
//! into staging slots (`O_DIRECT` files, which need aligned buffers, offsets and lengths);
//! device memory is copied into staging slots by a [`DeviceCopier`] (the device-to-host
//! stage) that runs ahead of the writers, so copies and writes overlap. Memory stays
//! bounded by the pool.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::mpsc;
use std::sync::Mutex;

use bytes::Bytes;

use super::{Control, DIRECT_ALIGN};
use crate::checksum::RangeHasher;
use crate::device::staging::{Slot, StagingPool};
use crate::error::{Error, Result};
use crate::settings;
use crate::source::object::Upload;

/// Where a segment's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Src {
    /// Host memory.
    Host(*const u8),
    /// Device memory (a CUDA device ordinal and address).
    Device {
        /// Device ordinal.
        device: usize,
        /// Device address.
        ptr: u64,
    },
}

impl Src {
    /// The address `by` bytes further.
    #[must_use]
    pub fn offset(self, by: u64) -> Src {
        match self {
            // `wrapping_add`: the caller's contract makes the result in bounds.
            Src::Host(p) => Src::Host(p.wrapping_add(by as usize)),
            Src::Device { device, ptr } => Src::Device {
                device,
                ptr: ptr + by,
            },
        }
    }

    /// Whether the bytes are in device memory.
    pub fn is_device(self) -> bool {
        matches!(self, Src::Device { .. })
    }
}

// SAFETY: a Src is an address; whoever plans writes from it promises it stays valid and
// unchanged for the run (see `run`).
unsafe impl Send for Src {}
// SAFETY: as above.
unsafe impl Sync for Src {}

/// `len` bytes of memory at `src` that go to the file at `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// File offset of the first byte.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// Where the bytes are.
    pub src: Src,
}

/// Part of a staged write: `len` bytes from `src` to `slot_offset` in the slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Where the bytes are.
    pub src: Src,
    /// Offset in the staging slot.
    pub slot_offset: usize,
    /// Length in bytes.
    pub len: usize,
}

/// One write of the plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Write {
    /// A buffered `pwrite` straight from host memory.
    Host {
        /// File offset.
        offset: u64,
        /// First byte.
        ptr: *const u8,
        /// Length in bytes.
        len: usize,
    },
    /// Pieces gathered into a staging slot, then written with one `pwrite` of `padded`
    /// bytes (`len` rounded up to [`DIRECT_ALIGN`] for `O_DIRECT`; bytes no piece covers
    /// are zeros).
    Staged {
        /// File offset.
        offset: u64,
        /// Bytes of the file this write fills.
        len: usize,
        /// Bytes written (`len`, or `len` rounded up for `O_DIRECT`).
        padded: usize,
        /// What goes where in the slot, sorted by slot offset.
        pieces: Vec<Piece>,
    },
}

// SAFETY: as for `Src`.
unsafe impl Send for Write {}
// SAFETY: as for `Src`.
unsafe impl Sync for Write {}

impl Write {
    /// Bytes of the file this write fills.
    pub fn len(&self) -> usize {
        match self {
            Write::Host { len, .. } | Write::Staged { len, .. } => *len,
        }
    }

    /// Whether the write is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// File offset of its first byte.
    pub fn offset(&self) -> u64 {
        match self {
            Write::Host { offset, .. } | Write::Staged { offset, .. } => *offset,
        }
    }
}

/// How to plan the writes of a file.
#[derive(Debug, Clone, Copy)]
pub struct WritePlan {
    /// `O_DIRECT`: every write staged, at offsets and of lengths aligned to 4 KiB (the last
    /// one padded); the segments must start at offset 0.
    pub direct: bool,
    /// Staging slot size (a multiple of 4 KiB).
    pub slot_size: usize,
    /// Largest buffered write straight from host memory (split for parallelism).
    pub max_host_write: usize,
}

/// Plans the writes of `segments` (sorted by offset, not overlapping).
///
/// Buffered: host segments are written where they lie, in pieces of at most
/// `max_host_write`; runs of adjacent device segments are packed into staging slots.
/// `O_DIRECT`: the file is cut into slot-sized writes at multiples of the slot size, each
/// gathered from the segments it covers; the last one is padded to 4 KiB.
pub fn plan(segments: &[Segment], opts: WritePlan) -> Vec<Write> {
    let slot = opts.slot_size.max(DIRECT_ALIGN as usize);
    let segments: Vec<&Segment> = segments.iter().filter(|s| s.len > 0).collect();
    if opts.direct {
        plan_direct(&segments, slot)
    } else {
        plan_buffered(&segments, slot, opts.max_host_write.max(1))
    }
}

fn plan_direct(segments: &[&Segment], slot: usize) -> Vec<Write> {
    debug_assert!(slot.is_multiple_of(DIRECT_ALIGN as usize));
    let end = segments.iter().map(|s| s.offset + s.len).max().unwrap_or(0);
    let mut out = Vec::new();
    let mut first = 0; // first segment that may overlap the current chunk
    let mut start = 0u64;
    while start < end {
        let stop = (start + slot as u64).min(end);
        let mut pieces = Vec::new();
        while first < segments.len() && segments[first].offset + segments[first].len <= start {
            first += 1;
        }
        for s in &segments[first..] {
            if s.offset >= stop {
                break;
            }
            let a = s.offset.max(start);
            let b = (s.offset + s.len).min(stop);
            if a < b {
                pieces.push(Piece {
                    src: s.src.offset(a - s.offset),
                    slot_offset: (a - start) as usize,
                    len: (b - a) as usize,
                });
            }
        }
        let len = (stop - start) as usize;
        out.push(Write::Staged {
            offset: start,
            len,
            padded: len.next_multiple_of(DIRECT_ALIGN as usize),
            pieces,
        });
        start = stop;
    }
    out
}

fn plan_buffered(segments: &[&Segment], slot: usize, max_host: usize) -> Vec<Write> {
    let mut out = Vec::new();
    // The staged write being packed: (offset, len, pieces).
    let mut cur: Option<(u64, usize, Vec<Piece>)> = None;
    let close = |cur: &mut Option<(u64, usize, Vec<Piece>)>, out: &mut Vec<Write>| {
        if let Some((offset, len, pieces)) = cur.take() {
            out.push(Write::Staged {
                offset,
                len,
                padded: len,
                pieces,
            });
        }
    };
    for s in segments {
        match s.src {
            Src::Host(ptr) => {
                close(&mut cur, &mut out);
                let mut done = 0u64;
                while done < s.len {
                    let n = (s.len - done).min(max_host as u64);
                    out.push(Write::Host {
                        offset: s.offset + done,
                        ptr: ptr.wrapping_add(done as usize),
                        len: n as usize,
                    });
                    done += n;
                }
            }
            Src::Device { .. } => {
                let mut done = 0u64;
                while done < s.len {
                    let at = s.offset + done;
                    let fits = cur
                        .as_ref()
                        .is_some_and(|(o, l, _)| o + *l as u64 == at && *l < slot);
                    if !fits {
                        close(&mut cur, &mut out);
                        cur = Some((at, 0, Vec::new()));
                    }
                    let (_, len, pieces) = cur.as_mut().expect("a write in progress");
                    let n = (s.len - done).min((slot - *len) as u64) as usize;
                    pieces.push(Piece {
                        src: s.src.offset(done),
                        slot_offset: *len,
                        len: n,
                    });
                    *len += n;
                    done += n as u64;
                }
            }
        }
    }
    close(&mut cur, &mut out);
    out
}

/// A device-to-host copy in flight; `wait` returns once its bytes are in the slot.
pub trait Pending: Send {
    /// Waits for the copies. On error the slot may still be written to by the device and
    /// must never be reused.
    fn wait(self: Box<Self>) -> Result<()>;
}

/// The device-to-host stage: queues copies of device pieces into a slot.
pub trait DeviceCopier: Sync {
    /// Queues a copy of each piece (all with device sources) to `base + piece.slot_offset`.
    /// On error, every copy it queued has completed or was never queued.
    fn queue(&self, pieces: &[Piece], base: *mut u8) -> Result<Box<dyn Pending>>;
}

/// The file written to, and the path named in errors.
#[derive(Clone, Copy)]
pub struct Dest<'a> {
    /// The open file (with `O_DIRECT` when the plan is).
    pub file: &'a File,
    /// The path errors name.
    pub path: &'a Path,
}

struct Job {
    write: usize,
    slot: Option<Slot>,
    pending: Option<Box<dyn Pending>>,
}

/// Runs `writes` into `dest` on `threads` writer threads; the calling thread gathers:
/// it takes a slot for each staged write (waiting while the pool is empty: memory stays
/// bounded), queues the device copies of it and hands it to the writers, which copy the
/// host pieces, wait for the device copies and write. Stops at the first error (recorded
/// in `ctl`); every slot is back in the pool (or, after a device error, leaked) when this
/// returns. With a `hasher`, each write's bytes (from host memory, or from the slot once
/// gathered) are fed to it at their file offsets, in whatever order the writers finish.
///
/// # Safety
/// Every source of `writes` must be valid for reads of its length, and unchanged, until
/// this returns.
pub unsafe fn run(
    dest: Dest<'_>,
    writes: &[Write],
    pool: &StagingPool,
    threads: usize,
    copier: Option<&dyn DeviceCopier>,
    hasher: Option<&RangeHasher>,
    ctl: &Control,
) {
    if writes.is_empty() {
        return;
    }
    let (tx, rx) = mpsc::channel::<Job>();
    let rx = Mutex::new(rx);
    let worker = || loop {
        let Ok(job) = rx.lock().expect("writer queue").recv() else {
            return;
        };
        // SAFETY: forwarded from this function's contract.
        if let Err(e) = unsafe { write_one(dest, &writes[job.write], job, hasher, ctl) } {
            ctl.fail(e);
        }
    };
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, writes.len()) {
            s.spawn(worker);
        }
        for (i, w) in writes.iter().enumerate() {
            if ctl.should_stop() {
                break;
            }
            let job = match gather(w, i, pool, copier) {
                Ok(job) => job,
                Err(e) => {
                    ctl.fail(e);
                    break;
                }
            };
            if tx.send(job).is_err() {
                break;
            }
        }
        drop(tx);
    });
}

/// Takes a slot for a staged write and queues its device copies.
fn gather(
    w: &Write,
    index: usize,
    pool: &StagingPool,
    copier: Option<&dyn DeviceCopier>,
) -> Result<Job> {
    let Write::Staged { padded, pieces, .. } = w else {
        return Ok(Job {
            write: index,
            slot: None,
            pending: None,
        });
    };
    let mut slot = pool.acquire();
    if *padded > slot.capacity() {
        return Err(Error::InvalidArgument(format!(
            "write of {padded} bytes exceeds the staging slot ({} bytes)",
            slot.capacity()
        )));
    }
    let device: Vec<Piece> = pieces
        .iter()
        .filter(|p| p.src.is_device())
        .copied()
        .collect();
    let pending = if device.is_empty() {
        None
    } else {
        let copier = copier.ok_or_else(|| {
            Error::InvalidArgument("device memory to write but no device copier".into())
        })?;
        Some(copier.queue(&device, slot.as_mut_ptr())?)
    };
    Ok(Job {
        write: index,
        slot: Some(slot),
        pending,
    })
}

/// Finishes one write: waits for its device copies, copies its host pieces, zeroes the
/// bytes no piece covers, writes.
///
/// # Safety
/// As [`run`].
unsafe fn write_one(
    dest: Dest<'_>,
    w: &Write,
    job: Job,
    hasher: Option<&RangeHasher>,
    ctl: &Control,
) -> Result<()> {
    let Job {
        mut slot, pending, ..
    } = job;
    if let Some(p) = pending {
        if let Err(e) = p.wait() {
            // The device may still write into the slot: never hand it back.
            std::mem::forget(slot.take());
            return Err(e);
        }
    }
    if ctl.should_stop() {
        return Ok(());
    }
    match w {
        Write::Host { offset, ptr, len } => {
            // SAFETY: the source is valid for `len` bytes (this function's contract).
            let data = unsafe { std::slice::from_raw_parts(*ptr, *len) };
            write_all_at(dest, data, *offset)?;
            if let Some(h) = hasher {
                h.feed(*offset, data);
            }
        }
        Write::Staged {
            offset,
            len,
            padded,
            pieces,
        } => {
            let mut slot = slot.expect("staged writes hold a slot");
            let buf = &mut slot.as_mut_slice()[..*padded];
            // SAFETY: forwarded from this function's contract.
            unsafe { fill_host_pieces(buf, pieces) };
            write_all_at(dest, buf, *offset)?;
            if let Some(h) = hasher {
                h.feed(*offset, &buf[..*len]);
            }
            debug_assert!(*len <= *padded);
        }
    }
    ctl.add(w.len() as u64);
    Ok(())
}

/// Copies the host pieces into `buf` (a slot) and zeroes the bytes no piece covers.
///
/// # Safety
/// Every host source of `pieces` must be valid for reads of its length.
unsafe fn fill_host_pieces(buf: &mut [u8], pieces: &[Piece]) {
    let mut covered = 0;
    for p in pieces {
        buf[covered..p.slot_offset].fill(0);
        if let Src::Host(src) = p.src {
            // SAFETY: the source is valid for `p.len` bytes (this function's contract);
            // the destination is inside the slot (planned so).
            let from = unsafe { std::slice::from_raw_parts(src, p.len) };
            buf[p.slot_offset..p.slot_offset + p.len].copy_from_slice(from);
        }
        covered = p.slot_offset + p.len;
    }
    buf[covered..].fill(0);
}

/// The first `len` bytes of a slot as [`Bytes`]; the slot returns to its pool when the
/// last clone is dropped (once the part holding it has been sent).
pub fn slot_bytes(slot: Slot, len: usize) -> Bytes {
    struct Owner(Slot, usize);
    impl AsRef<[u8]> for Owner {
        fn as_ref(&self) -> &[u8] {
            &self.0.as_slice()[..self.1]
        }
    }
    Bytes::from_owner(Owner(slot, len))
}

/// Slots gathered into the parts of a multipart upload. When the slots an upload may
/// hold make a part of [`settings::UPLOAD_PART_SIZE`], parts are sent from the slots
/// themselves (no copy; at most `pool slots / slots per part` parts in flight, so memory
/// stays bounded by the pool). A pool too small for that (S3 refuses parts under
/// 5 MiB but the last) has parts gathered in a heap buffer instead, two in flight.
pub struct Parts<'u> {
    upload: &'u mut Upload,
    zero_copy: bool,
    target: usize,
    in_flight: usize,
    chunks: Vec<Bytes>,
    heap: Vec<u8>,
    len: usize,
}

impl<'u> Parts<'u> {
    /// Parts of `upload` from slots of `slot_size` bytes of a pool of `pool_slots`, of
    /// which this upload may hold `share` while gathering a part (so that gathering never
    /// deadlocks).
    pub fn new(upload: &'u mut Upload, slot_size: usize, pool_slots: usize, share: usize) -> Self {
        let want = (settings::UPLOAD_PART_SIZE as usize).div_ceil(slot_size.max(1));
        let zero_copy = want <= share.max(1);
        if !zero_copy {
            log::debug!(
                "staging too small for {} MiB parts: gathering parts in memory",
                settings::UPLOAD_PART_SIZE >> 20
            );
        }
        Self {
            upload,
            zero_copy,
            target: if zero_copy {
                want * slot_size
            } else {
                settings::UPLOAD_PART_SIZE as usize
            },
            in_flight: if zero_copy {
                (pool_slots / want).max(1)
            } else {
                2
            },
            chunks: Vec::new(),
            heap: Vec::new(),
            len: 0,
        }
    }

    /// How many slots to gather at once (device copies of them overlap).
    pub fn slots_per_gather(&self, slot_size: usize) -> usize {
        if self.zero_copy {
            self.target / slot_size.max(1)
        } else {
            1
        }
    }

    /// Adds the first `len` bytes of `slot`; sends a part when one is full.
    pub fn push(&mut self, slot: Slot, len: usize) -> Result<()> {
        if self.zero_copy {
            self.chunks.push(slot_bytes(slot, len));
        } else {
            if self.heap.is_empty() {
                self.heap.reserve(self.target);
            }
            self.heap.extend_from_slice(&slot.as_slice()[..len]);
        }
        self.len += len;
        if self.len >= self.target {
            self.send()?;
        }
        Ok(())
    }

    fn send(&mut self) -> Result<()> {
        self.len = 0;
        if self.zero_copy {
            self.upload
                .put_chunks(std::mem::take(&mut self.chunks), self.in_flight)
        } else {
            self.upload
                .put_part(std::mem::take(&mut self.heap), self.in_flight)
        }
    }

    /// Sends what is left as the last part.
    pub fn finish(mut self) -> Result<()> {
        if self.len > 0 {
            self.send()?;
        }
        Ok(())
    }
}

/// Runs `writes` (planned with [`WritePlan::direct`]: slot-sized staged writes in file
/// order) as the parts of an upload (see [`Parts`]): on the calling thread, a part's
/// worth of slots at a time are taken from `pool`, the device copies of each queued
/// (they overlap), the host pieces copied; each part is then sent in the background
/// while the next is gathered. Stops at the first error (recorded in `ctl`); the caller
/// then drops the upload, which aborts it.
///
/// # Safety
/// As [`run`].
pub unsafe fn run_upload(
    mut parts: Parts<'_>,
    writes: &[Write],
    pool: &StagingPool,
    copier: Option<&dyn DeviceCopier>,
    ctl: &Control,
) {
    let per = parts
        .slots_per_gather(pool.slot_size())
        .clamp(1, pool.count());
    for (g, group) in writes.chunks(per).enumerate() {
        if ctl.should_stop() {
            return;
        }
        let mut jobs = Vec::with_capacity(group.len());
        for (i, w) in group.iter().enumerate() {
            match gather(w, g * per + i, pool, copier) {
                Ok(job) => jobs.push(job),
                Err(e) => return ctl.fail(e),
            }
        }
        for (w, job) in group.iter().zip(jobs) {
            let Write::Staged { len, pieces, .. } = w else {
                return ctl.fail(Error::InvalidArgument(
                    "uploads are planned as staged writes".into(),
                ));
            };
            let Job { slot, pending, .. } = job;
            let mut slot = slot.expect("staged writes hold a slot");
            if let Some(p) = pending {
                if let Err(e) = p.wait() {
                    // The device may still write into the slot: never hand it back.
                    std::mem::forget(slot);
                    return ctl.fail(e);
                }
            }
            // SAFETY: forwarded from this function's contract.
            unsafe { fill_host_pieces(&mut slot.as_mut_slice()[..*len], pieces) };
            if let Err(e) = parts.push(slot, *len) {
                return ctl.fail(e);
            }
            ctl.add(*len as u64);
        }
    }
    if !ctl.should_stop() {
        if let Err(e) = parts.finish() {
            ctl.fail(e);
        }
    }
}

/// Writes all of `data` at `offset`, retrying on `EINTR` and short writes, or fails naming
/// the file and offset.
pub fn write_all_at(dest: Dest<'_>, data: &[u8], offset: u64) -> Result<()> {
    dest.file
        .write_all_at(data, offset)
        .map_err(|e| Error::io(dest.path, "write", offset, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(offset: u64, len: u64, base: usize) -> Segment {
        Segment {
            offset,
            len,
            src: Src::Host(base as *const u8),
        }
    }

    fn dev(offset: u64, len: u64, ptr: u64) -> Segment {
        Segment {
            offset,
            len,
            src: Src::Device { device: 0, ptr },
        }
    }

    /// Every file byte of `[0, end)` is covered exactly once, by the right source byte.
    fn check_cover(segments: &[Segment], writes: &[Write], end: u64) {
        let mut seen = vec![0u8; end as usize];
        for w in writes {
            match w {
                Write::Host { offset, ptr, len } => {
                    for i in 0..*len as u64 {
                        let at = offset + i;
                        let s = segments
                            .iter()
                            .find(|s| s.offset <= at && at < s.offset + s.len)
                            .unwrap();
                        assert_eq!(
                            s.src.offset(at - s.offset),
                            Src::Host(ptr.wrapping_add(i as usize))
                        );
                        seen[at as usize] += 1;
                    }
                }
                Write::Staged {
                    offset,
                    len,
                    padded,
                    pieces,
                } => {
                    assert!(len <= padded);
                    for p in pieces {
                        assert!(p.slot_offset + p.len <= *len);
                        for i in 0..p.len {
                            let at = offset + (p.slot_offset + i) as u64;
                            let s = segments
                                .iter()
                                .find(|s| s.offset <= at && at < s.offset + s.len)
                                .unwrap();
                            assert_eq!(s.src.offset(at - s.offset), p.src.offset(i as u64));
                            seen[at as usize] += 1;
                        }
                    }
                }
            }
        }
        assert!(
            seen.iter().all(|&n| n == 1),
            "bytes covered other than once"
        );
    }

    #[test]
    fn direct_plans_aligned_slot_writes_with_a_padded_tail() {
        let segs = [
            host(0, 24, 0x1000),
            dev(24, 9000, 0x10_0000),
            host(9024, 5, 0x2000),
            dev(9029, 0, 0x20_0000),
            dev(9029, 3, 0x30_0000),
        ];
        let writes = plan(
            &segs,
            WritePlan {
                direct: true,
                slot_size: 4096,
                max_host_write: 1 << 20,
            },
        );
        assert_eq!(writes.len(), 3);
        for (i, w) in writes.iter().enumerate() {
            let Write::Staged { offset, padded, .. } = w else {
                panic!("direct writes are staged")
            };
            assert_eq!(*offset, i as u64 * 4096);
            assert_eq!(*padded, 4096);
        }
        assert_eq!(writes[2].len(), 9032 - 8192);
        check_cover(&segs, &writes, 9032);
    }

    #[test]
    fn buffered_writes_host_in_place_and_packs_device_runs() {
        let segs = [
            host(0, 16, 0x1000),
            dev(16, 10, 0x10_0000),
            dev(26, 5000, 0x20_0000),
            dev(5026, 7, 0x30_0000),
            host(5033, 10_000, 0x40_0000),
            dev(15_033, 1, 0x50_0000),
        ];
        let writes = plan(
            &segs,
            WritePlan {
                direct: false,
                slot_size: 4096,
                max_host_write: 4000,
            },
        );
        check_cover(&segs, &writes, 15_034);
        let staged: Vec<_> = writes
            .iter()
            .filter(|w| matches!(w, Write::Staged { .. }))
            .collect();
        // 5017 device bytes in a row: two slots; then one lone byte.
        assert_eq!(staged.len(), 3);
        assert_eq!(staged[0].len(), 4096);
        assert_eq!(staged[1].len(), 5017 - 4096);
        let host_writes = writes
            .iter()
            .filter(|w| matches!(w, Write::Host { .. }))
            .count();
        assert_eq!(host_writes, 1 + 3);
        assert!(writes.iter().all(|w| match w {
            Write::Staged { len, padded, .. } => len == padded,
            Write::Host { len, .. } => *len <= 4000,
        }));
    }

    #[test]
    fn empty_plan() {
        for direct in [false, true] {
            let w = plan(
                &[host(0, 0, 0x1000)],
                WritePlan {
                    direct,
                    slot_size: 4096,
                    max_host_write: 10,
                },
            );
            assert!(w.is_empty());
        }
    }
}
