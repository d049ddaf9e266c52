//! One conformance suite, run for every read engine (pread, pread + O_DIRECT, io_uring and
//! the automatic policy): every fixture loads bit-exact through a tiny staging pool (so
//! reads straddle slots and 4 KiB boundaries), raw ranges, files that shrink under the
//! loader, cancellation and progress. Engines the machine cannot run are skipped with the
//! reason printed, never passed silently.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tensorferry::format::RawSpec;
use tensorferry::source::local::supports_direct;
use tensorferry::source::LocalFile;
use tensorferry::{
    Checkpoint, Dtype, Engine, EngineChoice, Error, LoadOptions, Loader, TensorEntry,
};

use common::{check_tensor, checkpoint_paths, copy_fixture, expected, file_region, fixture};

/// Staging small enough that the 36004-byte tensor of `big.safetensors` needs more reads
/// than there are slots.
const SLOT_SIZE: usize = 8192;
const SLOTS: usize = 3;

fn options(engine: EngineChoice) -> LoadOptions {
    // The rest (no progress, no cancel) from the defaults.
    LoadOptions {
        engine,
        threads: 2,
        slot_size: SLOT_SIZE,
        slots: SLOTS,
        uring_depth: 4,
        ..LoadOptions::default()
    }
}

/// Why `engine` cannot be tested on `files` (existing files, one per file system the test
/// reads from), or `None` when it can.
fn skip_reason(engine: EngineChoice, files: &[&Path]) -> Option<String> {
    if matches!(engine, EngineChoice::Direct | EngineChoice::Uring) {
        if let Some(f) = files.iter().find(|f| !supports_direct(f)) {
            return Some(format!(
                "the file system holding {} refuses O_DIRECT",
                f.display()
            ));
        }
    }
    if engine == EngineChoice::Uring {
        if let Err(why) = tensorferry::io::uring::available() {
            return Some(format!("io_uring is unavailable: {why}"));
        }
    }
    None
}

/// The test's context: a loader for the engine and a temporary directory, or `None` (with
/// the reason printed) when the engine cannot run here.
struct Env {
    engine: EngineChoice,
    loader: Loader,
    tmp: tempfile::TempDir,
}

impl Env {
    fn new(engine: EngineChoice, test: &str) -> Option<Self> {
        let tmp = tempfile::tempdir().unwrap();
        let probe = tmp.path().join("probe");
        std::fs::write(&probe, vec![7u8; 5000]).unwrap();
        if let Some(why) = skip_reason(engine, &[&fixture("raw.bin"), &probe]) {
            eprintln!("SKIPPED {engine}::{test}: {why}");
            return None;
        }
        Some(Self {
            engine,
            loader: Loader::new(options(engine)),
            tmp,
        })
    }

    fn loader_with(&self, f: impl FnOnce(&mut LoadOptions)) -> Loader {
        let mut o = options(self.engine);
        f(&mut o);
        Loader::new(o)
    }

    /// The engine the report must name for this choice (`None`: the policy decides).
    fn expected_engine(&self) -> Option<Engine> {
        match self.engine {
            EngineChoice::Pread => Some(Engine::Pread),
            EngineChoice::Direct => Some(Engine::PreadDirect),
            EngineChoice::Uring => Some(Engine::Uring),
            _ => None,
        }
    }

    fn check_report_engines(&self, report: &tensorferry::Report) {
        for f in &report.files {
            match self.expected_engine() {
                Some(e) => assert_eq!(f.engine, e, "{}: engine", f.path.display()),
                None => assert!(
                    matches!(
                        f.engine,
                        Engine::Pread | Engine::PreadDirect | Engine::Uring
                    ),
                    "{}: auto chose {}",
                    f.path.display(),
                    f.engine
                ),
            }
        }
    }
}

fn every_fixture_loads_bit_exact(engine: EngineChoice) {
    let Some(env) = Env::new(engine, "every_fixture_loads_bit_exact") else {
        return;
    };
    for path in checkpoint_paths() {
        let ck = Checkpoint::open(&path).unwrap();
        let (tensors, report) = env.loader.load_checkpoint(&ck).unwrap();
        let names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
        let want: Vec<&str> = ck.tensors.iter().map(TensorEntry::name).collect();
        assert_eq!(names, want, "{}: tensors in name order", path.display());
        assert!(!tensors.is_empty());
        for t in &tensors {
            check_tensor(&ck, t);
        }
        assert_eq!(report.bytes, ck.total_bytes(), "{}", path.display());
        let report_bytes: u64 = report.files.iter().map(|f| f.bytes).sum();
        assert_eq!(report_bytes, ck.total_bytes(), "{}", path.display());
        env.check_report_engines(&report);
    }
}

