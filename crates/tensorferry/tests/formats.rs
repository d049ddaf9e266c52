//! The parsers: a corpus of malformed safetensors headers and index files, each refused
//! with its own `FormatError` and a message naming the file; a property round trip of
//! `serialize_header` / `parse_header`; and `serialize_header` checked byte for byte
//! against headers the reference implementation wrote.

mod common;

use std::path::{Path, PathBuf};

use proptest::prelude::*;
use tensorferry::format::safetensors::{parse_header, serialize_header, MAX_HEADER_SIZE};
use tensorferry::format::RawSpec;
use tensorferry::{Checkpoint, Dtype, EngineChoice, Error, FormatError, LoadOptions, Loader};

use common::{expected, fixture};

/// A safetensors file: the 8-byte length, `header` as is, then `data_len` bytes.
fn st_bytes(header: &[u8], data_len: usize) -> Vec<u8> {
    let mut v = (header.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(header);
    v.resize(v.len() + data_len, 0xAB);
    v
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

/// Opens `path` expecting `Error::InvalidFile` for that very file, whose message names it;
/// returns the format error.
fn invalid(path: &Path) -> FormatError {
    let err = Checkpoint::open(path).expect_err("a malformed file must be refused");
    let msg = err.to_string();
    assert!(
        msg.contains(&path.display().to_string()),
        "message does not name the file: {msg}"
    );
    match err {
        Error::InvalidFile { path: p, source } => {
            assert_eq!(p, path);
            // The message is the path followed by the format error's own words.
            assert!(msg.ends_with(&source.to_string()), "{msg}");
            source
        }
        other => panic!("{}: expected InvalidFile, got {other:?}", path.display()),
    }
}

/// A malformed file from `bytes`, its format error.
fn invalid_bytes(name: &str, bytes: &[u8]) -> FormatError {
    let dir = tempfile::tempdir().unwrap();
    invalid(&write(dir.path(), &format!("{name}.safetensors"), bytes))
}

/// A malformed file with this JSON header and `data_len` bytes of data.
fn invalid_header(name: &str, json: &str, data_len: usize) -> FormatError {
    invalid_bytes(name, &st_bytes(json.as_bytes(), data_len))
}

macro_rules! assert_variant {
    ($e:expr, $pat:pat $(if $guard:expr)?) => {{
        let e = $e;
        assert!(matches!(&e, $pat $(if $guard)?), "unexpected error: {e:?}");
    }};
}

#[test]
fn file_shorter_than_the_length_field() {
    assert_variant!(
        invalid_bytes("empty", &[]),
        FormatError::HeaderTooSmall { file_len: 0 }
    );
    assert_variant!(
        invalid_bytes("five", &[1, 0, 0, 0, 0]),
        FormatError::HeaderTooSmall { file_len: 5 }
    );
}

#[test]
fn header_length_past_the_end_of_the_file() {
    let mut bytes = 100u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    assert_variant!(
        invalid_bytes("past_end", &bytes),
        FormatError::HeaderPastEnd {
            len: 100,
            file_len: 10
        }
    );
    // One byte short.
    let mut bytes = st_bytes(b"{}      ", 0);
    bytes.pop();
    assert_variant!(
        invalid_bytes("one_short", &bytes),
        FormatError::HeaderPastEnd {
            len: 8,
            file_len: 15
        }
    );
}

#[test]
fn header_length_near_u64_max() {
    for len in [u64::MAX, u64::MAX - 7, u64::MAX - 8, 1 << 63] {
        let mut bytes = len.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"{}");
        assert_variant!(
            invalid_bytes("huge", &bytes),
            FormatError::HeaderTooLarge { len: l } if *l == len
        );
    }
}

#[test]
fn header_length_over_100_mb() {
    let mut bytes = (MAX_HEADER_SIZE + 1).to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    assert_variant!(
        invalid_bytes("over", &bytes),
        FormatError::HeaderTooLarge { len: 100_000_001 }
    );
    // Exactly 100 MB is allowed as a length (here it is past the end instead).
    let mut bytes = MAX_HEADER_SIZE.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    assert_variant!(
        invalid_bytes("at_limit", &bytes),
        FormatError::HeaderPastEnd {
            len: 100_000_000,
            ..
        }
    );
}

#[test]
fn header_of_exactly_100_mb_is_read_and_parsed() {
    // A sparse file: an 100 MB header of NUL bytes is read (past the first 64 KiB read)
    // and refused for its content, not its length.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("at_limit.safetensors");
    let f = std::fs::File::create(&path).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &MAX_HEADER_SIZE.to_le_bytes(), 0).unwrap();
    f.set_len(8 + MAX_HEADER_SIZE).unwrap();
    drop(f);
    assert_variant!(invalid(&path), FormatError::HeaderNotJsonObject);
}

