//! Object store loads against real servers started here: `s3s-fs` (S3 with signature
//! checks), a local HTTP server honouring `Range`, and a fault proxy in between. The
//! fixtures (written by the reference safetensors) must load bit-exact; errors must name
//! the URL and never the secret. Tests whose server is missing print why and skip.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::servers::{s3_options, Fault, FaultProxy, RangeServer, S3Server, SECRET_KEY};
use common::{expected, fixtures, sha256_hex, SINGLE_FILES};
use tensorferry::source::ObjectOptions;
use tensorferry::{Checkpoint, Engine, Error, LoadOptions, Loader};

/// Tiny staging and GETs, so reads straddle slots and one GET fills several slots.
fn loader(object: ObjectOptions) -> Loader {
    Loader::new(LoadOptions {
        slot_size: 8192,
        slots: 3,
        object_chunk: 20_000,
        object_concurrency: 4,
        object,
        ..LoadOptions::default()
    })
}

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

/// Loads `url` (relative fixture `rel` under `base`) and checks every tensor against the
/// reference's sha256.
fn check_load(l: &Loader, base: &str, rel: &str) {
    let url = format!("{base}/{rel}");
    let ck =
        Checkpoint::open_with(&url, &l.options().object).unwrap_or_else(|e| panic!("{url}: {e}"));
    let (tensors, report) = l
        .load_checkpoint(&ck)
        .unwrap_or_else(|e| panic!("{url}: {e}"));
    assert!(!tensors.is_empty(), "{url}");
    for t in &tensors {
        let entry = ck.tensor(&t.name).unwrap();
        let file = ck.files[entry.file].to_string_lossy().into_owned();
        let frel = file.strip_prefix(&format!("{base}/")).unwrap();
        let texp = &expected().files[frel].tensors[&t.name];
        assert_eq!(t.dtype.name(), texp.dtype, "{url} {}", t.name);
        assert_eq!(t.shape, texp.shape, "{url} {}", t.name);
        assert_eq!(sha256_hex(&t.data), texp.sha256, "{url} {}: bytes", t.name);
    }
    assert!(report.files.iter().all(|f| f.engine == Engine::Object));
}

fn all_fixture_urls() -> Vec<String> {
    let mut v: Vec<String> = SINGLE_FILES.iter().map(|s| (*s).to_string()).collect();
    v.push("sharded".into()); // a prefix holding model.safetensors.index.json
    v.push("sharded/".into());
    v.push(expected().sharded.index.clone());
    v
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
