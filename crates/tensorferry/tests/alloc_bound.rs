//! Hostile files cost at most what they weigh: opening one allocates no more than the
//! file's size plus the first read's buffer, whatever its header claims (lengths near
//! 2^64, shapes of 10^24 elements, deep nesting), and fails with an error naming it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use tensorferry::{Checkpoint, Error};

/// Counts live and peak bytes allocated (every thread; the test runs alone in its binary).
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator and only adds bookkeeping.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let now = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
        PEAK.fetch_max(now, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// The first read of a header (`checkpoint.rs`), and slack for paths and error text.
const FIRST_READ: usize = 64 * 1024;
const SLACK: usize = 16 * 1024;

fn file(len_field: u64, json: &[u8], tail: usize) -> Vec<u8> {
    let mut b = len_field.to_le_bytes().to_vec();
    b.extend_from_slice(json);
    b.resize(b.len() + tail, 0);
    b
}

#[test]
fn hostile_headers_allocate_no_more_than_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let nested: Vec<u8> = std::iter::once(b'{')
        .chain(b"\"a\":".iter().copied())
        .chain(std::iter::repeat_n(b'[', 200_000))
        .collect();
    let huge_shape =
        br#"{"t":{"dtype":"F32","shape":[1000000000000,1000000000000],"data_offsets":[0,16]}}"#;
    let big_claim =
        br#"{"t":{"dtype":"U8","shape":[1000000000000],"data_offsets":[0,1000000000000]}}"#;
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("length near 2^64", file(u64::MAX - 7, b"{}", 0)),
        ("length past the end", file(99_000_000, b"{}", 100)),
        ("deeply nested", file(nested.len() as u64, &nested, 0)),
        (
            "shape overflowing",
            file(huge_shape.len() as u64, huge_shape, 16),
        ),
        (
            "data claimed far past the end",
            file(big_claim.len() as u64, big_claim, 64),
        ),
        ("not UTF-8", file(4, &[b'{', 0xff, 0xfe, b'}'], 0)),
    ];
    for (what, bytes) in cases {
        let path = dir.path().join("hostile.safetensors");
        std::fs::write(&path, &bytes).unwrap();
        let base = LIVE.load(Ordering::Relaxed);
        PEAK.store(base, Ordering::Relaxed);
        let result = Checkpoint::open(&path);
        let grew = PEAK.load(Ordering::Relaxed) - base;
        let err = result.expect_err(what);
        assert!(matches!(err, Error::InvalidFile { .. }), "{what}: {err}");
        assert!(
            err.to_string().contains("hostile.safetensors"),
            "{what}: {err}"
        );
        let bound = bytes.len().min(FIRST_READ) + bytes.len() + SLACK;
        assert!(
            grew <= bound,
            "{what}: allocated {grew} bytes for a file of {} ({err})",
            bytes.len()
        );
    }
}