#[test]
fn header_not_utf8() {
    let json = b"{\"a\xff\":{}}";
    assert_variant!(
        invalid_bytes("not_utf8", &st_bytes(json, 0)),
        FormatError::HeaderNotUtf8 { offset: 11 }
    );
}

#[test]
fn header_not_json() {
    for (name, json) in [
        ("garbage", "{not json at all"),
        ("unterminated", "{\"a\":{\"dtype\":\"U8\""),
        ("trailing", "{} x"),
        ("trailing_comma", "{\"a\":1,}"),
        ("tensor_not_object", "{\"a\":[1,2]}"),
    ] {
        let e = invalid_header(name, json, 0);
        assert!(
            matches!(
                &e,
                FormatError::HeaderJson { .. } | FormatError::BadEntry { .. }
            ),
            "{name}: {e:?}"
        );
        if name != "tensor_not_object" {
            assert_variant!(e, FormatError::HeaderJson { .. });
        }
    }
}

#[test]
fn deeply_nested_json_is_refused_without_overflowing_the_stack() {
    let depth = 100_000;
    let arrays = format!("{{\"a\":{}{}}}", "[".repeat(depth), "]".repeat(depth));
    assert_variant!(
        invalid_header("deep_arrays", &arrays, 0),
        FormatError::HeaderJson { .. }
    );
    let objects = format!("{}{}", "{\"a\":".repeat(depth), "}".repeat(depth));
    assert_variant!(
        invalid_header("deep_objects", &objects, 0),
        FormatError::HeaderJson { .. }
    );
    let in_metadata = format!(
        "{{\"__metadata__\":{}1{}}}",
        "[".repeat(depth),
        "]".repeat(depth)
    );
    assert_variant!(
        invalid_header("deep_metadata", &in_metadata, 0),
        FormatError::HeaderJson { .. }
    );
}

#[test]
fn header_not_starting_with_a_brace() {
    for (name, json) in [
        ("array", "[1, 2]  "),
        ("string", "\"{}\"    "),
        ("leading_space", " {}     "),
        ("nul", "\0{}     "),
    ] {
        assert_variant!(
            invalid_header(name, json, 0),
            FormatError::HeaderNotJsonObject
        );
    }
}

fn entry(name: &str, dtype: &str, shape: &str, begin: u64, end: u64) -> String {
    format!(
        "\"{name}\":{{\"dtype\":\"{dtype}\",\"shape\":{shape},\"data_offsets\":[{begin},{end}]}}"
    )
}

#[test]
fn duplicate_tensor_names() {
    let json = format!(
        "{{{},{}}}",
        entry("a", "U8", "[4]", 0, 4),
        entry("a", "U8", "[4]", 4, 8)
    );
    assert_variant!(
        invalid_header("dup", &json, 8),
        FormatError::DuplicateTensor { name } if name == "a"
    );
    let json = "{\"__metadata__\":{},\"__metadata__\":{}}";
    assert_variant!(
        invalid_header("dup_meta", json, 0),
        FormatError::DuplicateTensor { name } if name == "__metadata__"
    );
}