fn sharded_load_reads_both_shards(engine: EngineChoice) {
    let Some(env) = Env::new(engine, "sharded_load_reads_both_shards") else {
        return;
    };
    let ck = Checkpoint::open(fixture("sharded")).unwrap();
    let (tensors, report) = env.loader.load_checkpoint(&ck).unwrap();
    assert_eq!(tensors.len(), expected().sharded.weight_map.len());
    assert_eq!(report.bytes, expected().sharded.total_size);
    let mut files: Vec<PathBuf> = report.files.iter().map(|f| f.path.clone()).collect();
    files.sort();
    assert_eq!(files, ck.files);
    for t in &tensors {
        let shard = &ck.files[ck.tensor(&t.name).unwrap().file];
        assert_eq!(
            shard.file_name().unwrap().to_str().unwrap(),
            expected().sharded.weight_map[&t.name]
        );
    }
}

fn requested_tensors_come_back_in_request_order(engine: EngineChoice) {
    let Some(env) = Env::new(engine, "requested_tensors_come_back_in_request_order") else {
        return;
    };
    let ck = Checkpoint::open(fixture("big.safetensors")).unwrap();
    // A repeated name reads the same bytes into two destinations.
    let ask = ["tail", "big", "a_head", "big"];
    let (tensors, report) = env.loader.load_tensors(&ck, &ask).unwrap();
    let names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ask);
    for t in &tensors {
        check_tensor(&ck, t);
    }
    let big = ck.tensor("big").unwrap().len();
    assert_eq!(report.bytes, ck.total_bytes() + big);

    let (none, report) = env.loader.load_tensors(&ck, &[]).unwrap();
    assert!(none.is_empty());
    assert_eq!(report.bytes, 0);
}

fn empty_and_scalar_tensors_load(engine: EngineChoice) {
    let Some(env) = Env::new(engine, "empty_and_scalar_tensors_load") else {
        return;
    };
    let ck = Checkpoint::open(fixture("odd_shapes.safetensors")).unwrap();
    let (tensors, report) = env
        .loader
        .load_tensors(&ck, &["empty", "empty_3x0"])
        .unwrap();
    assert_eq!(report.bytes, 0);
    assert_eq!(tensors[0].shape, [0]);
    assert_eq!(tensors[1].shape, [3, 0]);
    assert!(tensors.iter().all(|t| t.data.is_empty()));
    let (tensors, _) = env
        .loader
        .load_tensors(&ck, &["scalar_f32", "empty", "scalar_i64", "seven_u8"])
        .unwrap();
    assert_eq!(tensors[0].shape, Vec::<u64>::new());
    assert_eq!(tensors[0].data.len(), 4);
    assert_eq!(tensors[2].data.len(), 8);
    for t in &tensors {
        check_tensor(&ck, t);
    }
}

/// Raw ranges over the 20003-byte `raw.bin`: unaligned offsets, ranges across 4 KiB and
/// slot boundaries, to the end of the file, empty.
fn raw_specs() -> Vec<RawSpec> {
    let spec = |offset, num_elements, dtype| RawSpec {
        offset,
        num_elements,
        dtype,
    };
    vec![
        spec(0, Some(20_003), Dtype::U8),
        spec(1, Some(4095), Dtype::U8),
        spec(4095, Some(2), Dtype::U8),
        spec(4097, Some(3000), Dtype::F32),
        spec(8191, Some(8193), Dtype::I8),
        spec(3, Some(9999), Dtype::BF16),
        spec(5, None, Dtype::U8),
        spec(20_003 - 6, None, Dtype::F16),
        spec(20_003 - 8, Some(1), Dtype::F64),
        spec(20_003, Some(0), Dtype::U8),
        spec(12_345, Some(0), Dtype::F32),
        spec(0, Some(2), Dtype::F4),
    ]
}

fn check_raw(path: &Path, spec: &RawSpec, t: &tensorferry::HostTensor) {
    let file_len = std::fs::metadata(path).unwrap().len();
    let len = match spec.num_elements {
        Some(n) => spec.dtype.bytes_for(n).unwrap(),
        None => file_len - spec.offset,
    };
    assert_eq!(t.dtype, spec.dtype, "{spec:?}");
    assert_eq!(t.shape, [len * 8 / spec.dtype.bits()], "{spec:?}");
    assert_eq!(t.data.len() as u64, len, "{spec:?}");
    assert!(
        *t.data == file_region(path, spec.offset, len)[..],
        "{spec:?}: bytes differ from the file"
    );
}

