//! Plans: what to copy from where to where, as few large aligned reads that each fit in a
//! staging slot, and the exact pieces each read delivers.

/// One run of bytes to move: `len` bytes at `offset` of file `file` go to destination
/// `dest` at `dest_offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Index of the source file (into the caller's file list).
    pub file: usize,
    /// Byte offset in the file.
    pub offset: u64,
    /// Number of bytes.
    pub len: u64,
    /// Index of the destination buffer (into the caller's destination list).
    pub dest: usize,
    /// Byte offset in the destination.
    pub dest_offset: u64,
}

/// Part of a read that lands in a destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Offset of the bytes within the read's buffer.
    pub buf_offset: u64,
    /// Number of bytes.
    pub len: u64,
    /// Destination index.
    pub dest: usize,
    /// Offset in the destination.
    pub dest_offset: u64,
}

/// One read: `len` bytes at `offset` of `file`, delivering `pieces`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Read {
    /// Source file index.
    pub file: usize,
    /// File offset of the read (aligned when the plan is).
    pub offset: u64,
    /// Bytes to read (aligned when the plan is; may run past the end of the file, in
    /// which case a short read is expected, but never short of `needed`).
    pub len: u64,
    /// Bytes from `offset` that must be present (the end of the last piece).
    pub needed: u64,
    /// Where the bytes go.
    pub pieces: Vec<Piece>,
}

/// How to shape reads.
#[derive(Debug, Clone, Copy)]
pub struct PlanOptions {
    /// Alignment of read offsets and lengths (1 for buffered, 4096 for `O_DIRECT`).
    pub align: u64,
    /// Largest read (the staging slot size); a multiple of `align`.
    pub max_read: u64,
    /// Extents of one file closer than this are read together, gap included.
    pub max_gap: u64,
}

/// Turns extents into reads: sorted by file and offset, neighbours coalesced, each read
/// aligned and at most `max_read` bytes. Every requested byte is delivered exactly once.
///
/// # Panics
/// If `max_read` is not a non-zero multiple of `align`.
pub fn plan(extents: &[Extent], opts: PlanOptions) -> Vec<Read> {
    assert!(
        opts.align > 0 && opts.max_read >= opts.align && opts.max_read.is_multiple_of(opts.align)
    );
    let mut order: Vec<&Extent> = extents.iter().filter(|e| e.len > 0).collect();
    order.sort_by_key(|e| (e.file, e.offset, e.dest, e.dest_offset));
    let mut reads = Vec::new();
    let mut i = 0;
    while i < order.len() {
        // A run: extents of one file whose gaps are small.
        let file = order[i].file;
        let mut j = i + 1;
        let mut run_end = order[i].offset + order[i].len;
        while j < order.len() && order[j].file == file && order[j].offset <= run_end + opts.max_gap
        {
            run_end = run_end.max(order[j].offset + order[j].len);
            j += 1;
        }
        let run = &order[i..j];
        let mut cursor = align_down(run[0].offset, opts.align);
        let end = align_up(run_end, opts.align);
        let mut k = 0; // first extent that may still overlap [cursor, ..)
        while cursor < end {
            let read_end = (cursor + opts.max_read).min(end);
            let mut pieces = Vec::new();
            let mut needed = 0;
            while k < run.len() && run[k].offset + run[k].len <= cursor {
                k += 1;
            }
            for e in &run[k..] {
                if e.offset >= read_end {
                    break;
                }
                let lo = e.offset.max(cursor);
                let hi = (e.offset + e.len).min(read_end);
                if lo >= hi {
                    continue;
                }
                pieces.push(Piece {
                    buf_offset: lo - cursor,
                    len: hi - lo,
                    dest: e.dest,
                    dest_offset: e.dest_offset + (lo - e.offset),
                });
                needed = needed.max(hi - cursor);
            }
            if !pieces.is_empty() {
                reads.push(Read {
                    file,
                    offset: cursor,
                    len: read_end - cursor,
                    needed,
                    pieces,
                });
            }
            cursor = read_end;
        }
        i = j;
    }
    reads
}

/// Rounds `x` down to a multiple of `a`.
pub fn align_down(x: u64, a: u64) -> u64 {
    x - x % a
}