#[test]
fn overlapping_offsets() {
    let json = format!(
        "{{{},{}}}",
        entry("a", "U8", "[8]", 0, 8),
        entry("b", "U8", "[8]", 4, 12)
    );
    assert_variant!(
        invalid_header("overlap", &json, 12),
        FormatError::Overlap { name, begin: 4, previous_end: 8 } if name == "b"
    );
    // Two tensors on the same bytes.
    let json = format!(
        "{{{},{}}}",
        entry("a", "U8", "[4]", 0, 4),
        entry("b", "I8", "[4]", 0, 4)
    );
    assert_variant!(
        invalid_header("same_bytes", &json, 4),
        FormatError::Overlap { name, begin: 0, previous_end: 4 } if name == "b"
    );
}

#[test]
fn holes_between_tensors() {
    let json = format!(
        "{{{},{}}}",
        entry("a", "U8", "[4]", 0, 4),
        entry("b", "U8", "[4]", 8, 12)
    );
    assert_variant!(
        invalid_header("hole", &json, 12),
        FormatError::Hole { name, begin: 8, previous_end: 4 } if name == "b"
    );
    // A hole before the first tensor.
    let json = format!("{{{}}}", entry("a", "U8", "[4]", 4, 8));
    assert_variant!(
        invalid_header("hole_first", &json, 8),
        FormatError::Hole { name, begin: 4, previous_end: 0 } if name == "a"
    );
}

#[test]
fn offsets_past_the_end_of_the_file() {
    let json = format!("{{{}}}", entry("a", "F32", "[4]", 0, 16));
    let e = invalid_header("short_data", &json, 10);
    let n = json.len() as u64;
    assert_variant!(
        e,
        FormatError::DataLengthMismatch { expected: x, actual: y } if *x == 8 + n + 16 && *y == 8 + n + 10
    );
    // Bytes after the last tensor are refused too (as the reference does).
    assert_variant!(
        invalid_header("long_data", &json, 17),
        FormatError::DataLengthMismatch { .. }
    );
}

#[test]
fn end_before_begin() {
    let json = format!("{{{}}}", entry("a", "U8", "[0]", 8, 4));
    assert_variant!(
        invalid_header("backwards", &json, 8),
        FormatError::InvalidOffsets { name, begin: 8, end: 4 } if name == "a"
    );
}

#[test]
fn shape_product_overflow() {
    let json = format!(
        "{{{}}}",
        entry("big", "U8", "[4294967296,4294967296]", 0, 0)
    );
    let e = invalid_header("overflow", &json, 0);
    assert_variant!(&e, FormatError::Overflow { what } if what.contains("\"big\""));
    // Elements fit 64 bits, bytes do not.
    let json = format!(
        "{{{}}}",
        entry("bytes", "F64", "[4611686018427387904]", 0, 0)
    );
    let e = invalid_header("byte_overflow", &json, 0);
    assert_variant!(&e, FormatError::Overflow { what } if what.contains("\"bytes\""));
}

#[test]
fn negative_and_non_integer_dimensions() {
    for (name, shape) in [
        ("negative", "[-1]"),
        ("float", "[1.5]"),
        ("string", "[\"2\"]"),
        ("null", "[null]"),
        ("too_big", "[18446744073709551616]"),
        ("not_array", "4"),
    ] {
        let json = format!("{{{}}}", entry("t", "U8", shape, 0, 0));
        assert_variant!(
            invalid_header(name, &json, 0),
            FormatError::BadEntry { name, .. } if name == "t"
        );
    }
}

#[test]
fn malformed_entries() {
    for (name, json) in [
        ("no_offsets", "{\"t\":{\"dtype\":\"U8\",\"shape\":[1]}}"),
        ("no_dtype", "{\"t\":{\"shape\":[1],\"data_offsets\":[0,1]}}"),
        (
            "three_offsets",
            "{\"t\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1,2]}}",
        ),
        (
            "negative_offset",
            "{\"t\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[-1,0]}}",
        ),
    ] {
        assert_variant!(
            invalid_header(name, json, 1),
            FormatError::BadEntry { name, .. } if name == "t"
        );
    }
}

