//! Per-tensor checksums: an xxh3-64 of each tensor's data bytes, recorded by a save
//! (`checksums`) in the header's `__metadata__` under [`METADATA_KEY`] as the JSON text
//! `{"name": "<16 lowercase hex digits>", ...}` (names sorted), and checked by a load
//! (`verify`) as the bytes pass through staging.
//!
//! Bytes of one tensor may pass in pieces, out of order, on several threads; an
//! [`OrderedHasher`] feeds its streaming state in order and holds the pieces that
//! arrive ahead of its cursor (at most what is in flight) until their turn.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use xxhash_rust::xxh3::Xxh3;

use crate::device::staging::Slot;
use crate::error::{Error, Result};
use crate::format::FormatError;
use crate::pipeline::Sink;
use crate::plan::Read;

/// The `__metadata__` key of the checksums.
pub const METADATA_KEY: &str = "tensorferry.xxh3_64";

/// The xxh3-64 of `data` (what a save records for a tensor holding these bytes).
pub fn xxh3_64(data: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(data)
}

/// The metadata value for these digests: `{"a": "0123456789abcdef", ...}`, names sorted.
/// Every digest is 16 hex digits, so the text's length does not depend on the values.
pub fn encode<'a>(digests: impl IntoIterator<Item = (&'a str, u64)>) -> String {
    let sorted: BTreeMap<&str, u64> = digests.into_iter().collect();
    let mut out = String::from("{");
    for (i, (name, d)) in sorted.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        out.push_str(&serde_json::to_string(name).expect("string"));
        let _ = write!(out, ": \"{d:016x}\"");
    }
    out.push('}');
    out
}

/// The checksums recorded in a file's metadata. Fails (naming `path`) when the file has
/// none or they are malformed.
pub fn parse(
    path: &Path,
    metadata: Option<&BTreeMap<String, String>>,
) -> Result<BTreeMap<String, u64>> {
    let Some(text) = metadata.and_then(|m| m.get(METADATA_KEY)) else {
        return Err(Error::invalid(path, FormatError::NoChecksums));
    };
    let bad = |reason: String| Error::invalid(path, FormatError::BadChecksums { reason });
    let map: BTreeMap<String, String> = serde_json::from_str(text)
        .map_err(|e| bad(format!("not a JSON object of strings: {e}")))?;
    map.into_iter()
        .map(|(name, hex)| {
            if hex.len() != 16 {
                return Err(bad(format!("digest of {name:?} is not 16 hex digits")));
            }
            u64::from_str_radix(&hex, 16)
                .map(|d| (name.clone(), d))
                .map_err(|_| bad(format!("digest of {name:?} is not 16 hex digits")))
        })
        .collect()
}

/// A streaming xxh3-64 fed in order from pieces that may arrive out of order.
#[derive(Default)]
pub struct OrderedHasher {
    state: Xxh3,
    cursor: u64,
    ahead: BTreeMap<u64, Vec<u8>>,
}

impl OrderedHasher {
    /// Feeds `data`, the bytes at `pos` of the stream.
    pub fn feed(&mut self, pos: u64, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        if pos > self.cursor {
            self.ahead.insert(pos, data.to_vec());
            return;
        }
        self.take(pos, data);
        while let Some(entry) = self.ahead.first_entry() {
            if *entry.key() > self.cursor {
                break;
            }
            let (at, bytes) = entry.remove_entry();
            self.take(at, &bytes);
        }
    }

    fn take(&mut self, pos: u64, data: &[u8]) {
        let end = pos + data.len() as u64;
        if end > self.cursor {
            self.state.update(&data[(self.cursor - pos) as usize..]);
            self.cursor = end;
        }
    }

    /// Bytes hashed so far (in order).
    pub fn hashed(&self) -> u64 {
        self.cursor
    }

    /// The digest of the bytes hashed so far.
    pub fn digest(&self) -> u64 {
        self.state.digest()
    }
}

/// Ordered hashers over disjoint ranges of one address space (a file, a destination):
/// bytes fed at any offset go to the hashers of the ranges they overlap.
pub struct RangeHasher {
    /// `(start, len)`, sorted by start, disjoint.
    ranges: Vec<(u64, u64)>,
    hashers: Vec<Mutex<OrderedHasher>>,
}

impl RangeHasher {
    /// Hashers over `ranges` `(start, len)`, sorted by start and disjoint.
    pub fn new(ranges: Vec<(u64, u64)>) -> Self {
        debug_assert!(ranges.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0));
        let hashers = ranges.iter().map(|_| Mutex::default()).collect();
        Self { ranges, hashers }
    }

    /// Feeds `data`, the bytes at `offset`.
    pub fn feed(&self, offset: u64, data: &[u8]) {
        let end = offset + data.len() as u64;
        let mut idx = self
            .ranges
            .partition_point(|&(start, len)| start + len <= offset);
        while idx < self.ranges.len() && self.ranges[idx].0 < end {
            let (start, len) = self.ranges[idx];
            let from = start.max(offset);
            let to = (start + len).min(end);
            if from < to {
                self.hashers[idx].lock().expect("hasher lock").feed(
                    from - start,
                    &data[(from - offset) as usize..(to - offset) as usize],
                );
            }
            idx += 1;
        }
    }

    /// Per range (in order): the digest, or `None` when not every byte was fed.
    pub fn digests(&self) -> Vec<Option<u64>> {
        self.ranges
            .iter()
            .zip(&self.hashers)
            .map(|(&(_, len), h)| {
                let h = h.lock().expect("hasher lock");
                (h.hashed() == len).then(|| h.digest())
            })
            .collect()
    }
}