/// Rounds `x` up to a multiple of `a`.
pub fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn opts(align: u64, max_read: u64) -> PlanOptions {
        PlanOptions {
            align,
            max_read,
            max_gap: 0,
        }
    }

    #[test]
    fn coalesces_neighbours_into_one_read() {
        let ex = [
            Extent {
                file: 0,
                offset: 100,
                len: 50,
                dest: 0,
                dest_offset: 0,
            },
            Extent {
                file: 0,
                offset: 150,
                len: 50,
                dest: 1,
                dest_offset: 0,
            },
        ];
        let reads = plan(&ex, opts(1, 1 << 20));
        assert_eq!(reads.len(), 1);
        assert_eq!(
            (reads[0].offset, reads[0].len, reads[0].pieces.len()),
            (100, 100, 2)
        );
    }

    #[test]
    fn aligned_read_covers_superset_and_copies_exact_bytes() {
        let ex = [Extent {
            file: 0,
            offset: 4100,
            len: 10,
            dest: 0,
            dest_offset: 3,
        }];
        let reads = plan(&ex, opts(4096, 8192));
        assert_eq!(reads.len(), 1);
        assert_eq!(
            (reads[0].offset, reads[0].len, reads[0].needed),
            (4096, 4096, 14)
        );
        assert_eq!(
            reads[0].pieces[0],
            Piece {
                buf_offset: 4,
                len: 10,
                dest: 0,
                dest_offset: 3
            }
        );
    }

    #[test]
    fn extent_straddling_slots_is_split() {
        let ex = [Extent {
            file: 0,
            offset: 4000,
            len: 10_000,
            dest: 0,
            dest_offset: 0,
        }];
        let reads = plan(&ex, opts(4096, 8192));
        assert_eq!(reads.len(), 2);
        assert_eq!(reads[0].pieces[0].len + reads[1].pieces[0].len, 10_000);
        assert_eq!(reads[1].pieces[0].dest_offset, reads[0].pieces[0].len);
    }

    #[test]
    fn different_files_never_share_a_read() {
        let ex = [
            Extent {
                file: 1,
                offset: 0,
                len: 8,
                dest: 0,
                dest_offset: 0,
            },
            Extent {
                file: 0,
                offset: 8,
                len: 8,
                dest: 1,
                dest_offset: 0,
            },
        ];
        let reads = plan(&ex, opts(1, 64));
        assert_eq!(reads.len(), 2);
        assert_eq!(reads[0].file, 0);
    }

    proptest! {
        /// Every requested byte is delivered exactly once, to the right place, and every
        /// read is aligned and fits a slot.
        #[test]
        fn plan_covers_exactly_the_requested_bytes(
            raw in proptest::collection::vec((0u64..3, 0u64..50_000, 0u64..20_000), 0..40),
            align_pow in 0u32..13,
            slots in 1u64..8,
            gap in 0u64..10_000,
        ) {
            let align = 1u64 << align_pow;
            let max_read = align * slots.max(1) * (4096 / align).max(1);
            // Non-overlapping destinations: each extent its own destination.
            let ex: Vec<Extent> = raw.iter().enumerate()
                .map(|(i, &(file, offset, len))| Extent { file: file as usize, offset, len, dest: i, dest_offset: 7 })
                .collect();
            let reads = plan(&ex, PlanOptions { align, max_read, max_gap: gap });
            let mut got: Vec<Vec<u64>> = ex.iter().map(|_| Vec::new()).collect();
            for r in &reads {
                prop_assert_eq!(r.offset % align, 0);
                prop_assert_eq!(r.len % align, 0);
                prop_assert!(r.len <= max_read);
                prop_assert!(r.needed <= r.len);
                for p in &r.pieces {
                    prop_assert!(p.buf_offset + p.len <= r.needed);
                    for b in 0..p.len {
                        // The file byte this piece byte came from must equal the byte the
                        // extent maps to dest_offset + b.
                        let file_byte = r.offset + p.buf_offset + b;
                        let e = &ex[p.dest];
                        prop_assert_eq!(r.file, e.file);
                        prop_assert_eq!(file_byte - e.offset, p.dest_offset + b - e.dest_offset);
                        got[p.dest].push(p.dest_offset + b);
                    }
                }
            }
            for (e, g) in ex.iter().zip(got.iter_mut()) {
                g.sort_unstable();
                let want: Vec<u64> = (e.dest_offset..e.dest_offset + e.len).collect();
                prop_assert_eq!(&*g, &want);
            }
        }
    }
}
