//! The `io_uring` engine: `O_DIRECT` reads into registered staging slots, a deep queue
//! driven from one thread. A slot belongs to its read until the kernel's completion for it
//! is seen; on error the ring is drained before any slot goes back to the pool.

use std::os::unix::io::AsRawFd;
use std::sync::OnceLock;

use io_uring::{opcode, types, IoUring};

use super::{piece_bytes, Control, Deliver};
use crate::device::staging::{Slot, StagingPool};
use crate::error::{Error, Result};
use crate::plan::Read;
use crate::source::LocalFile;

/// Whether `io_uring` works here: probed once per process with a real read (ring set-up can
/// pass where reads are refused, e.g. under some sandboxes). `Err` says why not.
pub fn available() -> &'static std::result::Result<(), String> {
    static PROBE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    PROBE.get_or_init(|| {
        let r = probe();
        match &r {
            Ok(()) => log::debug!("io_uring: available"),
            Err(why) => log::debug!("io_uring unavailable, falling back to the pread pool: {why}"),
        }
        r
    })
}

fn probe() -> std::result::Result<(), String> {
    let file =
        std::fs::File::open("/proc/self/exe").map_err(|e| format!("open probe file: {e}"))?;
    let mut ring = IoUring::new(2).map_err(|e| format!("io_uring_setup: {e}"))?;
    let mut buf = vec![0u8; 64];
    let entry = opcode::Read::new(types::Fd(file.as_raw_fd()), buf.as_mut_ptr(), 64)
        .offset(0)
        .build();
    // SAFETY: `buf` and `file` outlive the completion, which is awaited right below.
    unsafe { ring.submission().push(&entry) }.map_err(|e| format!("push: {e}"))?;
    ring.submit_and_wait(1)
        .map_err(|e| format!("io_uring_enter: {e}"))?;
    let cqe = ring.completion().next().ok_or("no completion")?;
    if cqe.result() < 0 {
        return Err(format!(
            "probe read: {}",
            std::io::Error::from_raw_os_error(-cqe.result())
        ));
    }
    if buf[..4] != *b"\x7fELF" {
        return Err("probe read returned wrong bytes".into());
    }
    Ok(())
}

struct Op {
    read: usize,
    slot: Slot,
    done: u64,
}

/// Runs `reads` (4 KiB aligned, files opened with `O_DIRECT`) through one ring of `depth`
/// entries, each into a registered slot of `pool`, handing completed reads to `deliver`.
pub fn run(
    files: &[LocalFile],
    reads: &[Read],
    pool: &StagingPool,
    depth: u32,
    ctl: &Control,
    deliver: &Deliver,
) {
    // Completed reads go to a few delivery threads, so the copy out of the slot (a memcpy
    // for host destinations) never holds up reaping and resubmitting.
    let (tx, rx) = std::sync::mpsc::channel::<(usize, Slot)>();
    let rx = std::sync::Mutex::new(rx);
    std::thread::scope(|s| {
        for _ in 0..DELIVERY_THREADS.min(reads.len()).max(1) {
            s.spawn(|| loop {
                let msg = rx.lock().expect("delivery queue").recv();
                let Ok((i, slot)) = msg else { break };
                let read = &reads[i];
                if ctl.should_stop() {
                    continue; // drop the slot: its read is complete, nobody needs it
                }
                match deliver(read, slot) {
                    Ok(()) => ctl.add(piece_bytes(read)),
                    Err(e) => ctl.fail(e),
                }
            });
        }
        if let Err(e) = run_inner(files, reads, pool, depth, ctl, &tx) {
            ctl.fail(e);
        }
        drop(tx);
    });
}

/// Threads that copy completed reads out of their slots.
const DELIVERY_THREADS: usize = 4;

