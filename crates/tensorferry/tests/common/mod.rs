//! Shared helpers of the integration tests: the committed fixtures, what the reference
//! implementation says they hold (`fixtures/expected.json`, written by
//! `fixtures/make_fixtures.py`), and checks of loaded tensors against both.

// Each test binary uses a different subset of these helpers.
#![allow(dead_code)]

pub mod cloud;
pub mod servers;
pub mod stores;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde::Deserialize;
use sha2::{Digest, Sha256};
use tensorferry::{Checkpoint, Dtype, HostTensor, SaveSource, SaveTensor};

/// What `make_fixtures.py` recorded.
#[derive(Debug, Deserialize)]
pub struct Expected {
    /// Per file (path relative to the fixtures directory).
    pub files: BTreeMap<String, FileExp>,
    /// The sharded checkpoint.
    pub sharded: ShardedExp,
    /// The raw file.
    pub raw: RawExp,
}

/// One safetensors fixture.
#[derive(Debug, Deserialize)]
pub struct FileExp {
    /// Who wrote it (the reference's API, or by hand).
    pub writer: String,
    /// `N`, the JSON header's length.
    pub header_len: u64,
    /// The file's size.
    pub file_len: u64,
    /// `__metadata__`.
    pub metadata: Option<BTreeMap<String, String>>,
    /// Tensors by name.
    pub tensors: BTreeMap<String, TensorExp>,
}

/// One tensor of a fixture.
#[derive(Debug, Deserialize)]
pub struct TensorExp {
    /// Safetensors dtype name.
    pub dtype: String,
    /// Shape.
    pub shape: Vec<u64>,
    /// `[begin, end)` in the data section.
    pub data_offsets: (u64, u64),
    /// sha256 of the tensor's bytes as handed to the writer.
    pub sha256: String,
}

/// The sharded fixture.
#[derive(Debug, Deserialize)]
pub struct ShardedExp {
    /// The index, relative to the fixtures directory.
    pub index: String,
    /// Bytes of all tensors.
    pub total_size: u64,
    /// Tensor name -> shard file name.
    pub weight_map: BTreeMap<String, String>,
}

/// The raw fixture.
#[derive(Debug, Deserialize)]
pub struct RawExp {
    /// Relative path.
    pub path: String,
    /// Size.
    pub len: u64,
    /// sha256 of the whole file.
    pub sha256: String,
}

/// The single-file safetensors fixtures.
pub const SINGLE_FILES: [&str; 6] = [
    "dtypes.safetensors",
    "exotic.safetensors",
    "handmade.safetensors",
    "odd_shapes.safetensors",
    "big.safetensors",
    "long_header.safetensors",
];

/// The fixtures directory.
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// A fixture's path.
pub fn fixture(rel: &str) -> PathBuf {
    fixtures().join(rel)
}

/// The parsed `expected.json`.
pub fn expected() -> &'static Expected {
    static EXP: OnceLock<Expected> = OnceLock::new();
    EXP.get_or_init(|| {
        let text = std::fs::read_to_string(fixture("expected.json"))
            .expect("tests/fixtures/expected.json (run make_fixtures.py)");
        serde_json::from_str(&text).expect("expected.json parses")
    })
}

/// Every checkpoint path the loaders are tested on: each single file, the sharded
/// directory, and its index file.
pub fn checkpoint_paths() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = SINGLE_FILES.iter().map(|f| fixture(f)).collect();
    v.push(fixture("sharded"));
    v.push(fixture(&expected().sharded.index));
    v
}

/// sha256 of `bytes`, lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    Sha256::digest(bytes)
        .iter()
        .fold(String::with_capacity(64), |mut s, b| {
            write!(s, "{b:02x}").unwrap();
            s
        })
}

/// `len` bytes of `path` at `offset`, read plainly with std.
pub fn file_region(path: &Path, offset: u64, len: u64) -> Vec<u8> {
    let all = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    all[offset as usize..(offset + len) as usize].to_vec()
}

/// The fixture entry (file, tensor) for a tensor of `ck`.
pub fn expected_tensor<'a>(ck: &Checkpoint, name: &str) -> (&'a FileExp, &'a TensorExp) {
    let entry = ck.tensor(name).expect("tensor in checkpoint");
    let file = &ck.files[entry.file];
    let rel = file
        .strip_prefix(fixtures())
        .unwrap_or_else(|_| panic!("{} is not a fixture", file.display()));
    let rel = rel.to_str().expect("utf-8 fixture path");
    let fexp = expected()
        .files
        .get(rel)
        .unwrap_or_else(|| panic!("{rel} not in expected.json"));
    let texp = fexp
        .tensors
        .get(name)
        .unwrap_or_else(|| panic!("{rel}: {name} not in expected.json"));
    (fexp, texp)
}

/// Checks a loaded tensor against the reference (dtype, shape, sha256) and against the
/// bytes of the file region the checkpoint says it comes from.
pub fn check_tensor(ck: &Checkpoint, t: &HostTensor) {
    let (fexp, texp) = expected_tensor(ck, &t.name);
    let entry = ck.tensor(&t.name).unwrap();
    assert_eq!(t.dtype.name(), texp.dtype, "{}: dtype", t.name);
    assert_eq!(t.shape, texp.shape, "{}: shape", t.name);
    assert_eq!(
        entry.file_offset,
        8 + fexp.header_len + texp.data_offsets.0,
        "{}: file offset",
        t.name
    );
    assert_eq!(
        t.data.len() as u64,
        texp.data_offsets.1 - texp.data_offsets.0,
        "{}: length",
        t.name
    );
    assert_eq!(sha256_hex(&t.data), texp.sha256, "{}: sha256", t.name);
    let region = file_region(&ck.files[entry.file], entry.file_offset, entry.len());
    assert!(
        *t.data == region[..],
        "{}: bytes differ from the file",
        t.name
    );
}

/// Copies fixture `rel` into `dir` (keeping its file name) and returns the copy's path.
pub fn copy_fixture(rel: &str, dir: &Path) -> PathBuf {
    let src = fixture(rel);
    let dst = dir.join(src.file_name().unwrap());
    std::fs::copy(&src, &dst).unwrap();
    dst
}

/// Deterministic pseudo-random bytes (xorshift64), for test data.
pub fn pseudo_random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// A tensor as owned test data.
pub struct Owned {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub data: Vec<u8>,
}

impl Owned {
    /// `None` where the dtype refuses the shape's element count (`Dtype::bytes_for`).
    pub fn new(name: &str, dtype: Dtype, shape: &[u64], seed: u64) -> Option<Self> {
        let n = dtype.bytes_for(shape.iter().product()).ok()?;
        Some(Self {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            data: pseudo_random_bytes(n as usize, seed),
        })
    }

    /// The tensor as a save source (host memory).
    pub fn save(&self) -> SaveTensor<'_> {
        SaveTensor {
            name: self.name.clone(),
            dtype: self.dtype,
            shape: self.shape.clone(),
            source: SaveSource::Host(&self.data),
        }
    }
}