#[test]
fn unknown_dtype() {
    for dtype in ["F128", "float32", "f32", "", "U4"] {
        let json = format!("{{{}}}", entry("t", dtype, "[1]", 0, 1));
        assert_variant!(
            invalid_header("unknown_dtype", &json, 1),
            FormatError::UnknownDtype { dtype: d } if d.starts_with(dtype) && d.contains("\"t\"")
        );
    }
}

#[test]
fn shape_times_dtype_differs_from_the_byte_range() {
    let json = format!("{{{}}}", entry("t", "F32", "[3]", 0, 8));
    assert_variant!(
        invalid_header("size", &json, 8),
        FormatError::SizeMismatch { name, expected: 12, actual: 8 } if name == "t"
    );
    // Sub-byte elements must fill whole bytes.
    let json = format!("{{{}}}", entry("t", "F4", "[3]", 0, 2));
    assert_variant!(
        invalid_header("f4_odd", &json, 2),
        FormatError::BadEntry { name, .. } if name == "t"
    );
    // A scalar is one element.
    let json = format!("{{{}}}", entry("t", "F16", "[]", 0, 0));
    assert_variant!(
        invalid_header("scalar", &json, 0),
        FormatError::SizeMismatch {
            expected: 2,
            actual: 0,
            ..
        }
    );
}

#[test]
fn metadata_must_map_strings_to_strings() {
    for (value, key) in [
        ("{\"k\":1}", Some("k")),
        ("{\"a\":\"ok\",\"k\":{\"x\":\"y\"}}", Some("k")),
        ("{\"k\":null}", Some("k")),
        ("[\"a\"]", None),
        ("\"text\"", None),
    ] {
        let json = format!("{{\"__metadata__\":{value}}}");
        assert_variant!(
            invalid_header("metadata", &json, 0),
            FormatError::BadMetadata { key: k } if k.as_deref() == key
        );
    }
}

/// Eight U8 tensors of 2^61 - 1 bytes each: a data section of 2^64 - 8 bytes, whose
/// offsets all fit 64 bits.
fn near_2_64_tensors(count: u64) -> Vec<(String, Dtype, Vec<u64>)> {
    let size = (1u64 << 61) - 1;
    (0..count)
        .map(|i| (format!("t{i}"), Dtype::U8, vec![size]))
        .collect()
}

/// Regression: `8 + N + data length` overflowed (a panic in debug builds) when a header
/// declared a data section near 2^64 bytes.
#[test]
fn data_section_end_overflow_is_an_error_not_a_panic() {
    let size = (1u64 << 61) - 1;
    let entries: Vec<String> = (0..8)
        .map(|i| {
            entry(
                &format!("t{i}"),
                "U8",
                &format!("[{size}]"),
                i * size,
                (i + 1) * size,
            )
        })
        .collect();
    let json = format!("{{{}}}", entries.join(","));
    let prefix = st_bytes(json.as_bytes(), 0);
    let e = parse_header(&prefix, prefix.len() as u64).unwrap_err();
    assert_variant!(e, FormatError::Overflow { .. });
    let e = invalid_bytes("data_end_overflow", &prefix);
    assert_variant!(e, FormatError::Overflow { .. });
    // serialize_header accepts the same tensors (their offsets fit), and parsing its
    // output fails the same way.
    let (prefix, infos) = serialize_header(&near_2_64_tensors(8), None).unwrap();
    assert_eq!(infos.last().unwrap().data_offsets.1, u64::MAX - 7);
    assert_variant!(
        parse_header(&prefix, u64::MAX).unwrap_err(),
        FormatError::Overflow { .. }
    );
}

/// Regression: `serialize_header` overflowed (a panic in debug builds) when the tensors'
/// bytes together pass 2^64.
#[test]
fn serialize_header_offset_overflow_is_an_error_not_a_panic() {
    assert_variant!(
        serialize_header(&near_2_64_tensors(9), None).unwrap_err(),
        FormatError::Overflow { .. }
    );
}