fn raw_ranges_match_file_bytes(engine: EngineChoice) {
    let Some(env) = Env::new(engine, "raw_ranges_match_file_bytes") else {
        return;
    };
    let raw = fixture(&expected().raw.path);
    for spec in raw_specs() {
        let (t, report) = env.loader.load_raw(&raw, spec).unwrap();
        check_raw(&raw, &spec, &t);
        assert_eq!(report.bytes, t.data.len() as u64);
        env.check_report_engines(&report);
    }
    let (whole, _) = env
        .loader
        .load_raw(
            &raw,
            RawSpec {
                offset: 0,
                num_elements: None,
                dtype: Dtype::U8,
            },
        )
        .unwrap();
    assert_eq!(common::sha256_hex(&whole.data), expected().raw.sha256);
}

fn raw_loads_in_one_submission(engine: EngineChoice) {
    let Some(env) = Env::new(engine, "raw_loads_in_one_submission") else {
        return;
    };
    let raw = fixture(&expected().raw.path);
    let big = fixture("big.safetensors");
    // Both files, interleaved, ranges overlapping each other.
    let mut specs: Vec<(PathBuf, RawSpec)> = Vec::new();
    for (i, spec) in raw_specs().into_iter().enumerate() {
        specs.push((raw.clone(), spec));
        specs.push((
            big.clone(),
            RawSpec {
                offset: 37 * i as u64,
                num_elements: Some(9001 + i as u64),
                dtype: Dtype::F32,
            },
        ));
    }
    let (tensors, report) = env.loader.load_raws(&specs).unwrap();
    assert_eq!(tensors.len(), specs.len());
    for ((path, spec), t) in specs.iter().zip(&tensors) {
        check_raw(path, spec, t);
    }
    let total: u64 = tensors.iter().map(|t| t.data.len() as u64).sum();
    assert_eq!(report.bytes, total);
    assert_eq!(report.files.len(), 2);
    env.check_report_engines(&report);
}

/// A file cut short after the checkpoint was opened: the load fails with
/// `UnexpectedEof` naming the file, whatever the cut.
fn file_shrinking_after_open_is_unexpected_eof(engine: EngineChoice) {
    let Some(env) = Env::new(engine, "file_shrinking_after_open_is_unexpected_eof") else {
        return;
    };
    let exp = &expected().files["big.safetensors"];
    let data_start = 8 + exp.header_len;
    for cut in [0, data_start, data_start + 10_000, exp.file_len - 1] {
        let dir = env.tmp.path().join(format!("cut{cut}"));
        std::fs::create_dir(&dir).unwrap();
        let path = copy_fixture("big.safetensors", &dir);
        let ck = Checkpoint::open(&path).unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(cut)
            .unwrap();
        let err = env.loader.load_checkpoint(&ck).unwrap_err();
        let msg = err.to_string();
        match &err {
            Error::UnexpectedEof {
                path: p,
                at,
                needed,
            } => {
                assert_eq!(p, &path, "cut at {cut}");
                assert!(*needed > 0);
                assert!(*at >= cut.min(data_start), "cut at {cut}: eof at {at}");
            }
            other => panic!("cut at {cut}: expected UnexpectedEof, got {other:?}"),
        }
        assert!(msg.contains(&path.display().to_string()), "{msg}");

        // A raw read of the old length is refused up front, naming the file.
        let spec = RawSpec {
            offset: 0,
            num_elements: Some(exp.file_len),
            dtype: Dtype::U8,
        };
        let err = env.loader.load_raw(&path, spec).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidFile { path: p, .. } if *p == path),
            "{err:?}"
        );
    }
}

/// A file whose data was cut off before it was opened (its header still valid) is an
/// invalid file, named.
fn truncated_file_is_invalid_file(engine: EngineChoice) {
    let Some(env) = Env::new(engine, "truncated_file_is_invalid_file") else {
        return;
    };
    let path = copy_fixture("big.safetensors", env.tmp.path());
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len - 100)
        .unwrap();
    let err = Checkpoint::open(&path).unwrap_err();
    assert!(
        matches!(
            &err,
            Error::InvalidFile { path: p, source: tensorferry::FormatError::DataLengthMismatch { expected, actual } }
                if *p == path && *expected == len && *actual == len - 100
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains(&path.display().to_string()));
    // Loading the parts that are still there works.
    let header = tensorferry::checkpoint::read_header(&fixture("big.safetensors"))
        .unwrap()
        .0;
    let big = header.tensor("big").unwrap();
    let spec = RawSpec {
        offset: header.data_start() + big.data_offsets.0,
        num_elements: Some(big.elements()),
        dtype: big.dtype,
    };
    let (t, _) = env.loader.load_raw(&path, spec).unwrap();
    assert_eq!(
        common::sha256_hex(&t.data),
        expected().files["big.safetensors"].tensors["big"].sha256
    );
}

