//! The store path: saves read back bit-exact through the loader (every dtype, odd sizes,
//! staging so small that tensors straddle slots and 4 KiB boundaries, `O_DIRECT` on and
//! off), byte-identical re-saves of the reference fixtures, sharded checkpoints against
//! Hugging Face's index format, raw positioned writes, durability (stale temporary files,
//! cancellation, no space left on a small tmpfs) and CUDA sources where a GPU is present.
//! Whatever the machine cannot run is skipped with the reason printed.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Mutex;

use tensorferry::device::cuda;
use tensorferry::format::index::INDEX_FILE_NAME;
use tensorferry::format::safetensors;
use tensorferry::saver::plan_shards;
use tensorferry::source::local::supports_direct;
use tensorferry::{
    Checkpoint, DeviceRegion, DirectPolicy, Dtype, Error, Loader, SaveControl, SaveOptions,
    SaveSource, SaveTensor, Saver,
};

use common::{expected, fixture, pseudo_random_bytes, Owned};

/// Staging of 4 KiB slots, three of them: tensors straddle slots and every write of a
/// file of more than 12 KiB waits for a slot.
fn tiny(direct: DirectPolicy) -> Saver {
    Saver::new(SaveOptions {
        threads: 2,
        slot_size: 4096,
        slots: 3,
        direct,
        streams: 2,
        ..SaveOptions::default()
    })
}

/// One tensor per dtype and shape: scalars, empty tensors, odd byte counts, and a few
/// large enough to straddle several 4 KiB slots.
fn every_dtype() -> Vec<Owned> {
    let shapes: [&[u64]; 8] = [
        &[],
        &[0],
        &[3, 0],
        &[1],
        &[7],
        &[3, 5],
        &[2, 3, 5],
        &[1001, 3],
    ];
    let mut out = Vec::new();
    for (i, d) in Dtype::ALL.iter().enumerate() {
        for (j, s) in shapes.iter().enumerate() {
            let name = format!("{}.{j}", d.name());
            out.extend(Owned::new(&name, *d, s, (i * 10 + j) as u64));
        }
    }
    out.extend(Owned::new("odd.u8", Dtype::U8, &[10_007], 99));
    out.extend(Owned::new("big.f32", Dtype::F32, &[9001], 98));
    out
}

/// What the file must hold: the reference header, then the data in its order.
fn expected_file(
    tensors: &[Owned],
    metadata: Option<&BTreeMap<String, String>>,
) -> (Vec<u8>, Vec<String>) {
    let described: Vec<_> = tensors
        .iter()
        .map(|t| (t.name.clone(), t.dtype, t.shape.clone()))
        .collect();
    let (mut out, infos) = safetensors::serialize_header(&described, metadata).unwrap();
    for info in &infos {
        let t = tensors.iter().find(|t| t.name == info.name).unwrap();
        out.extend_from_slice(&t.data);
    }
    (out, infos.into_iter().map(|i| i.name).collect())
}

/// Names in `dir` other than `keep`.
fn others(dir: &Path, keep: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !keep.contains(&n.as_str()))
        .collect();
    v.sort();
    v
}

fn check_loads_back(path: &Path, tensors: &[Owned]) {
    let ck = Checkpoint::open(path).unwrap();
    let (loaded, _) = Loader::default().load_checkpoint(&ck).unwrap();
    assert_eq!(loaded.len(), tensors.len());
    for t in tensors {
        let l = loaded.iter().find(|l| l.name == t.name).unwrap();
        assert_eq!(l.dtype, t.dtype, "{}", t.name);
        assert_eq!(l.shape, t.shape, "{}", t.name);
        assert!(*l.data == *t.data, "{}: bytes differ", t.name);
    }
}

fn direct_skip(dir: &Path) -> Option<String> {
    let probe = dir.join("direct-probe");
    std::fs::write(&probe, [0u8; 4096]).unwrap();
    let ok = supports_direct(&probe);
    std::fs::remove_file(&probe).unwrap();
    (!ok).then(|| format!("the file system of {} refuses O_DIRECT", dir.display()))
}