/// Regression: dtypes the reference defines (and writes) were unknown here.
#[test]
fn reference_fnuz_dtypes_parse() {
    for (name, dtype) in [
        ("F8_E4M3FNUZ", Dtype::F8_E4M3FNUZ),
        ("F8_E5M2FNUZ", Dtype::F8_E5M2FNUZ),
    ] {
        assert_eq!(name.parse::<Dtype>().unwrap(), dtype);
        assert_eq!(dtype.name(), name);
        assert_eq!(dtype.size(), Some(1));
    }
    let ck = Checkpoint::open(fixture("exotic.safetensors")).unwrap();
    assert_eq!(
        ck.tensor("f8_e4m3fnuz").unwrap().dtype(),
        Dtype::F8_E4M3FNUZ
    );
    assert_eq!(
        ck.tensor("f8_e5m2fnuz").unwrap().dtype(),
        Dtype::F8_E5M2FNUZ
    );
}

#[test]
fn every_fixture_header_parses_as_the_reference_wrote_it() {
    for (rel, fexp) in &expected().files {
        let path = fixture(rel);
        let (header, len) = tensorferry::checkpoint::read_header(&path).unwrap();
        assert_eq!(len, fexp.file_len, "{rel}");
        assert_eq!(header.header_len, fexp.header_len, "{rel}");
        assert_eq!(header.metadata, fexp.metadata, "{rel}");
        assert_eq!(header.tensors.len(), fexp.tensors.len(), "{rel}");
        for t in &header.tensors {
            let want = &fexp.tensors[&t.name];
            assert_eq!(t.dtype.name(), want.dtype, "{rel}: {}", t.name);
            assert_eq!(t.shape, want.shape, "{rel}: {}", t.name);
            assert_eq!(t.data_offsets, want.data_offsets, "{rel}: {}", t.name);
        }
        // File order.
        assert!(header
            .tensors
            .windows(2)
            .all(|w| w[0].data_offsets <= w[1].data_offsets));
    }
}

/// The reference's own headers, rebuilt from the tensor list alone, byte for byte (JSON
/// key order, tensor order by dtype then name, escapes, padding). Files written by hand and
/// files whose metadata has several keys (the reference writes those in hash order) are
/// left out.
#[test]
fn serialize_header_matches_the_reference_byte_for_byte() {
    let mut compared = 0;
    for (rel, fexp) in &expected().files {
        if !fexp.writer.starts_with("safetensors.")
            || fexp.metadata.as_ref().is_some_and(|m| m.len() > 1)
        {
            continue;
        }
        // Handed over in reverse name order: the order must come from the rules alone.
        let tensors: Vec<(String, Dtype, Vec<u64>)> = fexp
            .tensors
            .iter()
            .rev()
            .map(|(name, t)| (name.clone(), t.dtype.parse().unwrap(), t.shape.clone()))
            .collect();
        let (prefix, infos) = serialize_header(&tensors, fexp.metadata.as_ref()).unwrap();
        let file = std::fs::read(fixture(rel)).unwrap();
        let n = 8 + fexp.header_len as usize;
        assert_eq!(
            String::from_utf8_lossy(&prefix),
            String::from_utf8_lossy(&file[..n]),
            "{rel}"
        );
        assert_eq!(prefix, file[..n], "{rel}");
        for info in &infos {
            assert_eq!(
                info.data_offsets, fexp.tensors[&info.name].data_offsets,
                "{rel}: {}",
                info.name
            );
        }
        compared += 1;
    }
    assert!(
        compared >= 5,
        "only {compared} reference headers were compared"
    );
    assert!(expected().files["dtypes.safetensors"]
        .metadata
        .as_ref()
        .is_some_and(|m| m.len() == 1 && m["format"] == "pt"));
}