fn cancel_before_load_is_cancelled(engine: EngineChoice) {
    let Some(env) = Env::new(engine, "cancel_before_load_is_cancelled") else {
        return;
    };
    let cancel = Arc::new(AtomicBool::new(true));
    let loader = env.loader_with(|o| o.cancel = Some(Arc::clone(&cancel)));
    let ck = Checkpoint::open(fixture("big.safetensors")).unwrap();
    let err = loader.load_checkpoint(&ck).unwrap_err();
    assert!(matches!(err, Error::Cancelled), "{err:?}");
    let err = loader
        .load_raw(
            &fixture("raw.bin"),
            RawSpec {
                offset: 0,
                num_elements: None,
                dtype: Dtype::U8,
            },
        )
        .unwrap_err();
    assert!(matches!(err, Error::Cancelled), "{err:?}");
    // Clearing the flag makes the same loader work again.
    cancel.store(false, Ordering::SeqCst);
    let (tensors, _) = loader.load_checkpoint(&ck).unwrap();
    for t in &tensors {
        check_tensor(&ck, t);
    }
}

fn cancel_during_load_is_cancelled(engine: EngineChoice) {
    let Some(env) = Env::new(engine, "cancel_during_load_is_cancelled") else {
        return;
    };
    let cancel = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&cancel);
    let calls = Arc::new(Mutex::new(0u32));
    let seen = Arc::clone(&calls);
    let loader = env.loader_with(|o| {
        o.cancel = Some(Arc::clone(&cancel));
        o.progress = Some(Arc::new(move |_done: u64, _total: u64| {
            *seen.lock().unwrap() += 1;
            flag.store(true, Ordering::SeqCst);
        }));
    });
    let ck = Checkpoint::open(fixture("big.safetensors")).unwrap();
    let err = loader.load_checkpoint(&ck).unwrap_err();
    assert!(matches!(err, Error::Cancelled), "{err:?}");
    assert!(*calls.lock().unwrap() >= 1);
}

fn progress_ends_at_total_bytes(engine: EngineChoice) {
    let Some(env) = Env::new(engine, "progress_ends_at_total_bytes") else {
        return;
    };
    for path in checkpoint_paths() {
        let calls: Arc<Mutex<Vec<(u64, u64)>>> = Arc::default();
        let sink = Arc::clone(&calls);
        let loader = env.loader_with(|o| {
            o.progress = Some(Arc::new(move |done: u64, total: u64| {
                sink.lock().unwrap().push((done, total));
            }));
        });
        let ck = Checkpoint::open(&path).unwrap();
        let (_, report) = loader.load_checkpoint(&ck).unwrap();
        let calls = calls.lock().unwrap();
        let total = ck.total_bytes();
        assert!(!calls.is_empty(), "{}: no progress", path.display());
        assert!(calls.iter().all(|&(_, t)| t == total), "{calls:?}");
        assert!(calls.iter().all(|&(d, _)| d > 0 && d <= total), "{calls:?}");
        let last = calls.iter().map(|&(d, _)| d).max().unwrap();
        assert_eq!(last, total, "{}: final progress", path.display());
        assert_eq!(report.bytes, total);
        // Every call reports a distinct running total (each read counted once).
        let mut dones: Vec<u64> = calls.iter().map(|&(d, _)| d).collect();
        dones.sort_unstable();
        dones.dedup();
        assert_eq!(dones.len(), calls.len(), "{calls:?}");
    }
}

fn one_loader_serves_concurrent_loads(engine: EngineChoice) {
    let Some(env) = Env::new(engine, "one_loader_serves_concurrent_loads") else {
        return;
    };
    let ck = Checkpoint::open(fixture("big.safetensors")).unwrap();
    let sharded = Checkpoint::open(fixture("sharded")).unwrap();
    std::thread::scope(|s| {
        for i in 0..4 {
            let (loader, ck) = (&env.loader, if i % 2 == 0 { &ck } else { &sharded });
            s.spawn(move || {
                for _ in 0..3 {
                    let (tensors, _) = loader.load_checkpoint(ck).unwrap();
                    for t in &tensors {
                        check_tensor(ck, t);
                    }
                }
            });
        }
    });
}

