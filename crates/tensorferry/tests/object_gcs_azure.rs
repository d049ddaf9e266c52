//! Google Cloud Storage (`gs://`) and Azure Blob (`az://`, `abfss://`, `https://…
//! .blob.core.windows.net`) loads and saves against local servers: the GCS and Azure
//! emulators of `tests/common/servers.rs`, which check every request's credentials (a
//! JWT signed by the service account's RSA key; a SharedKey HMAC signature with the
//! Azurite account key), and fake-gcs-server when it is installed. The fixtures must
//! load bit-exact, saves (multipart uploads, block lists) must read back bit-exact, and
//! errors must name the URL and never a secret. Tests whose server cannot run print why
//! and skip.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::cloud::{
    b64_encode, gcs_service_account_json, rsa_key_pair, AzureServer, CloudState, FakeGcsServer,
    GcsServer, AZURE_KEY, GCS_CLIENT_EMAIL, GCS_KEY_ID,
};
use common::stores::{
    all_fixture_urls, check_load, check_loads_back, host_list, loader, owned, tiny_saver,
};
use common::{expected, fixtures, pseudo_random_bytes, sha256_hex};
use tensorferry::source::{ObjectFile, ObjectOptions};
use tensorferry::{Checkpoint, Dtype, Error, Loader, SaveOptions, Saver};

/// Loads every fixture from `base` (a bucket holding the fixtures), then a prefix with
/// shards but no index (listed).
fn check_all_fixtures(l: &Loader, base: &str, noindex_base: &str) {
    for rel in all_fixture_urls() {
        check_load(l, base, rel.trim_end_matches('/'));
    }
    let ck = Checkpoint::open_with(noindex_base, &l.options().object)
        .unwrap_or_else(|e| panic!("{noindex_base}: {e}"));
    assert_eq!(ck.files.len(), 2, "{noindex_base}");
    assert_eq!(ck.tensors.len(), expected().sharded.weight_map.len());
    let (tensors, _) = l.load_checkpoint(&ck).unwrap();
    for t in &tensors {
        let shard = &expected().sharded.weight_map[&t.name];
        let texp = &expected().files[&format!("sharded/{shard}")].tensors[&t.name];
        assert_eq!(
            sha256_hex(&t.data),
            texp.sha256,
            "{noindex_base} {}",
            t.name
        );
    }
}

/// Puts the fixtures in bucket `models` and the two shards alone in bucket `noindex`.
fn stock(state: &CloudState) {
    state.put_dir("models", &fixtures());
    for f in [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ] {
        let bytes = std::fs::read(fixtures().join("sharded").join(f)).unwrap();
        state.put("noindex", f, &bytes);
    }
}

/// No request was refused for its credentials.
fn all_authenticated(state: &CloudState, refused: u16) {
    let bad = state.answered(refused);
    assert!(bad.is_empty(), "refused: {bad:?}");
    assert!(!state.requests.lock().unwrap().is_empty());
}

#[test]
fn gcs_loads_fixtures_bit_exact() {
    let Some(gcs) = GcsServer::start() else {
        return;
    };
    stock(&gcs.state);
    let l = loader(gcs.options());
    check_all_fixtures(&l, "gs://models", "gs://noindex");
    all_authenticated(&gcs.state, 401);
    // The prefix without an index was listed (XML API, `list-type=2`).
    let reqs = gcs.state.requests.lock().unwrap().clone();
    assert!(
        reqs.iter()
            .any(|r| r.starts_with("GET /noindex?list-type=2")),
        "{reqs:?}"
    );
}

#[test]
fn fake_gcs_server_loads_fixtures_bit_exact() {
    let data = tempfile::tempdir().unwrap();
    common::servers::copy_tree(&fixtures(), &data.path().join("models"));
    let shards = data.path().join("noindex");
    std::fs::create_dir_all(&shards).unwrap();
    for f in [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ] {
        std::fs::copy(fixtures().join("sharded").join(f), shards.join(f)).unwrap();
    }
    let Some(fake) = FakeGcsServer::start(data.path()) else {
        return;
    };
    let opts = fake.options();
    check_all_fixtures(&loader(opts.clone()), "gs://models", "gs://noindex");
    let missing = "gs://models/nope.safetensors";
    match Checkpoint::open_with(missing, &opts) {
        Err(e @ Error::NotFound { .. }) => assert!(e.to_string().contains(missing), "{e}"),
        other => panic!("missing object: {other:?}"),
    }
}

#[test]
fn azure_loads_fixtures_bit_exact() {
    let az = AzureServer::start();
    stock(&az.state);
    let l = loader(az.options());
    check_all_fixtures(&l, "az://models", "az://noindex");
    // The other spellings of a container: `abfss://container@account…` and the
    // account's https URL (the endpoint option still points the client here).
    check_load(
        &l,
        "abfss://models@devstoreaccount1.dfs.core.windows.net",
        "dtypes.safetensors",
    );
    check_load(
        &l,
        "https://devstoreaccount1.blob.core.windows.net/models",
        "sharded",
    );
    all_authenticated(&az.state, 403);
}