#[test]
fn serialize_header_without_tensors() {
    let (prefix, infos) = serialize_header(&[], None).unwrap();
    assert!(infos.is_empty());
    // `{}` padded to 8 bytes, as the reference writes it.
    assert_eq!(&prefix[..], b"\x08\0\0\0\0\0\0\0{}      ");
    let h = parse_header(&prefix, prefix.len() as u64).unwrap();
    assert!(h.tensors.is_empty() && h.metadata.is_none());
}

fn dtype_strategy() -> impl Strategy<Value = Dtype> {
    proptest::sample::select(Dtype::ALL.to_vec())
}

fn tensor_strategy() -> impl Strategy<Value = (Dtype, Vec<u64>)> {
    (dtype_strategy(), proptest::collection::vec(0u64..6, 0..4)).prop_map(|(dtype, mut shape)| {
        // Sub-byte kinds need whole bytes: pad the last dimension to a multiple of 4.
        if dtype.size().is_none() {
            match shape.last_mut() {
                Some(d) => *d = d.next_multiple_of(4),
                None => shape.push(4),
            }
        }
        (dtype, shape)
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Random tensors through `serialize_header` and zero data come back from
    /// `parse_header` as the same entries, in file order.
    #[test]
    fn serialize_then_parse_round_trips(
        tensors in proptest::collection::btree_map("[a-zA-Z0-9_.\"\\\\/ é\u{1F600}\t-]{1,12}", tensor_strategy(), 0..12),
        metadata in proptest::option::of(proptest::collection::btree_map("[a-z\"é]{0,6}", "[ -~é]{0,10}", 0..4)),
    ) {
        let tensors: Vec<(String, Dtype, Vec<u64>)> = tensors
            .into_iter()
            .filter(|(name, _)| name != "__metadata__")
            .map(|(name, (dtype, shape))| (name, dtype, shape))
            .collect();
        let (prefix, infos) = serialize_header(&tensors, metadata.as_ref()).unwrap();
        prop_assert_eq!(prefix.len() % 8, 0);
        let data_len = infos.last().map_or(0, |t| t.data_offsets.1);
        let mut file = prefix.clone();
        file.resize(prefix.len() + data_len as usize, 0);
        let header = parse_header(&file, file.len() as u64).unwrap();
        prop_assert_eq!(header.data_start(), prefix.len() as u64);
        prop_assert_eq!(header.data_len(), data_len);
        prop_assert_eq!(&header.metadata, &metadata);
        // Empty tensors share offsets, so the two may order those differently.
        let by_name = |v: &[tensorferry::format::TensorInfo]| {
            let mut v = v.to_vec();
            v.sort_by(|a, b| a.name.cmp(&b.name));
            v
        };
        prop_assert_eq!(by_name(&header.tensors), by_name(&infos));
        for (name, dtype, shape) in &tensors {
            let t = header.tensor(name).unwrap();
            prop_assert_eq!(t.dtype, *dtype);
            prop_assert_eq!(&t.shape, shape);
            prop_assert_eq!(t.len(), dtype.bytes_for(shape.iter().product()).unwrap());
        }
        // Data order: dtype descending, then name, as the reference writes it.
        let nonempty: Vec<_> = infos.iter().filter(|t| !t.is_empty()).collect();
        prop_assert!(nonempty.windows(2).all(|w| (std::cmp::Reverse(w[0].dtype), &w[0].name) < (std::cmp::Reverse(w[1].dtype), &w[1].name)));
    }

    /// Whatever the bytes, parsing returns (never panics) and a success is self-consistent.
    #[test]
    fn parse_header_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256), extra in 0u64..64) {
        let len = bytes.len() as u64 + extra;
        if let Ok(h) = parse_header(&bytes, len) {
            prop_assert_eq!(h.data_start() + h.data_len(), len);
        }
    }

    /// Near-valid headers (entries with consistent or slightly wrong offsets, dimensions
    /// from 0 to 2^64 - 1) reach the validation code; it returns, never panics, and a
    /// success describes exactly the file.
    #[test]
    fn parse_header_never_panics_on_near_valid_headers(
        (json, data_len) in near_valid_header(),
        file_delta in prop_oneof![Just(0u64), 0u64..3],
    ) {
        let prefix = st_bytes(json.as_bytes(), 0);
        let file_len = (prefix.len() as u64).saturating_add(data_len).saturating_add(file_delta);
        if let Ok(h) = parse_header(&prefix, file_len) {
            prop_assert_eq!(h.data_start() + h.data_len(), file_len);
            for t in &h.tensors {
                prop_assert_eq!(t.len(), t.dtype.bytes_for(t.elements()).unwrap());
            }
        }
    }
}

