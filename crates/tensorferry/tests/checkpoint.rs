//! `Checkpoint::open` on each kind of path (a file, an index, a directory with an index,
//! a directory of `*.safetensors`), name order, and lookups.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tensorferry::format::safetensors::serialize_header;
use tensorferry::{Checkpoint, Dtype, Error, FormatError, Loader, TensorEntry};

use common::{expected, fixture};

const S1: &str = "model-00001-of-00002.safetensors";
const S2: &str = "model-00002-of-00002.safetensors";

fn names(ck: &Checkpoint) -> Vec<&str> {
    ck.tensors.iter().map(TensorEntry::name).collect()
}

/// Writes a safetensors file of `tensors` (zero data) with the crate's own serializer.
fn write_st(path: &Path, tensors: &[(&str, Dtype, &[u64])]) {
    let owned: Vec<(String, Dtype, Vec<u64>)> = tensors
        .iter()
        .map(|(n, d, s)| ((*n).to_string(), *d, s.to_vec()))
        .collect();
    let (mut bytes, infos) = serialize_header(&owned, None).unwrap();
    let data = infos.last().map_or(0, |t| t.data_offsets.1);
    bytes.resize(bytes.len() + data as usize, 0);
    std::fs::write(path, bytes).unwrap();
}

/// The checks every opened fixture checkpoint must pass: tensors sorted by name and
/// unique, each where the reference put it.
fn check_layout(ck: &Checkpoint) {
    let n = names(ck);
    let mut sorted = n.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(n, sorted, "names sorted and unique");
    assert_eq!(ck.headers.len(), ck.files.len());
    assert_eq!(ck.file_lens.len(), ck.files.len());
    for t in &ck.tensors {
        let (fexp, texp) = common::expected_tensor(ck, t.name());
        assert_eq!(t.dtype().name(), texp.dtype);
        assert_eq!(t.shape(), texp.shape);
        assert_eq!(t.file_offset, 8 + fexp.header_len + texp.data_offsets.0);
        assert_eq!(t.len(), texp.data_offsets.1 - texp.data_offsets.0);
        assert_eq!(ck.file_lens[t.file], fexp.file_len);
    }
}

#[test]
fn open_a_single_file() {
    for rel in common::SINGLE_FILES {
        let path = fixture(rel);
        let ck = Checkpoint::open(&path).unwrap();
        let fexp = &expected().files[rel];
        assert_eq!(ck.path, path);
        assert_eq!(ck.files, std::slice::from_ref(&path));
        assert!(!ck.sharded);
        assert_eq!(ck.metadata, fexp.metadata, "{rel}");
        let want: Vec<&str> = fexp.tensors.keys().map(String::as_str).collect();
        assert_eq!(names(&ck), want, "{rel}");
        assert_eq!(ck.headers[0].header_len, fexp.header_len);
        let total: u64 = fexp
            .tensors
            .values()
            .map(|t| t.data_offsets.1 - t.data_offsets.0)
            .sum();
        assert_eq!(ck.total_bytes(), total);
        check_layout(&ck);
    }
}

fn check_sharded(ck: &Checkpoint) {
    let exp = &expected().sharded;
    assert!(ck.sharded);
    assert_eq!(
        ck.files,
        [
            fixture(&format!("sharded/{S1}")),
            fixture(&format!("sharded/{S2}"))
        ]
    );
    let want: Vec<&str> = exp.weight_map.keys().map(String::as_str).collect();
    assert_eq!(names(ck), want);
    for t in &ck.tensors {
        assert_eq!(
            ck.files[t.file].file_name().unwrap().to_str().unwrap(),
            exp.weight_map[t.name()],
            "{}",
            t.name()
        );
    }
    assert_eq!(ck.total_bytes(), exp.total_size);
    // The index's metadata, numbers as JSON text.
    let meta: BTreeMap<String, String> =
        [("total_size".to_string(), exp.total_size.to_string())].into();
    assert_eq!(ck.metadata.as_ref(), Some(&meta));
    check_layout(ck);
}