#[test]
fn roundtrip_every_dtype_through_tiny_staging_direct_on_and_off() {
    let tensors = every_dtype();
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    for policy in [DirectPolicy::Off, DirectPolicy::On, DirectPolicy::Auto] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("all.safetensors");
        let saver = tiny(policy);
        let list: Vec<SaveTensor> = tensors.iter().map(Owned::save).collect();
        let report = saver
            .save_safetensors(&path, &list, Some(&metadata))
            .unwrap();
        let (want, _) = expected_file(&tensors, Some(&metadata));
        assert_eq!(std::fs::read(&path).unwrap(), want, "{policy}: file bytes");
        assert_eq!(report.bytes, want.len() as u64);
        assert_eq!(report.files.len(), 1);
        let direct = report.files[0].direct;
        match policy {
            DirectPolicy::Off | DirectPolicy::Auto => assert!(!direct, "{policy}"),
            DirectPolicy::On => match direct_skip(dir.path()) {
                Some(why) => eprintln!("SKIP O_DIRECT check: {why}"),
                None => assert!(direct, "O_DIRECT was not used"),
            },
        }
        check_loads_back(&path, &tensors);
        assert_eq!(
            others(dir.path(), &["all.safetensors"]),
            Vec::<String>::new()
        );
    }
}

#[test]
fn tails_of_every_length_around_4k_boundaries() {
    // Files whose size ends just before, at and after 4 KiB multiples: the padded last
    // write and the truncation to the exact size.
    let dir = tempfile::tempdir().unwrap();
    for policy in [DirectPolicy::On, DirectPolicy::Off] {
        let saver = tiny(policy);
        for n in [
            0usize,
            1,
            4000,
            4007,
            4008,
            4009,
            8192 - 80,
            8192 - 72,
            12_345,
        ] {
            let t = Owned::new("x", Dtype::U8, &[n as u64], n as u64).unwrap();
            let path = dir.path().join(format!("t{n}.safetensors"));
            saver.save_safetensors(&path, &[t.save()], None).unwrap();
            let (want, _) = expected_file(std::slice::from_ref(&t), None);
            assert_eq!(std::fs::read(&path).unwrap(), want, "{policy} {n}");
        }
    }
}

#[test]
fn resaving_the_reference_fixtures_is_byte_identical() {
    let exp = expected();
    let reader = Loader::default();
    for (rel, f) in &exp.files {
        if !f.writer.starts_with("safetensors.") {
            continue; // written by hand, not in the reference layout
        }
        let ck = Checkpoint::open(fixture(rel)).unwrap();
        let (loaded, _) = reader.load_checkpoint(&ck).unwrap();
        let list: Vec<SaveTensor> = loaded
            .iter()
            .map(|t| SaveTensor {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                source: SaveSource::Host(&t.data),
            })
            .collect();
        for policy in [DirectPolicy::On, DirectPolicy::Off] {
            let dir = tempfile::tempdir().unwrap();
            let out = dir.path().join("again.safetensors");
            tiny(policy)
                .save_safetensors(&out, &list, f.metadata.as_ref())
                .unwrap();
            assert!(
                std::fs::read(&out).unwrap() == std::fs::read(fixture(rel)).unwrap(),
                "{rel} ({policy}): bytes differ from the reference's"
            );
        }
    }
}

#[test]
fn one_saver_many_threads() {
    let saver = tiny(DirectPolicy::On);
    let dir = tempfile::tempdir().unwrap();
    let sets: Vec<Vec<Owned>> = (0..4)
        .map(|i| {
            (0..5)
                .filter_map(|j| {
                    Owned::new(&format!("t{j}"), Dtype::F32, &[1000 + j * 37], i * 100 + j)
                })
                .collect()
        })
        .collect();
    std::thread::scope(|s| {
        for (i, set) in sets.iter().enumerate() {
            let (saver, dir) = (&saver, dir.path());
            s.spawn(move || {
                let list: Vec<SaveTensor> = set.iter().map(Owned::save).collect();
                let p = dir.join(format!("m{i}.safetensors"));
                saver.save_safetensors(&p, &list, None).unwrap();
            });
        }
    });
    for (i, set) in sets.iter().enumerate() {
        check_loads_back(&dir.path().join(format!("m{i}.safetensors")), set);
    }
}

