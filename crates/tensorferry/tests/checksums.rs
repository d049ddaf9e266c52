//! Per-tensor checksums: saves with `checksums` record an xxh3-64 per tensor in the
//! header (still a plain safetensors file), loads with `verify` check them as the bytes
//! pass through staging — through pools so small that tensors straddle slots and their
//! pieces arrive out of order across threads — and name the tensor whose bytes differ.

mod common;
use common::Owned;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tensorferry::checksum::{self, METADATA_KEY};
use tensorferry::device::cuda;
use tensorferry::format::safetensors;
use tensorferry::plan::Extent;
use tensorferry::source::local::supports_direct;
use tensorferry::{
    Checkpoint, DeviceRegion, DirectPolicy, Dtype, EngineChoice, Error, FormatError, LoadOptions,
    Loader, SaveControl, SaveOptions, SaveSource, SaveTensor, Saver,
};

fn saver(slot_size: usize, direct: DirectPolicy) -> Saver {
    Saver::new(SaveOptions {
        threads: 4,
        slot_size,
        slots: 3,
        direct,
        streams: 2,
        ..SaveOptions::default()
    })
}

fn loader(engine: EngineChoice, slot_size: usize, verify: bool) -> Loader {
    Loader::new(LoadOptions {
        engine,
        threads: 4,
        slot_size,
        slots: 4,
        verify,
        ..LoadOptions::default()
    })
}

/// Tensors of several sizes: empty, tiny, and several straddling 4-8 KiB slots.
fn tensors() -> Vec<Owned> {
    vec![
        Owned::new("a.empty", Dtype::F32, &[0], 1).unwrap(),
        Owned::new("b.scalar", Dtype::F64, &[], 2).unwrap(),
        Owned::new("c.odd", Dtype::U8, &[10_007], 3).unwrap(),
        Owned::new("d.big", Dtype::F32, &[9001, 3], 4).unwrap(),
        Owned::new("e.mid", Dtype::BF16, &[4097], 5).unwrap(),
        Owned::new("f \"quoted\"", Dtype::I64, &[513], 6).unwrap(),
        Owned::new("g.big2", Dtype::U8, &[70_001], 7).unwrap(),
    ]
}

fn header(path: &Path) -> safetensors::Header {
    let data = std::fs::read(path).unwrap();
    safetensors::parse_header(&data, data.len() as u64).unwrap()
}