#[test]
fn open_an_index_file() {
    let index = fixture(&expected().sharded.index);
    let ck = Checkpoint::open(&index).unwrap();
    assert_eq!(ck.path, index);
    check_sharded(&ck);
}

#[test]
fn open_a_directory_with_an_index() {
    let ck = Checkpoint::open(fixture("sharded")).unwrap();
    // The index is what was opened.
    assert_eq!(ck.path, fixture(&expected().sharded.index));
    check_sharded(&ck);
}

#[test]
fn open_an_index_by_a_relative_path() {
    // Integration tests run in the package's directory; shards resolve against the
    // index's own directory, relative as it was given.
    let dir = Path::new("tests/fixtures/sharded");
    let ck = Checkpoint::open(dir.join("model.safetensors.index.json")).unwrap();
    assert_eq!(ck.files, [dir.join(S1), dir.join(S2)]);
    let want: Vec<&str> = expected()
        .sharded
        .weight_map
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(names(&ck), want);
    let (tensors, _) = Loader::default().load_checkpoint(&ck).unwrap();
    assert_eq!(tensors.len(), want.len());
}

#[test]
fn open_a_directory_of_safetensors_without_an_index() {
    let dir = tempfile::tempdir().unwrap();
    // Given in reverse order, with files that are not safetensors beside them.
    for shard in [S2, S1] {
        std::fs::copy(fixture(&format!("sharded/{shard}")), dir.path().join(shard)).unwrap();
    }
    std::fs::write(dir.path().join("README.md"), "not a tensor file").unwrap();
    std::fs::write(dir.path().join("config.json"), "{}").unwrap();
    std::fs::create_dir(dir.path().join("sub.safetensors.d")).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.path, dir.path());
    assert!(ck.sharded);
    assert_eq!(ck.files, [dir.path().join(S1), dir.path().join(S2)]);
    let want: Vec<&str> = expected()
        .sharded
        .weight_map
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(names(&ck), want);
    for t in &ck.tensors {
        assert_eq!(
            ck.files[t.file].file_name().unwrap().to_str().unwrap(),
            expected().sharded.weight_map[t.name()]
        );
    }
    // The shards' own metadata is not the checkpoint's.
    assert_eq!(ck.metadata, None);

    // The tensors load from where the checkpoint says they are.
    let (tensors, _) = Loader::default().load_checkpoint(&ck).unwrap();
    for t in &tensors {
        let want = &expected().files
            [&format!("sharded/{}", expected().sharded.weight_map[&t.name])]
            .tensors[&t.name];
        assert_eq!(common::sha256_hex(&t.data), want.sha256, "{}", t.name);
    }
}

#[test]
fn a_directory_with_neither_index_nor_safetensors() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("model.bin"), b"x").unwrap();
    let err = Checkpoint::open(dir.path()).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    assert!(err.to_string().contains(&dir.path().display().to_string()));
}

#[test]
fn a_tensor_in_two_files_of_a_directory_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    write_st(
        &dir.path().join("a.safetensors"),
        &[("x", Dtype::F32, &[2])],
    );
    write_st(
        &dir.path().join("b.safetensors"),
        &[("x", Dtype::F32, &[2]), ("y", Dtype::U8, &[1])],
    );
    let err = Checkpoint::open(dir.path()).unwrap_err();
    let b = dir.path().join("b.safetensors");
    assert!(
        matches!(&err, Error::InvalidFile { path, source: FormatError::DuplicateTensor { name } } if *path == b && name == "x"),
        "{err:?}"
    );
}