/// Two containers of one account, one key in each with different bytes: each URL must
/// read its own container, however the URL spells it (clients are cached per store).
#[test]
fn azure_containers_of_one_account_are_not_mixed_up() {
    let az = AzureServer::start();
    let opts = az.options();
    let (a, b) = (pseudo_random_bytes(1000, 1), pseudo_random_bytes(1000, 2));
    az.state.put("one", "x.bin", &a);
    az.state.put("two", "x.bin", &b);
    let read = |url: &str| {
        let f = ObjectFile::open(url, &opts).unwrap_or_else(|e| panic!("{url}: {e}"));
        let mut buf = vec![0u8; 1000];
        f.read_exact_at(&mut buf, 0, 0).unwrap();
        buf
    };
    for (one, two) in [
        ("az://one/x.bin", "az://two/x.bin"),
        (
            "https://devstoreaccount1.blob.core.windows.net/one/x.bin",
            "https://devstoreaccount1.blob.core.windows.net/two/x.bin",
        ),
        (
            "abfss://one@devstoreaccount1.dfs.core.windows.net/x.bin",
            "abfss://two@devstoreaccount1.dfs.core.windows.net/x.bin",
        ),
    ] {
        assert!(read(one) == a, "{one}");
        assert!(read(two) == b, "{two}");
    }
    // A user and password where abfss has its container are still refused, unechoed.
    let e = ObjectFile::at(
        "abfss://one:hunter22@devstoreaccount1.dfs.core.windows.net/x.bin",
        &opts,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("credentials") && !e.contains("hunter22"), "{e}");
}

// --- saves -------------------------------------------------------------------------------

/// Saves through multipart uploads (GCS) or block lists (Azure) to bucket `out` of the
/// store behind `scheme://` and reads back: a single file (byte-identical to a local
/// save), a direct multipart upload (visible only once complete; nothing left when
/// dropped), and a sharded save to a prefix, re-saved into fewer shards.
/// `is_part(request line)` tells the requests carrying one part.
fn save_round_trip(
    scheme: &str,
    state: &Arc<CloudState>,
    opts: &ObjectOptions,
    is_part: fn(&str) -> bool,
) {
    state.bucket("out");
    let tensors = owned();
    let list = host_list(&tensors);
    let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let saver = tiny_saver(opts.clone());
    let url = format!("{scheme}://out/dir/model.safetensors");
    let report = saver.save_safetensors(&url, &list, Some(&meta)).unwrap();
    assert_eq!(report.files[0].path, Path::new(&url));
    let dir = tempfile::tempdir().unwrap();
    let local = dir.path().join("model.safetensors");
    saver.save_safetensors(&local, &list, Some(&meta)).unwrap();
    let want = std::fs::read(&local).unwrap();
    let got = state.object("out", "dir/model.safetensors").expect("saved");
    assert!(got == want, "object differs from the local save");
    check_loads_back(&url, opts, &tensors);

    // Parts sent straight from the slots: 1 MiB slots, 8 MiB parts, a 20 MiB tensor.
    let parts = || {
        let reqs = state.requests.lock().unwrap();
        reqs.iter().filter(|r| is_part(r)).count()
    };
    let before = parts();
    let mut big = owned();
    big.push((
        "f.huge".into(),
        Dtype::U8,
        vec![20 << 20],
        pseudo_random_bytes(20 << 20, 9),
    ));
    let big_saver = Saver::new(SaveOptions {
        slot_size: 1 << 20,
        slots: 16,
        object: opts.clone(),
        ..SaveOptions::default()
    });
    let big_url = format!("{scheme}://out/big.safetensors");
    big_saver
        .save_safetensors(&big_url, &host_list(&big), None)
        .unwrap();
    let sent = parts() - before;
    assert!(sent >= 3, "{sent} parts: expected a many-part upload");
    check_loads_back(&big_url, opts, &big);

    // Parts in flight together; the object appears only on complete.
    let data = pseudo_random_bytes(3 << 20, 7);
    let f = ObjectFile::at(&format!("{scheme}://out/big.bin"), opts).unwrap();
    let mut up = f.upload().unwrap();
    for part in data.chunks(1 << 20) {
        up.put_part(part.to_vec(), 4).unwrap();
    }
    assert!(
        state.object("out", "big.bin").is_none(),
        "visible before complete"
    );
    up.complete().unwrap();
    let g = ObjectFile::open(&format!("{scheme}://out/big.bin"), opts).unwrap();
    assert_eq!(g.len(), Some(data.len() as u64));
    let mut back = vec![0u8; data.len()];
    g.read_exact_at(&mut back, 0, 2).unwrap();
    assert!(back == data, "bytes differ after the round trip");
    let aborted = format!("{scheme}://out/aborted.bin");
    let mut up = ObjectFile::at(&aborted, opts).unwrap().upload().unwrap();
    up.put_part(data[..1 << 20].to_vec(), 4).unwrap();
    drop(up);
    match ObjectFile::open(&aborted, opts) {
        Err(Error::NotFound { .. }) => {}
        other => panic!("aborted upload left {other:?}"),
    }

    // Sharded, to a prefix; the index is written last.
    let ck = format!("{scheme}://out/ck");
    let report = saver.save_sharded(&ck, &list, 50_000, None).unwrap();
    let names: Vec<String> = report
        .files
        .iter()
        .map(|f| f.path.to_string_lossy().into_owned())
        .collect();
    assert!(names.len() > 2, "{names:?}");
    assert_eq!(
        names.last().unwrap(),
        &format!("{ck}/model.safetensors.index.json")
    );
    check_loads_back(&ck, opts, &tensors);
    // A re-save into fewer shards removes the shards and index it no longer uses.
    saver.save_sharded(&ck, &list, 1 << 30, None).unwrap();
    assert_eq!(state.keys("out", "ck/"), ["ck/model.safetensors"]);
    check_loads_back(&ck, opts, &tensors);
}

