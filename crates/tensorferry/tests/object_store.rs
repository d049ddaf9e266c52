//! Object store loads against real servers started here: `s3s-fs` (S3 with signature
//! checks), a local HTTP server honouring `Range`, and a fault proxy in between. The
//! fixtures (written by the reference safetensors) must load bit-exact; errors must name
//! the URL and never the secret. Tests whose server is missing print why and skip.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::servers::{s3_options, Fault, FaultProxy, RangeServer, S3Server, SECRET_KEY};
use common::stores::{
    all_fixture_urls, check_load, check_loads_back, host_list, loader, owned, tiny_saver,
};
use common::{expected, fixtures, pseudo_random_bytes, sha256_hex};
use tensorferry::source::ObjectOptions;
use tensorferry::{Checkpoint, Error, LoadOptions, Loader};

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            copy_dir(&p, &to.join(e.file_name()));
        } else {
            std::fs::copy(&p, to.join(e.file_name())).unwrap();
        }
    }
}

#[test]
fn s3_loads_fixtures_bit_exact() {
    let Some(s3) = S3Server::start() else { return };
    copy_dir(&fixtures(), &s3.bucket("models"));
    let l = loader(s3_options(&s3.endpoint(), SECRET_KEY));
    for rel in all_fixture_urls() {
        check_load(&l, "s3://models", rel.trim_end_matches('/'));
    }
    // A prefix without an index: its *.safetensors objects, listed.
    let b = s3.bucket("noindex");
    for f in [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ] {
        std::fs::copy(fixtures().join("sharded").join(f), b.join(f)).unwrap();
    }
    let ck = Checkpoint::open_with("s3://noindex", &l.options().object).unwrap();
    assert_eq!(ck.files.len(), 2);
    assert_eq!(ck.tensors.len(), expected().sharded.weight_map.len());
}

#[test]
fn http_loads_fixtures_bit_exact() {
    let server = RangeServer::start(&fixtures());
    let l = loader(ObjectOptions::default());
    for rel in all_fixture_urls() {
        let rel = rel.trim_end_matches('/');
        if rel == "sharded" {
            check_load(&l, &server.url(), &expected().sharded.index);
        } else {
            check_load(&l, &server.url(), rel);
        }
    }
    // Headers come from one ranged GET (two for the 70 KB header), never the whole file.
    let reqs = server.requests.lock().unwrap();
    assert!(reqs.iter().all(|r| r.contains("bytes=")), "{reqs:?}");
}

#[test]
fn raw_files_load_from_http() {
    let server = RangeServer::start(&fixtures());
    let l = loader(ObjectOptions::default());
    let url = PathBuf::from(format!("{}/raw.bin", server.url()));
    let spec = tensorferry::format::RawSpec {
        dtype: tensorferry::Dtype::U8,
        offset: 0,
        num_elements: None,
    };
    let (t, _) = l.load_raw(&url, spec).unwrap();
    assert_eq!(sha256_hex(&t.data), expected().raw.sha256);
}

#[test]
fn s3_errors_name_the_url_and_never_the_secret() {
    let Some(s3) = S3Server::start() else { return };
    copy_dir(&fixtures(), &s3.bucket("models"));
    let good = s3_options(&s3.endpoint(), SECRET_KEY);
    let missing = "s3://models/nope.safetensors";
    match Checkpoint::open_with(missing, &good) {
        Err(e @ Error::NotFound { .. }) => assert!(e.to_string().contains(missing), "{e}"),
        other => panic!("missing key: {other:?}"),
    }
    let no_bucket = "s3://no-such-bucket/dtypes.safetensors";
    match Checkpoint::open_with(no_bucket, &good) {
        Err(e @ Error::NotFound { .. }) => assert!(e.to_string().contains(no_bucket), "{e}"),
        other => panic!("missing bucket: {other:?}"),
    }
    let bad = s3_options(&s3.endpoint(), "wrong-secret-value-9876");
    let url = "s3://models/dtypes.safetensors";
    let start = std::time::Instant::now();
    match Checkpoint::open_with(url, &bad) {
        Err(e @ Error::PermissionDenied { .. }) => {
            let text = format!("{e} {e:?}");
            assert!(text.contains(url), "{text}");
            assert!(!text.contains("wrong-secret-value-9876"), "{text}");
        }
        other => panic!("bad credentials: {other:?}"),
    }
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "permanent errors are not retried"
    );
    assert!(!format!("{good:?}").contains(SECRET_KEY));
    // A bucket name no store accepts is refused before any request, naming the URL.
    let e = Checkpoint::open_with("s3://Bad_Bucket!/x.safetensors", &good).unwrap_err();
    assert!(e.to_string().contains("Bad_Bucket"), "{e}");
}