#[test]
fn the_index_decides_which_tensors_belong() {
    // The first shard also holds a tensor the index does not list, and a copy of a
    // tensor the index places in the second shard.
    let dir = tempfile::tempdir().unwrap();
    write_st(
        &dir.path().join("s1.safetensors"),
        &[
            ("a", Dtype::F32, &[2]),
            ("b", Dtype::U8, &[3]),
            ("stray", Dtype::I64, &[1]),
        ],
    );
    write_st(
        &dir.path().join("s2.safetensors"),
        &[("b", Dtype::U8, &[3]), ("c", Dtype::F16, &[5])],
    );
    for metadata in ["\"metadata\":{\"total_size\":17},", ""] {
        let index = dir.path().join("model.safetensors.index.json");
        std::fs::write(
            &index,
            format!(
                "{{{metadata}\"weight_map\":{{\"a\":\"s1.safetensors\",\"b\":\"s2.safetensors\",\"c\":\"s2.safetensors\"}}}}"
            ),
        )
        .unwrap();
        let ck = Checkpoint::open(dir.path()).unwrap_or_else(|e| panic!("{metadata:?}: {e}"));
        assert_eq!(names(&ck), ["a", "b", "c"], "{metadata:?}");
        let b = ck.tensor("b").unwrap();
        assert_eq!(ck.files[b.file], dir.path().join("s2.safetensors"));
        let err = ck.tensor("stray").unwrap_err();
        assert!(
            matches!(&err, Error::TensorNotFound { name, .. } if name == "stray"),
            "{err:?}"
        );
        assert_eq!(ck.total_bytes(), 8 + 3 + 10);
    }
}

/// Regression: a tensor held by two shards was refused as a duplicate when the index had
/// no `metadata` object, though the index says which shard is the truth (as it does when
/// the index has metadata).
#[test]
fn index_without_metadata_resolves_duplicates_like_one_with_metadata() {
    let dir = tempfile::tempdir().unwrap();
    write_st(
        &dir.path().join("s1.safetensors"),
        &[("x", Dtype::U8, &[4])],
    );
    write_st(
        &dir.path().join("s2.safetensors"),
        &[("x", Dtype::U8, &[4]), ("y", Dtype::U8, &[1])],
    );
    let index = dir.path().join("model.safetensors.index.json");
    std::fs::write(
        &index,
        "{\"weight_map\":{\"x\":\"s1.safetensors\",\"y\":\"s2.safetensors\"}}",
    )
    .unwrap();
    let ck = Checkpoint::open(&index).unwrap();
    assert_eq!(names(&ck), ["x", "y"]);
    assert_eq!(
        ck.files[ck.tensor("x").unwrap().file],
        dir.path().join("s1.safetensors")
    );
    assert_eq!(ck.metadata, None);
}

#[test]
fn names_are_sorted_by_bytes() {
    let ck = Checkpoint::open(fixture("odd_shapes.safetensors")).unwrap();
    let n = names(&ck);
    let mut want: Vec<&str> = expected().files["odd_shapes.safetensors"]
        .tensors
        .keys()
        .map(String::as_str)
        .collect();
    want.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
    assert_eq!(n, want);
    assert!(n.contains(&"ünïcödé.weight") && n.contains(&"quote\"back\\slash\tname"));
    // Header::sorted_names agrees.
    assert_eq!(ck.headers[0].sorted_names(), want);
    // Data order differs from name order (the reference writes by dtype first).
    let file_order: Vec<&str> = ck.headers[0]
        .tensors
        .iter()
        .map(|t| t.name.as_str())
        .collect();
    assert_ne!(file_order, want);
}