fn save_with_sums(
    s: &Saver,
    path: &Path,
    list: &[SaveTensor<'_>],
    meta: Option<&BTreeMap<String, String>>,
) {
    s.save_safetensors_with(
        path,
        list,
        meta,
        SaveControl {
            checksums: true,
            ..SaveControl::default()
        },
    )
    .unwrap();
}

fn check_loaded(path: &Path, ts: &[Owned], l: &Loader) {
    let ck = Checkpoint::open(path).unwrap();
    let (loaded, _) = l.load_checkpoint(&ck).unwrap();
    assert_eq!(loaded.len(), ts.len());
    for t in ts {
        let got = loaded.iter().find(|x| x.name == t.name).unwrap();
        assert!(*got.data == *t.data, "{}: bytes differ", t.name);
    }
}

fn direct_ok(dir: &Path) -> bool {
    let probe = dir.join("probe");
    std::fs::write(&probe, [0u8; 4096]).unwrap();
    let ok = supports_direct(&probe);
    std::fs::remove_file(&probe).unwrap();
    ok
}

#[test]
fn checksums_round_trip_through_tiny_staging_and_out_of_order_pieces() {
    let ts = tensors();
    let list: Vec<SaveTensor> = ts.iter().map(Owned::save).collect();
    let mut meta = BTreeMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    let dir = tempfile::tempdir().unwrap();
    let mut policies = vec![DirectPolicy::Off];
    if direct_ok(dir.path()) {
        policies.push(DirectPolicy::On);
    } else {
        eprintln!("SKIP O_DIRECT saves: the file system refuses O_DIRECT");
    }
    for policy in policies {
        for slot in [4096, 8192] {
            let path = dir.path().join(format!("m-{policy}-{slot}.safetensors"));
            save_with_sums(&saver(slot, policy), &path, &list, Some(&meta));
            // A plain safetensors header: metadata is a string map, the user's kept.
            let h = header(&path);
            let m = h.metadata.as_ref().unwrap();
            assert_eq!(m["format"], "pt");
            let sums = checksum::parse(&path, Some(m)).unwrap();
            assert_eq!(sums.len(), ts.len());
            for t in &ts {
                assert_eq!(sums[&t.name], checksum::xxh3_64(&t.data), "{}", t.name);
            }
            // Same data layout as without checksums.
            let file = std::fs::read(&path).unwrap();
            for info in &h.tensors {
                let t = ts.iter().find(|t| t.name == info.name).unwrap();
                let at = (h.data_start() + info.data_offsets.0) as usize;
                assert!(file[at..at + t.data.len()] == t.data[..], "{}", t.name);
            }
            for engine in [
                EngineChoice::Pread,
                EngineChoice::Direct,
                EngineChoice::Auto,
            ] {
                for lslot in [4096, 8192] {
                    check_loaded(&path, &ts, &loader(engine, lslot, true));
                }
            }
        }
    }
}

#[test]
fn without_checksums_the_file_is_the_reference_bytes() {
    let ts = tensors();
    let list: Vec<SaveTensor> = ts.iter().map(Owned::save).collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plain.safetensors");
    saver(4096, DirectPolicy::Off)
        .save_safetensors(&path, &list, None)
        .unwrap();
    let described: Vec<_> = ts
        .iter()
        .map(|t| (t.name.clone(), t.dtype, t.shape.clone()))
        .collect();
    let (mut want, infos) = safetensors::serialize_header(&described, None).unwrap();
    for i in &infos {
        want.extend_from_slice(&ts.iter().find(|t| t.name == i.name).unwrap().data);
    }
    assert!(std::fs::read(&path).unwrap() == want);
    // verify on it: refused, saying there are no checksums.
    let ck = Checkpoint::open(&path).unwrap();
    let err = loader(EngineChoice::Auto, 8192, true)
        .load_checkpoint(&ck)
        .unwrap_err();
    assert!(
        matches!(&err, Error::InvalidFile { path: p, source: FormatError::NoChecksums } if *p == path),
        "{err}"
    );
    assert!(
        err.to_string().contains("no tensorferry checksums"),
        "{err}"
    );
}

#[test]
fn a_flipped_data_byte_fails_verify_naming_the_tensor() {
    let ts = tensors();
    let list: Vec<SaveTensor> = ts.iter().map(Owned::save).collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    save_with_sums(&saver(8192, DirectPolicy::Off), &path, &list, None);
    let h = header(&path);
    for victim in ["d.big", "g.big2", "b.scalar"] {
        let info = h.tensor(victim).unwrap();
        let at = h.data_start() + info.data_offsets.0 + info.len() / 2;
        let bad = dir.path().join(format!("bad-{victim}.safetensors"));
        let mut file = std::fs::read(&path).unwrap();
        file[at as usize] ^= 0x01;
        std::fs::write(&bad, &file).unwrap();
        let ck = Checkpoint::open(&bad).unwrap();
        // Without verify it loads (the bytes are as the file holds them).
        loader(EngineChoice::Auto, 4096, false)
            .load_checkpoint(&ck)
            .unwrap();
        for engine in [EngineChoice::Pread, EngineChoice::Auto] {
            let err = loader(engine, 4096, true).load_checkpoint(&ck).unwrap_err();
            match &err {
                Error::InvalidFile {
                    path: p,
                    source: FormatError::ChecksumMismatch { name, .. },
                } => {
                    assert_eq!(p, &bad);
                    assert_eq!(name, victim);
                }
                other => panic!("{victim}: unexpected {other}"),
            }
            assert!(err.to_string().contains(victim), "{err}");
        }
    }
}

#[test]
fn sharded_checkpoints_verify_every_shard() {
    let ts = tensors();
    let list: Vec<SaveTensor> = ts.iter().map(Owned::save).collect();
    let dir = tempfile::tempdir().unwrap();
    let ck_dir = dir.path().join("ck");
    saver(4096, DirectPolicy::Off)
        .save_sharded_with(
            &ck_dir,
            &list,
            50_000,
            None,
            None,
            SaveControl {
                checksums: true,
                ..SaveControl::default()
            },
        )
        .unwrap();
    let ck = Checkpoint::open(&ck_dir).unwrap();
    assert!(ck.files.len() > 1);
    check_loaded(&ck_dir, &ts, &loader(EngineChoice::Auto, 4096, true));
    let names: Vec<&str> = vec!["g.big2", "c.odd"];
    let (got, _) = loader(EngineChoice::Pread, 8192, true)
        .load_tensors(&ck, &names)
        .unwrap();
    assert!(*got[0].data == ts[6].data[..]);
    // User metadata may not take the checksums' key.
    let mut meta = BTreeMap::new();
    meta.insert(METADATA_KEY.to_string(), "{}".to_string());
    let err = saver(4096, DirectPolicy::Off)
        .save_safetensors_with(
            dir.path().join("x.safetensors"),
            &list,
            Some(&meta),
            SaveControl {
                checksums: true,
                ..SaveControl::default()
            },
        )
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
}

#[test]
fn checks_for_extents_verify_whole_tensors_only() {
    let ts = tensors();
    let list: Vec<SaveTensor> = ts.iter().map(Owned::save).collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    save_with_sums(&saver(4096, DirectPolicy::Off), &path, &list, None);
    let ck = Checkpoint::open(&path).unwrap();
    let t = ck.tensor("d.big").unwrap();
    let l = loader(EngineChoice::Pread, 4096, false);
    let paths: Vec<PathBuf> = vec![path.clone()];
    // Two tensors into one buffer, back to back.
    let u = ck.tensor("c.odd").unwrap();
    let extents = [
        Extent {
            file: 0,
            offset: t.file_offset,
            len: t.len(),
            dest: 0,
            dest_offset: 0,
        },
        Extent {
            file: 0,
            offset: u.file_offset,
            len: u.len(),
            dest: 0,
            dest_offset: t.len(),
        },
    ];
    let names = vec![Some("d.big".to_string()), Some("c.odd".to_string())];
    let checks = l.checks_for(&paths, &extents, &names).unwrap();
    let mut buf = vec![0u8; (t.len() + u.len()) as usize];
    l.read_into_host(&paths, &extents, &mut [&mut buf]).unwrap();
    let targets = [tensorferry::pipeline::Target::Host {
        ptr: buf.as_mut_ptr(),
        len: buf.len() as u64,
    }];
    // SAFETY: `buf` outlives the call and nothing else touches it.
    unsafe { l.read_into_targets_checked(&paths, &extents, &targets, None, None, None, &checks) }
        .unwrap();
    // A partial range cannot be verified.
    let part = [Extent {
        len: t.len() - 4,
        ..extents[0]
    }];
    let err = l
        .checks_for(&paths, &part, &[Some("d.big".to_string())])
        .unwrap_err();
    assert!(err.to_string().contains("whole-tensor"), "{err}");
}

fn cuda_skip() -> Option<String> {
    match cuda::devices() {
        Ok(d) if !d.is_empty() => None,
        Ok(_) => Some("the CUDA driver sees no device".into()),
        Err(e) => Some(e.to_string()),
    }
}

#[test]
fn cuda_sources_and_targets_with_checksums() {
    if let Some(why) = cuda_skip() {
        eprintln!("SKIP cuda_sources_and_targets_with_checksums: {why}");
        return;
    }
    let ctx = cuda::Context::get(0).unwrap();
    let ts = tensors();
    let mut bufs = Vec::new();
    for t in &ts {
        let mut b = cuda::DeviceBuffer::alloc(ctx, t.data.len()).unwrap();
        b.copy_from_host(&t.data).unwrap();
        bufs.push(b);
    }
    let list: Vec<SaveTensor> = ts
        .iter()
        .zip(&bufs)
        .enumerate()
        .map(|(i, (t, b))| SaveTensor {
            source: if i % 2 == 0 {
                SaveSource::Cuda(DeviceRegion::of(b))
            } else {
                SaveSource::Host(&t.data)
            },
            ..t.save()
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    for policy in [DirectPolicy::Off, DirectPolicy::On] {
        let path = dir.path().join(format!("gpu-{policy}.safetensors"));
        save_with_sums(&saver(4096, policy), &path, &list, None);
        let sums = checksum::parse(&path, header(&path).metadata.as_ref()).unwrap();
        for t in &ts {
            assert_eq!(sums[&t.name], checksum::xxh3_64(&t.data), "{}", t.name);
        }
        check_loaded(&path, &ts, &loader(EngineChoice::Auto, 4096, true));
        let ck = Checkpoint::open(&path).unwrap();
        let (on_gpu, _) = loader(EngineChoice::Auto, 4096, true)
            .load_checkpoint_cuda(&ck, 0)
            .unwrap();
        assert_eq!(on_gpu.len(), ts.len());
    }
}