fn data_gets(method: &str, range: Option<&str>) -> bool {
    // Only GETs of tensor data (not the header's first bytes) take faults.
    method == "GET" && range.is_some_and(|r| !r.starts_with("bytes=0-"))
}

#[test]
fn s3_loads_through_faults_bit_exact_refetching_only_what_failed() {
    let Some(s3) = S3Server::start() else { return };
    copy_dir(&fixtures(), &s3.bucket("models"));
    let proxy = FaultProxy::start(s3.port, data_gets);
    let mut opts = s3_options(&format!("http://127.0.0.1:{}", proxy.port), SECRET_KEY);
    opts.timeout = Duration::from_secs(1);
    opts.retries = 5;
    for f in [
        Fault::Status503,
        Fault::CutBody(3000),
        Fault::Drop,
        Fault::Status500,
        Fault::Stall(Duration::from_secs(3)),
        Fault::CutBody(10),
    ] {
        proxy.push(f);
    }
    let l = Loader::new(LoadOptions {
        slot_size: 8192,
        slots: 4,
        object_chunk: 1 << 20,
        object_concurrency: 1,
        object: opts,
        ..LoadOptions::default()
    });
    check_load(&l, "s3://models", "big.safetensors");
    check_load(&l, "s3://models", "long_header.safetensors");
    assert_eq!(proxy.pending(), 0, "every fault was met");
    // After a body was cut, the next request asks only for the rest of that range.
    let reqs = proxy.requests.lock().unwrap().clone();
    let cut = reqs
        .iter()
        .position(|r| r.contains("CutBody(3000)"))
        .expect("cut request");
    let range_of = |r: &str| -> (u64, u64) {
        let spec = r
            .split("bytes=")
            .nth(1)
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap();
        let (a, b) = spec.split_once('-').unwrap();
        (a.parse().unwrap(), b.parse().unwrap())
    };
    let (a, b) = range_of(&reqs[cut]);
    let (a2, b2) = range_of(&reqs[cut + 1]);
    assert!(
        a2 > a && a2 <= a + 3000 && b2 == b,
        "{:?}",
        &reqs[cut..=cut + 1]
    );
}

#[test]
fn http_failures_beyond_the_retries_fail_the_load() {
    let server = RangeServer::start(&fixtures());
    let proxy = FaultProxy::start(server.port, data_gets);
    for _ in 0..10 {
        proxy.push(Fault::Status503);
    }
    let l = loader(ObjectOptions {
        retries: 1,
        ..ObjectOptions::default()
    });
    let url = format!("http://127.0.0.1:{}/big.safetensors", proxy.port);
    let ck = Checkpoint::open_with(&url, &l.options().object).unwrap();
    let e = l.load_checkpoint(&ck).unwrap_err();
    assert!(e.to_string().contains(&url), "{e}");
}