#[test]
fn tensor_lookup() {
    let ck = Checkpoint::open(fixture("dtypes.safetensors")).unwrap();
    for name in expected().files["dtypes.safetensors"].tensors.keys() {
        assert_eq!(ck.tensor(name).unwrap().name(), name);
    }
    for missing in ["", "F32", "f32 ", "zzz", "__metadata__", "format"] {
        let err = ck.tensor(missing).unwrap_err();
        assert!(
            matches!(&err, Error::TensorNotFound { path, name } if *path == ck.path && name == missing),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(msg.contains(&ck.path.display().to_string()), "{msg}");
        assert!(msg.contains(&format!("{missing:?}")), "{msg}");
    }
    // Loading a missing name fails the same way, before any read.
    let err = Loader::default()
        .load_tensors(&ck, &["f32", "nope"])
        .unwrap_err();
    assert!(
        matches!(&err, Error::TensorNotFound { name, .. } if name == "nope"),
        "{err:?}"
    );
    // In a sharded checkpoint the error names what was opened.
    let ck = Checkpoint::open(fixture("sharded")).unwrap();
    let err = ck.tensor("layers.2.bias").unwrap_err();
    assert!(
        matches!(&err, Error::TensorNotFound { path, .. } if *path == fixture(&expected().sharded.index)),
        "{err:?}"
    );
}

#[test]
fn a_header_longer_than_the_first_read() {
    let ck = Checkpoint::open(fixture("long_header.safetensors")).unwrap();
    assert!(ck.headers[0].header_len > 64 * 1024);
    let blob = &ck.metadata.as_ref().unwrap()["blob"];
    assert_eq!(blob.len(), 70_000);
    assert!(blob.starts_with("abcdefghijklmnopqrstuvwxyzabc"));
    check_layout(&ck);
}

#[test]
fn missing_paths_are_not_found() {
    let dir = tempfile::tempdir().unwrap();
    for p in [
        dir.path().join("nope.safetensors"),
        dir.path().join("nope.index.json"),
        dir.path().join("nope"),
    ] {
        let err = Checkpoint::open(&p).unwrap_err();
        assert!(
            matches!(&err, Error::NotFound { path } if *path == p),
            "{err:?}"
        );
        assert!(err.to_string().contains(&p.display().to_string()));
    }
}

#[test]
fn truncated_files_are_invalid_and_named() {
    let dir = tempfile::tempdir().unwrap();
    let src = std::fs::read(fixture("big.safetensors")).unwrap();
    let header_end = 8 + expected().files["big.safetensors"].header_len as usize;
    for (cut, check) in [
        (
            src.len() - 1,
            (|e: &FormatError| matches!(e, FormatError::DataLengthMismatch { .. }))
                as fn(&FormatError) -> bool,
        ),
        (header_end, |e| {
            matches!(e, FormatError::DataLengthMismatch { .. })
        }),
        (header_end - 1, |e| {
            matches!(e, FormatError::HeaderPastEnd { .. })
        }),
        (7, |e| {
            matches!(e, FormatError::HeaderTooSmall { file_len: 7 })
        }),
    ] {
        let path: PathBuf = dir.path().join(format!("cut{cut}.safetensors"));
        std::fs::write(&path, &src[..cut]).unwrap();
        let err = Checkpoint::open(&path).unwrap_err();
        assert!(err.to_string().contains(&path.display().to_string()));
        match err {
            Error::InvalidFile { path: p, source } => {
                assert_eq!(p, path);
                assert!(check(&source), "cut at {cut}: {source:?}");
            }
            other => panic!("cut at {cut}: {other:?}"),
        }
    }
}

/// Regression: two spellings of one shard in an index (`s1.safetensors` and
/// `./s1.safetensors`) opened the file twice and listed each of its tensors twice.
#[test]
fn index_spelling_one_shard_two_ways_lists_each_tensor_once() {
    let dir = tempfile::tempdir().unwrap();
    write_st(
        &dir.path().join("s1.safetensors"),
        &[("x", Dtype::U8, &[4]), ("y", Dtype::F32, &[1])],
    );
    let index = dir.path().join("model.safetensors.index.json");
    std::fs::write(
        &index,
        "{\"weight_map\":{\"x\":\"s1.safetensors\",\"y\":\"./s1.safetensors\"}}",
    )
    .unwrap();
    let ck = Checkpoint::open(&index).unwrap();
    assert_eq!(names(&ck), ["x", "y"]);
    assert_eq!(ck.files.len(), 1);
    assert_eq!(ck.total_bytes(), 8);
    let (tensors, report) = Loader::default().load_checkpoint(&ck).unwrap();
    assert_eq!(tensors.len(), 2);
    assert_eq!(report.bytes, 8);
}
