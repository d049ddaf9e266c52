//! The object store engine: many concurrent ranged GETs, each streamed into staging
//! slots as its bytes arrive and handed to the copy stage slot by slot. Every byte is
//! fetched once (a body that breaks off is resumed where it stopped); memory stays
//! bounded by the pool.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::pread::run_workers;
use super::{piece_bytes, Control, Deliver};
use crate::device::staging::{Slot, StagingPool};
use crate::error::{Error, Result};
use crate::plan::Read;
use crate::source::ObjectFile;

/// Shape of an object store run.
#[derive(Debug, Clone, Copy)]
pub struct ObjectRun {
    /// Largest ranged GET in bytes (one GET may fill several slots).
    pub chunk: u64,
    /// GETs in flight at once.
    pub concurrency: usize,
    /// Retries of a body that breaks off part way.
    pub retries: usize,
}

/// Groups `reads` (planned at most a slot each, sorted by file and offset) into ranged
/// GETs: runs of contiguous reads of one file, at most `chunk` bytes each.
pub fn group_reads(reads: &[Read], chunk: u64) -> Vec<Range> {
    let mut out: Vec<Range> = Vec::new();
    for (i, r) in reads.iter().enumerate() {
        if let Some(last) = out.last_mut() {
            let prev = &reads[last.reads.end - 1];
            if prev.file == r.file
                && prev.offset + prev.len == r.offset
                && r.offset + r.len - reads[last.reads.start].offset <= chunk
            {
                last.reads.end = i + 1;
                continue;
            }
        }
        out.push(Range { reads: i..i + 1 });
    }
    out
}

/// Reads `reads[reads]`, one GET.
#[derive(Debug, Clone)]
pub struct Range {
    /// Indices into the read list.
    pub reads: std::ops::Range<usize>,
}

/// Runs `reads` of `objects` with `opts.concurrency` GETs in flight, each read's bytes
/// in a slot of `pool` handed to `deliver`. Stops at the first error (recorded in `ctl`).
pub fn run(
    objects: &[ObjectFile],
    reads: &[Read],
    pool: &StagingPool,
    opts: ObjectRun,
    ctl: &Control,
    deliver: &Deliver,
) {
    let ranges = group_reads(reads, opts.chunk.max(1));
    let next = AtomicUsize::new(0);
    let worker = || {
        while !ctl.should_stop() {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(range) = ranges.get(i) else { break };
            let group = &reads[range.reads.clone()];
            if let Err(e) = fetch_group(&objects[group[0].file], group, pool, opts, ctl, deliver) {
                ctl.fail(e);
                break;
            }
        }
    };
    run_workers(opts.concurrency.min(ranges.len()).max(1), &worker);
}

/// One GET covering `group` (contiguous reads of one object), streamed slot by slot.
fn fetch_group(
    obj: &ObjectFile,
    group: &[Read],
    pool: &StagingPool,
    opts: ObjectRun,
    ctl: &Control,
    deliver: &Deliver,
) -> Result<()> {
    let start = group[0].offset;
    let last = &group[group.len() - 1];
    // Only the bytes pieces need: the last read's tail past `needed` is not asked for.
    let end = last.offset + last.needed;
    let mut current: Option<(usize, Slot)> = None; // (read index in group, its slot)
    let mut next_read = 0usize;
    let mut each = |at: usize, mut bytes: &[u8]| -> Result<()> {
        let mut pos = start + at as u64;
        while !bytes.is_empty() {
            if ctl.should_stop() {
                return Err(Error::Cancelled);
            }
            if current.is_none() {
                let Some(read) = group.get(next_read) else {
                    return Ok(()); // past the last needed byte
                };
                if pos < read.offset {
                    // A gap between reads (or a tail no piece needs): skip it.
                    let skip = (read.offset - pos).min(bytes.len() as u64);
                    bytes = &bytes[skip as usize..];
                    pos += skip;
                    continue;
                }
                let slot = pool.acquire();
                if read.len as usize > slot.capacity() {
                    return Err(Error::InvalidArgument(format!(
                        "read of {} bytes exceeds the staging slot",
                        read.len
                    )));
                }
                current = Some((next_read, slot));
                next_read += 1;
            }
            let (ri, slot) = current.as_mut().expect("slot");
            let read = &group[*ri];
            let read_end = read.offset + read.needed.min(read.len);
            let take = (bytes.len() as u64).min(read_end - pos) as usize;
            let off = (pos - read.offset) as usize;
            slot.as_mut_slice()[off..off + take].copy_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            pos += take as u64;
            if pos == read_end {
                let (ri, slot) = current.take().expect("slot");
                deliver(&group[ri], slot)?;
                ctl.add(piece_bytes(&group[ri]));
            }
        }
        Ok(())
    };
    obj.stream_range(start..end, opts.retries, &mut each)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(file: usize, offset: u64, len: u64) -> Read {
        Read {
            file,
            offset,
            len,
            needed: len,
            pieces: Vec::new(),
        }
    }

    #[test]
    fn contiguous_reads_of_one_file_share_a_get_up_to_the_chunk() {
        let reads = [
            read(0, 0, 4),
            read(0, 4, 4),
            read(0, 8, 4),
            read(0, 20, 4),
            read(1, 24, 4),
        ];
        let g = group_reads(&reads, 8);
        let spans: Vec<_> = g.iter().map(|r| r.reads.clone()).collect();
        assert_eq!(spans, vec![0..2, 2..3, 3..4, 4..5]);
    }
}