#[test]
fn s3_multipart_upload_appears_only_when_complete() {
    let Some(s3) = S3Server::start() else { return };
    let bucket = s3.bucket("out");
    let opts = s3_options(&s3.endpoint(), SECRET_KEY);
    let data: Vec<u8> = (0..(11u32 << 20)).map(|i| (i % 251) as u8).collect();
    // Parts in flight together; the object appears only on complete.
    let f = tensorferry::source::ObjectFile::at("s3://out/big.bin", &opts).unwrap();
    let mut up = f.upload().unwrap();
    for part in data.chunks(5 << 20) {
        up.put_part(part.to_vec(), 4).unwrap();
    }
    assert!(!bucket.join("big.bin").exists(), "visible before complete");
    up.complete().unwrap();
    let mut back = vec![0u8; data.len()];
    let g = tensorferry::source::ObjectFile::open("s3://out/big.bin", &opts).unwrap();
    assert_eq!(g.len(), Some(data.len() as u64));
    g.read_exact_at(&mut back, 0, 2).unwrap();
    assert!(back == data, "bytes differ after the round trip");
    // An upload dropped (or failed) part way is aborted: nothing under its key.
    let f = tensorferry::source::ObjectFile::at("s3://out/aborted.bin", &opts).unwrap();
    let mut up = f.upload().unwrap();
    up.put_part(data[..5 << 20].to_vec(), 4).unwrap();
    drop(up);
    match tensorferry::source::ObjectFile::open("s3://out/aborted.bin", &opts) {
        Err(Error::NotFound { .. }) => {}
        other => panic!("aborted upload left {other:?}"),
    }
}

// --- saves to object stores -------------------------------------------------------------

use std::sync::atomic::{AtomicBool, Ordering};

use tensorferry::{DeviceRegion, Dtype, SaveControl, SaveOptions, SaveSource, SaveTensor, Saver};

#[test]
fn s3_save_loads_back_bit_exact() {
    let Some(s3) = S3Server::start() else { return };
    let bucket = s3.bucket("out");
    let opts = s3_options(&s3.endpoint(), SECRET_KEY);
    let tensors = owned();
    let list = host_list(&tensors);
    let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let saver = tiny_saver(opts.clone());
    let report = saver
        .save_safetensors("s3://out/dir/model.safetensors", &list, Some(&meta))
        .unwrap();
    assert_eq!(
        report.files[0].path,
        Path::new("s3://out/dir/model.safetensors")
    );
    // Byte-identical to the same save to a local file.
    let dir = tempfile::tempdir().unwrap();
    let local = dir.path().join("model.safetensors");
    saver.save_safetensors(&local, &list, Some(&meta)).unwrap();
    let want = std::fs::read(&local).unwrap();
    assert!(want.len() > 4 * 4096 * 2, "several parts");
    assert!(
        std::fs::read(bucket.join("dir/model.safetensors")).unwrap() == want,
        "object differs from the local save"
    );
    check_loads_back("s3://out/dir/model.safetensors", &opts, &tensors);
    // Parts sent straight from the slots: 1 MiB slots, 8 MiB parts, a 12 MiB tensor.
    let mut big = owned();
    big.push((
        "f.huge".into(),
        Dtype::U8,
        vec![12 << 20],
        pseudo_random_bytes(12 << 20, 9),
    ));
    let saver = Saver::new(SaveOptions {
        slot_size: 1 << 20,
        slots: 16,
        object: opts.clone(),
        ..SaveOptions::default()
    });
    saver
        .save_safetensors("s3://out/big.safetensors", &host_list(&big), None)
        .unwrap();
    check_loads_back("s3://out/big.safetensors", &opts, &big);
}

#[test]
fn s3_save_from_cuda_loads_back_bit_exact() {
    let why = match tensorferry::device::cuda::devices() {
        Ok(d) if !d.is_empty() => None,
        Ok(_) => Some("the CUDA driver sees no device".to_string()),
        Err(e) => Some(e.to_string()),
    };
    if let Some(why) = why {
        eprintln!("SKIP s3_save_from_cuda_loads_back_bit_exact: {why}");
        return;
    }
    let Some(s3) = S3Server::start() else { return };
    s3.bucket("out");
    let opts = s3_options(&s3.endpoint(), SECRET_KEY);
    let tensors = owned();
    let ctx = tensorferry::device::cuda::Context::get(0).unwrap();
    let bufs: Vec<_> = tensors
        .iter()
        .map(|t| {
            let mut b =
                tensorferry::device::cuda::DeviceBuffer::alloc(ctx, t.3.len().max(1)).unwrap();
            b.copy_from_host(&t.3).unwrap();
            b
        })
        .collect();
    let list: Vec<SaveTensor> = host_list(&tensors)
        .into_iter()
        .zip(&bufs)
        .enumerate()
        .map(|(i, (t, b))| SaveTensor {
            // Every other tensor from the device, the rest from the host.
            source: if i % 2 == 0 && !t.source.is_empty() {
                // SAFETY: the buffer holds the bytes and outlives the save.
                SaveSource::Cuda(unsafe { DeviceRegion::new(b.device(), b.ptr(), t.source.len()) })
            } else {
                t.source
            },
            ..t
        })
        .collect();
    tiny_saver(opts.clone())
        .save_safetensors("s3://out/gpu.safetensors", &list, None)
        .unwrap();
    check_loads_back("s3://out/gpu.safetensors", &opts, &tensors);
}