fn run_inner(
    files: &[LocalFile],
    reads: &[Read],
    pool: &StagingPool,
    depth: u32,
    ctl: &Control,
    deliver: &std::sync::mpsc::Sender<(usize, Slot)>,
) -> Result<()> {
    let depth = depth.clamp(1, 4096);
    let uring_err = |op: &'static str, e: std::io::Error| Error::Io {
        path: files
            .first()
            .map(|f| f.path().to_path_buf())
            .unwrap_or_default(),
        op,
        offset: 0,
        source: e,
    };
    let mut ring = IoUring::new(depth).map_err(|e| uring_err("io_uring_setup", e))?;
    pool.populate();
    let iovecs: Vec<libc::iovec> = (0..pool.count())
        .map(|i| libc::iovec {
            iov_base: pool.slot_ptr(i).cast(),
            iov_len: pool.slot_size(),
        })
        .collect();
    // SAFETY: the slots stay mapped for the pool's life, which outlasts the ring (dropped
    // at the end of this function).
    unsafe { ring.submitter().register_buffers(&iovecs) }
        .map_err(|e| uring_err("io_uring_register", e))?;

    let depth = depth as usize;
    let mut ops: Vec<Option<Op>> = (0..depth).map(|_| None).collect();
    let mut free_tokens: Vec<usize> = (0..depth).rev().collect();
    let mut in_flight = 0usize;
    let mut next = 0usize;
    let mut completions = Vec::with_capacity(depth);

    loop {
        let stopping = ctl.should_stop();
        // Fill the queue.
        while !stopping && next < reads.len() && !free_tokens.is_empty() {
            let slot = if in_flight == 0 {
                pool.acquire()
            } else if let Some(s) = pool.try_acquire() {
                s
            } else {
                break;
            };
            let token = free_tokens.pop().expect("free token");
            ops[token] = Some(Op {
                read: next,
                slot,
                done: 0,
            });
            submit(&mut ring, files, reads, &mut ops, token)?;
            next += 1;
            in_flight += 1;
        }
        if in_flight == 0 {
            break;
        }
        match ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                // Cannot drain a ring we cannot enter: leak the slots' guards rather than
                // hand back memory the kernel may still write.
                for op in ops.iter_mut().filter_map(Option::take) {
                    std::mem::forget(op.slot);
                }
                return Err(uring_err("io_uring_enter", e));
            }
        }
        completions.clear();
        completions.extend(
            ring.completion()
                .map(|c| (c.user_data() as usize, c.result())),
        );
        for &(token, res) in &completions {
            let got = u64::from(res.unsigned_abs());
            let mut op = ops[token].take().expect("completion for a known op");
            let read = &reads[op.read];
            let file = &files[read.file];
            let stopping = ctl.should_stop();
            if res < 0 {
                let err = std::io::Error::from_raw_os_error(-res);
                if !stopping && matches!(-res, libc::EINTR | libc::EAGAIN) {
                    ops[token] = Some(op);
                    submit(&mut ring, files, reads, &mut ops, token)?;
                    continue;
                }
                ctl.fail(Error::io(file.path(), "read", read.offset + op.done, err));
            } else if res == 0 || op.done + got >= read.len {
                op.done += got;
                if op.done < read.needed {
                    ctl.fail(Error::UnexpectedEof {
                        path: file.path().to_path_buf(),
                        at: read.offset + op.done,
                        needed: read.needed - op.done,
                    });
                } else if !stopping {
                    // The kernel is done with the slot: hand it on.
                    if deliver.send((op.read, op.slot)).is_err() {
                        ctl.fail(Error::InvalidArgument("delivery threads stopped".into()));
                    }
                    free_tokens.push(token);
                    in_flight -= 1;
                    continue;
                }
            } else {
                // Short read: ask for the rest.
                op.done += got;
                if !stopping {
                    ops[token] = Some(op);
                    submit(&mut ring, files, reads, &mut ops, token)?;
                    continue;
                }
            }
            // Failed or stopping: the completion has been seen, so the slot is free.
            free_tokens.push(token);
            in_flight -= 1;
        }
    }
    Ok(())
}

fn submit(
    ring: &mut IoUring,
    files: &[LocalFile],
    reads: &[Read],
    ops: &mut [Option<Op>],
    token: usize,
) -> Result<()> {
    let op = ops[token].as_mut().expect("op to submit");
    let read = &reads[op.read];
    let file = &files[read.file];
    let len = (read.len - op.done) as u32;
    // SAFETY: index < count, inside the registered region.
    let buf = unsafe { op.slot.as_mut_ptr().add(op.done as usize) };
    let entry = opcode::ReadFixed::new(
        types::Fd(file.file().as_raw_fd()),
        buf,
        len,
        op.slot.index() as u16,
    )
    .offset(read.offset + op.done)
    .build()
    .user_data(token as u64);
    // SAFETY: the slot (buffer) is owned by `ops[token]` until this entry's completion is
    // reaped; the file is borrowed for the whole run.
    while unsafe { ring.submission().push(&entry) }.is_err() {
        ring.submit()
            .map_err(|e| Error::io(file.path(), "io_uring_enter", read.offset, e))?;
    }
    Ok(())
}