#[test]
fn bad_requests_are_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    std::fs::write(&path, b"previous").unwrap();
    let data = vec![0u8; 12];
    let t = |name: &str, shape: &[u64]| SaveTensor {
        name: name.to_string(),
        dtype: Dtype::F32,
        shape: shape.to_vec(),
        source: SaveSource::Host(&data),
    };
    let saver = tiny(DirectPolicy::Off);
    for list in [
        vec![t("a", &[4])],               // 16 bytes wanted, 12 given
        vec![t("a", &[3]), t("a", &[3])], // twice
        vec![t("__metadata__", &[3])],
    ] {
        let e = saver.save_safetensors(&path, &list, None).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    }
    let e = saver
        .save_safetensors(dir.path(), &[t("a", &[3])], None)
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let e = saver
        .save_safetensors(
            dir.path().join("no/such/dir/m.safetensors"),
            &[t("a", &[3])],
            None,
        )
        .unwrap_err();
    assert!(matches!(e, Error::NotFound { .. }), "{e}");
    assert_eq!(std::fs::read(&path).unwrap(), b"previous");
    assert_eq!(others(dir.path(), &["m.safetensors"]), Vec::<String>::new());
}

#[test]
fn stale_temporaries_are_removed_and_cancel_keeps_the_previous_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    let stale = [".m.safetensors.tf-tmp-abcdefgh", ".m.safetensors.tf-tmp-x"];
    for s in stale {
        std::fs::write(dir.path().join(s), b"partial").unwrap();
    }
    // A temporary of another file is not ours to remove.
    std::fs::write(dir.path().join(".n.safetensors.tf-tmp-abcdefgh"), b"x").unwrap();
    let a = Owned::new("a", Dtype::I32, &[5000], 1).unwrap();
    let saver = tiny(DirectPolicy::On);
    saver.save_safetensors(&path, &[a.save()], None).unwrap();
    assert_eq!(
        others(dir.path(), &["m.safetensors"]),
        vec![".n.safetensors.tf-tmp-abcdefgh".to_string()]
    );
    let before = std::fs::read(&path).unwrap();
    let cancel = AtomicBool::new(true);
    let b = Owned::new("b", Dtype::I32, &[7000], 2).unwrap();
    let e = saver
        .save_safetensors_with(
            &path,
            &[b.save()],
            None,
            SaveControl {
                cancel: Some(&cancel),
                progress: None,
                ..SaveControl::default()
            },
        )
        .unwrap_err();
    assert!(matches!(e, Error::Cancelled), "{e}");
    assert_eq!(std::fs::read(&path).unwrap(), before);
    assert_eq!(
        others(
            dir.path(),
            &["m.safetensors", ".n.safetensors.tf-tmp-abcdefgh"]
        )
        .len(),
        0
    );
}

#[test]
fn progress_reaches_the_file_size() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p.safetensors");
    let t = Owned::new("a", Dtype::F16, &[20_000], 4).unwrap();
    let seen = std::sync::Arc::new(Mutex::new(Vec::new()));
    let sink = std::sync::Arc::clone(&seen);
    let progress = move |done: u64, total: u64| sink.lock().unwrap().push((done, total));
    let report = tiny(DirectPolicy::On)
        .save_safetensors_with(
            &path,
            &[t.save()],
            None,
            SaveControl {
                cancel: None,
                progress: Some(&progress),
                ..SaveControl::default()
            },
        )
        .unwrap();
    let seen = seen.lock().unwrap().clone();
    assert!(seen.len() > 5);
    assert!(seen.iter().all(|&(_, total)| total == report.bytes));
    assert_eq!(seen.iter().map(|s| s.0).max(), Some(report.bytes));
}

// --- sharded checkpoints ----------------------------------------------------------------