#[test]
fn s3_sharded_save_to_a_prefix_opens_as_a_checkpoint() {
    let Some(s3) = S3Server::start() else { return };
    let bucket = s3.bucket("out");
    let opts = s3_options(&s3.endpoint(), SECRET_KEY);
    let tensors = owned();
    let list = host_list(&tensors);
    let saver = tiny_saver(opts.clone());
    let report = saver
        .save_sharded("s3://out/ck", &list, 50_000, None)
        .unwrap();
    let names: Vec<String> = report
        .files
        .iter()
        .map(|f| f.path.to_string_lossy().into_owned())
        .collect();
    assert!(names.len() > 2, "{names:?}");
    assert_eq!(
        names.last().unwrap(),
        "s3://out/ck/model.safetensors.index.json",
        "the index is written last"
    );
    check_loads_back("s3://out/ck", &opts, &tensors);
    // A re-save into fewer shards removes the shards and index it no longer uses.
    saver
        .save_sharded("s3://out/ck", &list, 1 << 30, None)
        .unwrap();
    let mut left: Vec<_> = std::fs::read_dir(bucket.join("ck"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    left.sort();
    assert_eq!(left, ["model.safetensors"]);
    check_loads_back("s3://out/ck", &opts, &tensors);
}

static CANCEL: AtomicBool = AtomicBool::new(false);

fn part_puts(method: &str, _range: Option<&str>) -> bool {
    method == "PUT"
}

#[test]
fn s3_save_failing_part_way_leaves_nothing_and_names_the_url() {
    let Some(s3) = S3Server::start() else { return };
    let bucket = s3.bucket("out");
    let proxy = FaultProxy::start(s3.port, part_puts);
    let mut opts = s3_options(&format!("http://127.0.0.1:{}", proxy.port), SECRET_KEY);
    opts.retries = 0;
    let tensors = owned();
    let list = host_list(&tensors);
    // Parts fail past the client's retries: the save fails and the upload is aborted.
    for _ in 0..3 {
        proxy.push(Fault::Status500);
    }
    let url = "s3://out/failed.safetensors";
    let e = tiny_saver(opts.clone())
        .save_safetensors(url, &list, None)
        .unwrap_err();
    let text = e.to_string();
    assert!(text.contains(url), "{text}");
    assert!(!text.contains(SECRET_KEY) && !format!("{e:?}").contains(SECRET_KEY));
    let gone = |key: &str| {
        assert!(!bucket.join(key).exists(), "{key} is visible");
        match tensorferry::source::ObjectFile::open(&format!("s3://out/{key}"), &opts) {
            Err(Error::NotFound { .. }) => {}
            other => panic!("{key}: {other:?}"),
        }
    };
    gone("failed.safetensors");
    // Cancelled after the first part: nothing either.
    let progress = |_: u64, _: u64| CANCEL.store(true, Ordering::Relaxed);
    let e = tiny_saver(s3_options(&s3.endpoint(), SECRET_KEY))
        .save_safetensors_with(
            "s3://out/cancelled.safetensors",
            &list,
            None,
            SaveControl {
                cancel: Some(&CANCEL),
                progress: Some(&progress),
                ..SaveControl::default()
            },
        )
        .unwrap_err();
    assert!(matches!(e, Error::Cancelled), "{e}");
    gone("cancelled.safetensors");
}