macro_rules! engine_suite {
    ($($module:ident => $engine:expr),* $(,)?) => {$(
        mod $module {
            use super::*;
            const ENGINE: EngineChoice = $engine;

            #[test]
            fn every_fixture_loads_bit_exact() { super::every_fixture_loads_bit_exact(ENGINE) }
            #[test]
            fn sharded_load_reads_both_shards() { super::sharded_load_reads_both_shards(ENGINE) }
            #[test]
            fn requested_tensors_come_back_in_request_order() {
                super::requested_tensors_come_back_in_request_order(ENGINE)
            }
            #[test]
            fn empty_and_scalar_tensors_load() { super::empty_and_scalar_tensors_load(ENGINE) }
            #[test]
            fn raw_ranges_match_file_bytes() { super::raw_ranges_match_file_bytes(ENGINE) }
            #[test]
            fn raw_loads_in_one_submission() { super::raw_loads_in_one_submission(ENGINE) }
            #[test]
            fn file_shrinking_after_open_is_unexpected_eof() {
                super::file_shrinking_after_open_is_unexpected_eof(ENGINE)
            }
            #[test]
            fn truncated_file_is_invalid_file() { super::truncated_file_is_invalid_file(ENGINE) }
            #[test]
            fn cancel_before_load_is_cancelled() { super::cancel_before_load_is_cancelled(ENGINE) }
            #[test]
            fn cancel_during_load_is_cancelled() { super::cancel_during_load_is_cancelled(ENGINE) }
            #[test]
            fn progress_ends_at_total_bytes() { super::progress_ends_at_total_bytes(ENGINE) }
            #[test]
            fn one_loader_serves_concurrent_loads() {
                super::one_loader_serves_concurrent_loads(ENGINE)
            }
        }
    )*};
}

engine_suite! {
    pread => EngineChoice::Pread,
    direct => EngineChoice::Direct,
    uring => EngineChoice::Uring,
    auto => EngineChoice::Auto,
}

/// The policy: a file that is not in the page cache is read with O_DIRECT (through
/// io_uring where it works).
#[test]
fn auto_reads_a_cold_file_with_o_direct() {
    let Some(env) = Env::new(EngineChoice::Auto, "auto_reads_a_cold_file_with_o_direct") else {
        return;
    };
    let path = copy_fixture("big.safetensors", env.tmp.path());
    let ck = Checkpoint::open(&path).unwrap();
    std::fs::File::open(&path).unwrap().sync_all().unwrap();
    let file = LocalFile::open(&path).unwrap();
    file.drop_cache().unwrap();
    let resident = file.resident_fraction();
    if resident >= 0.5 {
        eprintln!(
            "SKIPPED auto_reads_a_cold_file_with_o_direct: the page cache kept {:.0}% of the file after POSIX_FADV_DONTNEED",
            resident * 100.0
        );
        return;
    }
    let want = if !supports_direct(&path) {
        Engine::Pread
    } else if tensorferry::io::uring::available().is_ok() {
        Engine::Uring
    } else {
        Engine::PreadDirect
    };
    let (tensors, report) = env.loader.load_checkpoint(&ck).unwrap();
    assert_eq!(report.files.len(), 1);
    assert_eq!(report.files[0].engine, want);
    assert!(report.files[0].resident.is_some_and(|r| r < 0.5));
    let exp = &expected().files["big.safetensors"];
    for t in &tensors {
        assert_eq!(common::sha256_hex(&t.data), exp.tensors[&t.name].sha256);
    }
}

/// The policy: a file in the page cache is read buffered.
#[test]
fn auto_reads_a_cached_file_buffered() {
    let Some(env) = Env::new(EngineChoice::Auto, "auto_reads_a_cached_file_buffered") else {
        return;
    };
    let path = copy_fixture("big.safetensors", env.tmp.path());
    let _ = std::fs::read(&path).unwrap();
    let resident = LocalFile::open(&path).unwrap().resident_fraction();
    if resident < 0.5 {
        eprintln!(
            "SKIPPED auto_reads_a_cached_file_buffered: only {:.0}% of a file just read is in the page cache",
            resident * 100.0
        );
        return;
    }
    let ck = Checkpoint::open(&path).unwrap();
    let (_, report) = env.loader.load_checkpoint(&ck).unwrap();
    assert_eq!(report.files[0].engine, Engine::Pread);
    assert!(report.files[0].resident.is_some_and(|r| r >= 0.5));
}
