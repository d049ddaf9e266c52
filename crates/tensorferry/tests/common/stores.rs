//! Helpers of the object store tests (every store): small loaders and savers whose
//! staging and requests are tiny, so reads and parts straddle slots, and checks of what
//! loads back.

use tensorferry::source::ObjectOptions;
use tensorferry::{
    Checkpoint, Dtype, Engine, LoadOptions, Loader, SaveOptions, SaveSource, SaveTensor, Saver,
};

use super::{expected, pseudo_random_bytes, sha256_hex, SINGLE_FILES};

/// Tiny staging and GETs, so reads straddle slots and one GET fills several slots.
pub fn loader(object: ObjectOptions) -> Loader {
    Loader::new(LoadOptions {
        slot_size: 8192,
        slots: 3,
        object_chunk: 20_000,
        object_concurrency: 4,
        object,
        ..LoadOptions::default()
    })
}

/// Loads `url` (relative fixture `rel` under `base`) and checks every tensor against the
/// reference's sha256.
pub fn check_load(l: &Loader, base: &str, rel: &str) {
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

pub fn all_fixture_urls() -> Vec<String> {
    let mut v: Vec<String> = SINGLE_FILES.iter().map(|s| (*s).to_string()).collect();
    v.push("sharded".into()); // a prefix holding model.safetensors.index.json
    v.push("sharded/".into());
    v.push(expected().sharded.index.clone());
    v
}

/// `(name, dtype, shape, bytes)` of a few tensors, from a scalar to ~100 KiB.
pub fn owned() -> Vec<(String, Dtype, Vec<u64>, Vec<u8>)> {
    [
        ("a.scalar", Dtype::F32, vec![]),
        ("b.odd", Dtype::U8, vec![4097]),
        ("c.big", Dtype::F32, vec![157, 163]),
        ("d.small", Dtype::BF16, vec![3, 5]),
        ("e.mid", Dtype::I64, vec![1000, 3]),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, (n, d, s))| {
        let len = d.bytes_for(s.iter().product()).unwrap() as usize;
        (n.to_string(), d, s, pseudo_random_bytes(len, i as u64 + 1))
    })
    .collect()
}

pub fn host_list(t: &[(String, Dtype, Vec<u64>, Vec<u8>)]) -> Vec<SaveTensor<'_>> {
    t.iter()
        .map(|(n, d, s, b)| SaveTensor {
            name: n.clone(),
            dtype: *d,
            shape: s.clone(),
            source: SaveSource::Host(b),
        })
        .collect()
}

/// Staging of 4 KiB slots, eight of them: parts of several slots, tensors straddling
/// slots and parts, and every part past the fourth waits for a slot.
pub fn tiny_saver(object: ObjectOptions) -> Saver {
    Saver::new(SaveOptions {
        threads: 2,
        slot_size: 4096,
        slots: 8,
        object,
        ..SaveOptions::default()
    })
}

/// Loads `url` from the store and checks every tensor's bytes against `tensors`.
pub fn check_loads_back(
    url: &str,
    opts: &ObjectOptions,
    tensors: &[(String, Dtype, Vec<u64>, Vec<u8>)],
) {
    let ck = Checkpoint::open_with(url, opts).unwrap_or_else(|e| panic!("{url}: {e}"));
    let (loaded, _) = loader(opts.clone()).load_checkpoint(&ck).unwrap();
    assert_eq!(loaded.len(), tensors.len(), "{url}");
    for (name, dtype, shape, bytes) in tensors {
        let t = loaded.iter().find(|t| &t.name == name).unwrap();
        assert_eq!((t.dtype, &t.shape), (*dtype, shape), "{url} {name}");
        assert!(t.data[..] == bytes[..], "{url} {name}: bytes differ");
    }
}