#[test]
fn sharded_save_writes_hugging_face_layout_and_loads_back() {
    let dir = tempfile::tempdir().unwrap();
    let ck_dir = dir.path().join("ck");
    let tensors: Vec<Owned> = [
        ("embed", 3000u64),
        ("layer.0", 900),
        ("layer.1", 900),
        ("huge", 9000),
        ("layer.2", 1500),
        ("norm", 10),
        ("lm_head", 2500),
    ]
    .iter()
    .enumerate()
    .map(|(i, (n, e))| Owned::new(n, Dtype::BF16, &[*e], i as u64).unwrap())
    .collect();
    let list: Vec<SaveTensor> = tensors.iter().map(Owned::save).collect();
    let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let max = 6000;
    let report = tiny(DirectPolicy::On)
        .save_sharded(&ck_dir, &list, max, Some(&meta))
        .unwrap();
    let lens: Vec<u64> = tensors.iter().map(|t| t.data.len() as u64).collect();
    let shards = plan_shards(&lens, max);
    // embed fills a shard; huge (over the limit) gets its own, placed before the shard
    // being filled; the rest greedily.
    assert_eq!(
        shards,
        vec![vec![0], vec![3], vec![1, 2], vec![4, 5], vec![6]]
    );
    let n = shards.len();
    let names: Vec<String> = (1..=n)
        .map(|i| format!("model-{i:05}-of-{n:05}.safetensors"))
        .collect();
    let mut all: Vec<&str> = names.iter().map(String::as_str).collect();
    all.push(INDEX_FILE_NAME);
    assert_eq!(others(&ck_dir, &all), Vec::<String>::new());
    assert_eq!(report.files.len(), n + 1);
    // The index, as Hugging Face writes it.
    let text = std::fs::read_to_string(ck_dir.join(INDEX_FILE_NAME)).unwrap();
    let idx: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut weight_map = serde_json::Map::new();
    for (s, name) in shards.iter().zip(&names) {
        for &i in s {
            weight_map.insert(tensors[i].name.clone(), name.clone().into());
        }
    }
    assert_eq!(
        idx,
        serde_json::json!({
            "metadata": {"total_size": lens.iter().sum::<u64>()},
            "weight_map": weight_map,
        })
    );
    assert!(text.starts_with("{\n  \"metadata\": {\n    \"total_size\": "));
    assert!(text.ends_with("}\n"));
    // Each shard is the reference layout of its tensors, with the metadata.
    for (s, name) in shards.iter().zip(&names) {
        let part: Vec<Owned> = s
            .iter()
            .map(|&i| {
                Owned::new(&tensors[i].name, Dtype::BF16, &tensors[i].shape, i as u64).unwrap()
            })
            .collect();
        let (want, _) = expected_file(&part, Some(&meta));
        assert_eq!(std::fs::read(ck_dir.join(name)).unwrap(), want, "{name}");
    }
    // Read back through the index, and through the directory.
    check_loads_back(&ck_dir.join(INDEX_FILE_NAME), &tensors);
    check_loads_back(&ck_dir, &tensors);
    let ck = Checkpoint::open(&ck_dir).unwrap();
    assert!(ck.sharded);
    assert_eq!(ck.files.len(), n);

    // Saving again with a larger limit: one file, no index, the old shards gone.
    let other = ck_dir.join("notes.txt");
    std::fs::write(&other, b"keep me").unwrap();
    tiny(DirectPolicy::Off)
        .save_sharded(&ck_dir, &list, 1 << 30, Some(&meta))
        .unwrap();
    assert_eq!(
        others(&ck_dir, &[]),
        vec!["model.safetensors".to_string(), "notes.txt".to_string()]
    );
    check_loads_back(&ck_dir, &tensors);
    // And back to shards: the single file goes.
    tiny(DirectPolicy::Off)
        .save_sharded(&ck_dir, &list, 8000, None)
        .unwrap();
    assert!(!ck_dir.join("model.safetensors").exists());
    check_loads_back(&ck_dir, &tensors);
}

