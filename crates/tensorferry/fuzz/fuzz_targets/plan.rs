//! Fuzzes the planner: every requested byte is delivered exactly once, to the right
//! destination offset, by aligned reads that fit a slot.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use tensorferry::plan::{plan, Extent, PlanOptions};

#[derive(Arbitrary, Debug)]
struct Input {
    extents: Vec<(u8, u32, u16)>,
    align_pow: u8,
    slots: u8,
    gap: u16,
}

fuzz_target!(|inp: Input| {
    let align = 1u64 << (inp.align_pow % 13);
    let max_read = align.max(4096) * u64::from(inp.slots % 8 + 1);
    let ex: Vec<Extent> = inp
        .extents
        .iter()
        .take(64)
        .enumerate()
        .map(|(i, &(f, off, len))| Extent { file: usize::from(f % 3), offset: u64::from(off), len: u64::from(len), dest: i, dest_offset: 3 })
        .collect();
    let reads = plan(&ex, PlanOptions { align, max_read, max_gap: u64::from(inp.gap) });
    let mut covered: Vec<u64> = vec![0; ex.len()];
    for r in &reads {
        assert_eq!(r.offset % align, 0);
        assert_eq!(r.len % align, 0);
        assert!(r.len <= max_read && r.needed <= r.len);
        for p in &r.pieces {
            let e = &ex[p.dest];
            assert_eq!(r.file, e.file);
            assert!(p.buf_offset + p.len <= r.needed);
            // The piece's first file byte maps to the destination offset the extent says.
            assert_eq!(r.offset + p.buf_offset - e.offset, p.dest_offset - e.dest_offset);
            assert!(p.dest_offset + p.len <= e.dest_offset + e.len);
            covered[p.dest] += p.len;
        }
    }
    for (e, c) in ex.iter().zip(&covered) {
        assert_eq!(*c, e.len, "extent {e:?} not covered exactly once");
    }
});