/// A whole tensor of a load to verify: where it lands and the digest recorded for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// The file it is read from (named in errors).
    pub path: PathBuf,
    /// The tensor's name.
    pub name: String,
    /// Destination index.
    pub dest: usize,
    /// Offset in the destination.
    pub dest_offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// The recorded xxh3-64.
    pub digest: u64,
}

/// A copy stage that hashes every piece of the checked tensors from the staging slot,
/// then hands the slot to the real sink. [`VerifySink::verify`] compares once the load
/// is done.
pub struct VerifySink<'a> {
    inner: &'a dyn Sink,
    checks: &'a [Check],
    /// Per destination: the hashers and, per range, the index of its check.
    by_dest: HashMap<usize, (RangeHasher, Vec<usize>)>,
}

impl<'a> VerifySink<'a> {
    /// Wraps `inner`, checking `checks` (disjoint in their destinations).
    pub fn new(inner: &'a dyn Sink, checks: &'a [Check]) -> Result<Self> {
        let mut grouped: HashMap<usize, Vec<usize>> = HashMap::new();
        for (i, c) in checks.iter().enumerate() {
            grouped.entry(c.dest).or_default().push(i);
        }
        let mut by_dest = HashMap::with_capacity(grouped.len());
        for (dest, mut idx) in grouped {
            idx.sort_by_key(|&i| (checks[i].dest_offset, checks[i].len));
            let ranges: Vec<(u64, u64)> = idx
                .iter()
                .map(|&i| (checks[i].dest_offset, checks[i].len))
                .collect();
            if ranges.windows(2).any(|w| w[0].0 + w[0].1 > w[1].0) {
                return Err(Error::InvalidArgument(format!(
                    "tensors to verify overlap in destination {dest}"
                )));
            }
            by_dest.insert(dest, (RangeHasher::new(ranges), idx));
        }
        Ok(Self {
            inner,
            checks,
            by_dest,
        })
    }

    /// Compares every checked tensor with its recorded digest; the first mismatch (or a
    /// tensor not wholly seen) is an [`Error::InvalidFile`] naming the file and tensor.
    pub fn verify(&self) -> Result<()> {
        let mut results: Vec<Option<u64>> = vec![None; self.checks.len()];
        for (hasher, idx) in self.by_dest.values() {
            for (d, &i) in hasher.digests().into_iter().zip(idx) {
                results[i] = d;
            }
        }
        for (c, got) in self.checks.iter().zip(results) {
            match got {
                Some(actual) if actual == c.digest => {}
                Some(actual) => {
                    return Err(Error::invalid(
                        &c.path,
                        FormatError::ChecksumMismatch {
                            name: c.name.clone(),
                            expected: format!("{:016x}", c.digest),
                            actual: format!("{actual:016x}"),
                        },
                    ))
                }
                None => {
                    return Err(Error::InvalidArgument(format!(
                        "{}: tensor {:?} was not read whole, so it cannot be verified",
                        c.path.display(),
                        c.name
                    )))
                }
            }
        }
        Ok(())
    }
}

impl Sink for VerifySink<'_> {
    fn deliver(&self, read: &Read, slot: Slot) -> Result<()> {
        let src = slot.as_slice();
        for p in &read.pieces {
            if let Some((hasher, _)) = self.by_dest.get(&p.dest) {
                hasher.feed(
                    p.dest_offset,
                    &src[p.buf_offset as usize..(p.buf_offset + p.len) as usize],
                );
            }
        }
        self.inner.deliver(read, slot)
    }

    fn host_ptr(&self, dest: usize, offset: u64) -> Option<*mut u8> {
        self.inner.host_ptr(dest, offset)
    }

    fn finish(&self) -> Result<()> {
        self.inner.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ordered_hasher_matches_one_shot_whatever_the_order() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        let want = xxh3_64(&data);
        let cuts = [0usize, 17, 1000, 1001, 4096, 8000, 10_000];
        let mut pieces: Vec<(usize, usize)> = cuts.windows(2).map(|w| (w[0], w[1])).collect();
        for rot in 0..pieces.len() {
            pieces.rotate_left(1);
            let mut h = OrderedHasher::default();
            for &(a, b) in pieces.iter().rev() {
                h.feed(a as u64, &data[a..b]);
            }
            assert_eq!(h.hashed(), data.len() as u64, "rotation {rot}");
            assert_eq!(h.digest(), want);
        }
        assert_eq!(OrderedHasher::default().digest(), xxh3_64(b""));
    }

    #[test]
    fn range_hasher_splits_across_ranges() {
        let data: Vec<u8> = (0..300u32).map(|i| i as u8).collect();
        let r = RangeHasher::new(vec![(10, 100), (110, 0), (110, 50), (200, 100)]);
        r.feed(150, &data[150..300]);
        r.feed(0, &data[0..150]);
        let d = r.digests();
        assert_eq!(d[0], Some(xxh3_64(&data[10..110])));
        assert_eq!(d[1], Some(xxh3_64(b"")));
        assert_eq!(d[2], Some(xxh3_64(&data[110..160])));
        assert_eq!(d[3], Some(xxh3_64(&data[200..300])));
    }

    #[test]
    fn encode_parse_round_trip() {
        let text = encode([("b", 1u64), ("a\"x", u64::MAX)]);
        assert_eq!(
            text,
            r#"{"a\"x": "ffffffffffffffff", "b": "0000000000000001"}"#
        );
        let mut meta = BTreeMap::new();
        meta.insert(METADATA_KEY.to_string(), text);
        let got = parse(Path::new("f"), Some(&meta)).unwrap();
        assert_eq!(got["b"], 1);
        assert_eq!(got["a\"x"], u64::MAX);
        assert!(matches!(
            parse(Path::new("f"), None),
            Err(Error::InvalidFile {
                source: FormatError::NoChecksums,
                ..
            })
        ));
    }
}