#[test]
fn sharded_save_refuses_bad_requests_before_writing() {
    let dir = tempfile::tempdir().unwrap();
    let t = Owned::new("a", Dtype::U8, &[10], 1).unwrap();
    let saver = tiny(DirectPolicy::Off);
    let e = saver
        .save_sharded(dir.path(), &[t.save()], 0, None)
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let e = saver
        .save_sharded(dir.path(), &[t.save(), t.save()], 5, None)
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert!(others(dir.path(), &[]).is_empty());
    // No tensors at all: one empty file.
    saver.save_sharded(dir.path(), &[], 5, None).unwrap();
    assert_eq!(
        others(dir.path(), &[]),
        vec!["model.safetensors".to_string()]
    );
}

// --- raw positioned writes --------------------------------------------------------------

#[test]
fn write_at_creates_extends_and_overwrites_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("raw.bin");
    let saver = tiny(DirectPolicy::On);
    let a = pseudo_random_bytes(10_000, 1);
    let r = saver.write_at(&path, 3, &SaveSource::Host(&a)).unwrap();
    assert_eq!(r.bytes, 10_000);
    let mut want = vec![0u8; 3];
    want.extend_from_slice(&a);
    assert_eq!(std::fs::read(&path).unwrap(), want);
    let b = pseudo_random_bytes(100, 2);
    saver.write_at(&path, 50, &SaveSource::Host(&b)).unwrap();
    want[50..150].copy_from_slice(&b);
    assert_eq!(
        std::fs::read(&path).unwrap(),
        want,
        "overwrite in place, no truncation"
    );
    // Larger than one buffered write (split over the writer threads).
    let big = pseudo_random_bytes((9 << 20) + 5, 3);
    saver
        .write_at(&path, 20_000, &SaveSource::Host(&big))
        .unwrap();
    want.resize(20_000, 0);
    want.extend_from_slice(&big);
    assert!(std::fs::read(&path).unwrap() == want);
    saver.write_at(&path, 0, &SaveSource::Host(&[])).unwrap();
    let e = saver
        .write_at(dir.path().join("no/such.bin"), 0, &SaveSource::Host(&a))
        .unwrap_err();
    assert!(matches!(e, Error::NotFound { .. }), "{e}");
}

// --- no space left ------------------------------------------------------------------------

/// A tmpfs of `size` mounted on a fresh directory, unmounted on drop.
struct SmallFs {
    dir: tempfile::TempDir,
}