/// A header of up to 4 tensors whose offsets follow each other (or, now and then, are off
/// by a little), with its data length.
fn near_valid_header() -> impl Strategy<Value = (String, u64)> {
    let dim = prop_oneof![
        4 => 0u64..5,
        1 => Just(1u64 << 32),
        1 => Just((1u64 << 61) - 1),
        1 => Just(u64::MAX),
    ];
    let dtype = proptest::sample::select(vec!["U8", "F32", "F4", "BF16", "F6_E2M3", "I64"]);
    let tensor = (
        dtype,
        proptest::collection::vec(dim, 0..3),
        proptest::bool::weighted(0.2),
        1u64..3,
    );
    proptest::collection::vec(tensor, 0..5).prop_map(|tensors| {
        let mut offset = 0u64;
        let mut parts = Vec::new();
        for (i, (dtype, shape, perturb, delta)) in tensors.into_iter().enumerate() {
            let bytes = shape
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .and_then(|e| dtype.parse::<Dtype>().unwrap().bytes_for(e).ok())
                .unwrap_or(1);
            let (begin, end) = if perturb {
                (
                    offset.saturating_add(delta),
                    offset.wrapping_add(bytes).wrapping_sub(delta),
                )
            } else {
                (offset, offset.saturating_add(bytes))
            };
            parts.push(entry(
                &format!("t{i}"),
                dtype,
                &format!("{shape:?}"),
                begin,
                end,
            ));
            offset = end;
        }
        (format!("{{{}}}", parts.join(",")), offset)
    })
}

// ---- index files -------------------------------------------------------------------

/// A directory with the two fixture shards and an index of `weight_map` (JSON text).
fn index_dir(weight_map: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    for shard in [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ] {
        std::fs::copy(fixture(&format!("sharded/{shard}")), dir.path().join(shard)).unwrap();
    }
    let index = write(
        dir.path(),
        "model.safetensors.index.json",
        format!("{{\"metadata\":{{\"total_size\":1}},\"weight_map\":{weight_map}}}").as_bytes(),
    );
    (dir, index)
}

const S1: &str = "model-00001-of-00002.safetensors";
const S2: &str = "model-00002-of-00002.safetensors";

#[test]
fn index_with_an_absolute_shard_path() {
    let (_dir, index) = index_dir(&format!(
        "{{\"embed.weight\":\"{S1}\",\"layers.1.bias\":\"/etc/passwd\"}}"
    ));
    assert_variant!(
        invalid(&index),
        FormatError::UnsafeShardName { shard } if shard == "/etc/passwd"
    );
}

#[test]
fn index_with_dot_dot_in_a_shard_path() {
    for shard in [
        "../model-00001-of-00002.safetensors",
        "sub/../../x.safetensors",
        "..",
        "",
    ] {
        let (_dir, index) = index_dir(&format!("{{\"embed.weight\":\"{shard}\"}}"));
        assert_variant!(
            invalid(&index),
            FormatError::UnsafeShardName { shard: s } if s == shard
        );
    }
}