#[test]
fn gcs_save_multipart_loads_back_bit_exact() {
    let Some(gcs) = GcsServer::start() else {
        return;
    };
    save_round_trip("gs", &gcs.state, &gcs.options(), |r| {
        r.starts_with("PUT ") && r.contains("partNumber=")
    });
    all_authenticated(&gcs.state, 401);
    let reqs = gcs.state.requests.lock().unwrap().clone();
    assert!(reqs.iter().any(|r| r.contains("?uploads")), "{reqs:?}");
}

#[test]
fn azure_save_block_list_loads_back_bit_exact() {
    let az = AzureServer::start();
    save_round_trip("az", &az.state, &az.options(), |r| {
        r.starts_with("PUT ") && r.contains("comp=block&")
    });
    all_authenticated(&az.state, 403);
    let reqs = az.state.requests.lock().unwrap().clone();
    assert!(
        reqs.iter().any(|r| r.contains("comp=blocklist")),
        "{reqs:?}"
    );
}

// --- errors ------------------------------------------------------------------------------

/// Missing objects, buckets and prefixes are `NotFound` naming the URL; a refused
/// credential is `PermissionDenied` naming the URL, not retried, and no error text or
/// `Debug` shows `secrets`.
fn check_errors(scheme: &str, good: &ObjectOptions, bad: &ObjectOptions, secrets: &[&str]) {
    for missing in [
        format!("{scheme}://models/nope.safetensors"),
        format!("{scheme}://no-such-bucket/dtypes.safetensors"),
        format!("{scheme}://models/no/such/prefix"),
    ] {
        match Checkpoint::open_with(&missing, good) {
            Err(e @ Error::NotFound { .. }) => {
                assert!(e.to_string().contains(&missing), "{e}");
            }
            other => panic!("{missing}: {other:?}"),
        }
    }
    let url = format!("{scheme}://models/dtypes.safetensors");
    let start = Instant::now();
    match Checkpoint::open_with(&url, bad) {
        Err(e @ Error::PermissionDenied { .. }) => {
            let text = format!("{e} {e:?}");
            assert!(text.contains(&url), "{text}");
            for s in secrets {
                assert!(!text.contains(s), "secret in {text}");
            }
        }
        other => panic!("{url} with bad credentials: {other:?}"),
    }
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "permanent errors are not retried"
    );
    for o in [good, bad] {
        let d = format!("{o:?}");
        for s in secrets {
            assert!(!d.contains(s), "secret in {d}");
        }
    }
}

#[test]
fn gcs_errors_name_the_url_and_never_the_secret() {
    let Some(gcs) = GcsServer::start() else {
        return;
    };
    stock(&gcs.state);
    // The right account and key id, signed by another key.
    let (other_pem, _) = rsa_key_pair().unwrap();
    let forged = gcs_service_account_json(&other_pem, GCS_KEY_ID, GCS_CLIENT_EMAIL);
    let pem_line = other_pem.lines().nth(1).unwrap();
    check_errors(
        "gs",
        &gcs.options(),
        &gcs.options_with(&forged),
        &[pem_line, &forged],
    );
    assert!(
        !gcs.state.answered(401).is_empty(),
        "the forged token was refused"
    );
    // A key that is no key fails before any request, without echoing it.
    let broken = gcs_service_account_json(
        "-----BEGIN PRIVATE KEY-----\nnot-a-key-sekrit\n-----END PRIVATE KEY-----\n",
        GCS_KEY_ID,
        GCS_CLIENT_EMAIL,
    );
    let e =
        ObjectFile::open("gs://models/dtypes.safetensors", &gcs.options_with(&broken)).unwrap_err();
    let text = format!("{e} {e:?}");
    assert!(text.contains("gs://models/dtypes.safetensors"), "{text}");
    assert!(!text.contains("not-a-key-sekrit"), "{text}");
}

#[test]
fn azure_errors_name_the_url_and_never_the_secret() {
    let az = AzureServer::start();
    stock(&az.state);
    let wrong = b64_encode(&pseudo_random_bytes(64, 99));
    check_errors(
        "az",
        &az.options(),
        &az.options_with(&wrong),
        &[&wrong, AZURE_KEY],
    );
    assert!(
        !az.state.answered(403).is_empty(),
        "the wrong key was refused"
    );
}