impl SmallFs {
    fn mount(size: &str) -> Result<Self, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .output()
            .map_err(|e| format!("running mount: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "mount -t tmpfs failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(Self { dir })
    }

    fn path(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg(self.dir.path())
            .status();
    }
}

#[test]
fn no_space_left_names_the_path_and_keeps_the_previous_file() {
    let fs = match SmallFs::mount("2M") {
        Ok(fs) => fs,
        Err(why) => {
            eprintln!("SKIP no_space_left: {why}");
            return;
        }
    };
    let dir = fs.path();
    let path = dir.join("m.safetensors");
    let small = Owned::new("a", Dtype::F32, &[25_000], 1).unwrap();
    let large = Owned::new("a", Dtype::F32, &[750_000], 2).unwrap(); // 3 MB
    for policy in [DirectPolicy::Off, DirectPolicy::On] {
        let saver = tiny(policy);
        saver
            .save_safetensors(&path, &[small.save()], None)
            .unwrap();
        let before = std::fs::read(&path).unwrap();
        let e = saver
            .save_safetensors(&path, &[large.save()], None)
            .unwrap_err();
        let msg = e.to_string();
        eprintln!("{policy}: {msg}");
        assert!(msg.contains(&path.display().to_string()), "{msg}");
        match &e {
            Error::Io { source, .. } => {
                assert_eq!(source.raw_os_error(), Some(libc::ENOSPC), "{msg}");
            }
            other => panic!("expected an I/O error, got {other}"),
        }
        assert_eq!(std::fs::read(&path).unwrap(), before, "{policy}");
        assert_eq!(others(&dir, &["m.safetensors"]), Vec::<String>::new());
        // A raw write runs out of room mid-way (no up-front allocation): same error.
        let raw = dir.join("raw.bin");
        let e = saver
            .write_at(&raw, 0, &SaveSource::Host(&large.data))
            .unwrap_err();
        assert!(e.to_string().contains("raw.bin"), "{e}");
        assert!(
            matches!(&e, Error::Io { source, .. } if source.raw_os_error() == Some(libc::ENOSPC)),
            "{e}"
        );
        std::fs::remove_file(&raw).unwrap();
    }
}

// --- CUDA ---------------------------------------------------------------------------------

fn cuda_skip() -> Option<String> {
    match cuda::devices() {
        Ok(d) if !d.is_empty() => None,
        Ok(_) => Some("the CUDA driver sees no device".into()),
        Err(e) => Some(e.to_string()),
    }
}

#[test]
fn cuda_sources_round_trip() {
    if let Some(why) = cuda_skip() {
        eprintln!("SKIP cuda_sources_round_trip: {why}");
        return;
    }
    let ctx = cuda::Context::get(0).unwrap();
    let tensors = every_dtype();
    // Every other tensor from device memory, the rest from the host.
    let mut bufs = Vec::new();
    for t in tensors.iter().step_by(2) {
        let mut b = cuda::DeviceBuffer::alloc(ctx, t.data.len()).unwrap();
        b.copy_from_host(&t.data).unwrap();
        bufs.push(b);
    }
    let list: Vec<SaveTensor> = tensors
        .iter()
        .enumerate()
        .map(|(i, t)| SaveTensor {
            source: if i % 2 == 0 {
                SaveSource::Cuda(DeviceRegion::of(&bufs[i / 2]))
            } else {
                SaveSource::Host(&t.data)
            },
            ..t.save()
        })
        .collect();
    for policy in [DirectPolicy::On, DirectPolicy::Off] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gpu.safetensors");
        tiny(policy).save_safetensors(&path, &list, None).unwrap();
        let (want, _) = expected_file(&tensors, None);
        assert!(std::fs::read(&path).unwrap() == want, "{policy}");
        tiny(policy)
            .save_sharded(dir.path().join("ck"), &list, 5000, None)
            .unwrap();
        check_loads_back(&dir.path().join("ck"), &tensors);
        let raw = dir.path().join("raw.bin");
        tiny(policy)
            .write_at(
                &raw,
                7,
                &SaveSource::Cuda(DeviceRegion::of(&bufs[bufs.len() - 1])),
            )
            .unwrap();
        let from_device = &tensors[(bufs.len() - 1) * 2];
        assert_eq!(std::fs::read(&raw).unwrap()[7..], from_device.data[..]);
    }
}

#[test]
fn sharded_index_metadata_goes_where_hugging_face_puts_it() {
    let dir = tempfile::tempdir().unwrap();
    let tensors: Vec<Owned> = (0..3)
        .map(|i| Owned::new(&format!("t{i}"), Dtype::F32, &[100], i).unwrap())
        .collect();
    let list: Vec<SaveTensor> = tensors.iter().map(Owned::save).collect();
    let shard_meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let user = BTreeMap::from([("note".to_string(), "hi".to_string())]);
    let saver = tiny(DirectPolicy::Off);
    // Sharded: the shards get `metadata`, the index gets total_size and `index_metadata`.
    saver
        .save_sharded_with(
            dir.path(),
            &list,
            400,
            Some(&shard_meta),
            Some(&user),
            SaveControl::default(),
        )
        .unwrap();
    let idx: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join(INDEX_FILE_NAME)).unwrap()).unwrap();
    assert_eq!(
        idx["metadata"],
        serde_json::json!({"total_size": 1200, "note": "hi"})
    );
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.headers.len(), 3);
    assert!(ck
        .headers
        .iter()
        .all(|h| h.metadata.as_ref() == Some(&shard_meta)));
    assert_eq!(ck.metadata.as_ref().unwrap()["note"], "hi");
    // One file: both in its header.
    saver
        .save_sharded_with(
            dir.path(),
            &list,
            1 << 20,
            Some(&shard_meta),
            Some(&user),
            SaveControl::default(),
        )
        .unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(ck.files.len(), 1);
    let mut both = shard_meta.clone();
    both.extend(user.clone());
    assert_eq!(ck.headers[0].metadata.as_ref(), Some(&both));
}