#[test]
fn index_naming_a_missing_shard() {
    let (dir, index) = index_dir(&format!(
        "{{\"embed.weight\":\"{S1}\",\"x\":\"model-00003-of-00002.safetensors\"}}"
    ));
    let err = Checkpoint::open(&index).unwrap_err();
    let missing = dir.path().join("model-00003-of-00002.safetensors");
    assert!(
        matches!(&err, Error::NotFound { path } if *path == missing),
        "{err:?}"
    );
    assert!(err.to_string().contains(&missing.display().to_string()));
}

#[test]
fn index_listing_a_tensor_twice() {
    let (_dir, index) = index_dir(&format!(
        "{{\"embed.weight\":\"{S1}\",\"embed.weight\":\"{S2}\"}}"
    ));
    assert_variant!(
        invalid(&index),
        FormatError::BadIndex { message } if message.contains("\"embed.weight\"")
    );
}

#[test]
fn index_naming_a_tensor_its_shard_lacks() {
    // `embed.weight` is in the first shard, not the second.
    let (dir, index) = index_dir(&format!(
        "{{\"embed.weight\":\"{S2}\",\"layers.1.bias\":\"{S2}\"}}"
    ));
    let err = Checkpoint::open(&index).unwrap_err();
    let shard = dir.path().join(S2);
    assert!(
        matches!(&err, Error::TensorNotFound { path, name } if *path == shard && name == "embed.weight"),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(msg.contains(&shard.display().to_string()) && msg.contains("embed.weight"));
}

#[test]
fn index_that_is_not_an_index() {
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in [
        ("not_json", "weight_map"),
        ("no_weight_map", "{\"metadata\":{}}"),
        ("weight_map_array", "{\"weight_map\":[\"a\"]}"),
        ("shard_not_string", "{\"weight_map\":{\"a\":1}}"),
    ] {
        let path = write(dir.path(), &format!("{name}.index.json"), text.as_bytes());
        assert_variant!(invalid(&path), FormatError::BadIndex { .. });
    }
}

// ---- raw files -----------------------------------------------------------------------

#[test]
fn raw_ranges_that_do_not_fit_the_file() {
    let loader = Loader::new(LoadOptions {
        engine: EngineChoice::Pread,
        ..LoadOptions::default()
    });
    let raw = fixture("raw.bin");
    let len = expected().raw.len;
    let spec = |offset, num_elements, dtype| RawSpec {
        offset,
        num_elements,
        dtype,
    };
    for (s, check) in [
        (
            spec(0, Some(len + 1), Dtype::U8),
            (|e: &FormatError| matches!(e, FormatError::RawPastEnd { .. }))
                as fn(&FormatError) -> bool,
        ),
        (spec(len - 3, Some(1), Dtype::F32), |e| {
            matches!(
                e,
                FormatError::RawPastEnd {
                    offset: 20_000,
                    len: 4,
                    file_len: 20_003
                }
            )
        }),
        (spec(len + 1, None, Dtype::U8), |e| {
            matches!(e, FormatError::RawPastEnd { .. })
        }),
        (spec(len + 1, Some(0), Dtype::U8), |e| {
            matches!(e, FormatError::RawPastEnd { .. })
        }),
        (spec(u64::MAX, Some(1), Dtype::U8), |e| {
            matches!(e, FormatError::RawPastEnd { .. })
        }),
        (spec(0, Some(u64::MAX), Dtype::F32), |e| {
            matches!(e, FormatError::Overflow { .. })
        }),
        // 20003 bytes are not whole F32 elements.
        (spec(0, None, Dtype::F32), |e| {
            matches!(e, FormatError::MisalignedSubByte { .. })
        }),
        (spec(0, Some(3), Dtype::F4), |e| {
            matches!(e, FormatError::MisalignedSubByte { .. })
        }),
    ] {
        let err = loader.load_raw(&raw, s).unwrap_err();
        assert!(
            err.to_string().contains(&raw.display().to_string()),
            "{err}"
        );
        match err {
            Error::InvalidFile { path, source } => {
                assert_eq!(path, raw);
                assert!(check(&source), "{s:?}: {source:?}");
            }
            other => panic!("{s:?}: {other:?}"),
        }
    }
}
