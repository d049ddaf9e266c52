//! The GPUDirect Storage engine: libcufile missing is a clear `Unsupported`, forcing GDS
//! onto host destinations is refused with a reason, `auto` leaves compatibility mode
//! alone, and (where a CUDA driver and libcufile are present) a forced GDS load is
//! bit-exact. What cannot run here is skipped with the reason printed.

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};

use tensorferry::device::cuda::{self, DeviceBuffer, GdsState};
use tensorferry::io::gds;
use tensorferry::pipeline::{choose_engine, Target};
use tensorferry::plan::Extent;
use tensorferry::settings::CUFILE_LIB;
use tensorferry::source::LocalFile;
use tensorferry::{Checkpoint, Engine, EngineChoice, Error, LoadOptions, Loader};

use common::{file_region, fixture};

/// Tests here read or set `TENSORFERRY_CUFILE_LIB` and load libcufile (cached per
/// process): one at a time.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(PoisonError::into_inner)
}

fn options(engine: EngineChoice) -> LoadOptions {
    LoadOptions {
        engine,
        threads: 4,
        ..LoadOptions::default()
    }
}

#[test]
fn a_missing_library_is_unsupported() {
    let _g = serial();
    let missing = "/nonexistent/tensorferry-test/libcufile.so.0";
    std::env::set_var(CUFILE_LIB, missing);
    let r = gds::Cufile::load();
    std::env::remove_var(CUFILE_LIB);
    match r {
        Err(Error::Unsupported(m)) => {
            assert!(m.contains(missing), "message names the path: {m}");
            assert!(m.contains(CUFILE_LIB), "message names the variable: {m}");
        }
        other => panic!("expected Unsupported, got {other:?}"),
    }
}

#[test]
fn forcing_gds_onto_host_memory_is_refused() {
    let _g = serial();
    let ck = Checkpoint::open(fixture("big.safetensors")).unwrap();
    match Loader::new(options(EngineChoice::Gds)).load_checkpoint(&ck) {
        Err(Error::Unsupported(m)) => assert!(m.contains("host memory"), "{m}"),
        other => panic!("expected Unsupported, got {:?}", other.map(|r| r.1)),
    }
    let path = fixture("big.safetensors");
    let f = LocalFile::open(&path).unwrap();
    assert!(matches!(
        choose_engine(&path, EngineChoice::Gds, &f, false),
        Err(Error::Unsupported(_))
    ));
}

#[test]
fn forcing_gds_without_libcufile_says_why() {
    let _g = serial();
    let path = fixture("big.safetensors");
    let f = LocalFile::open(&path).unwrap();
    let r = choose_engine(&path, EngineChoice::Gds, &f, true);
    match gds::library() {
        Err(_) => match r {
            Err(Error::Unsupported(m)) => assert!(m.contains("libcufile"), "{m}"),
            other => panic!("expected Unsupported, got {other:?}"),
        },
        Ok(lib) => eprintln!(
            "SKIPPED forcing_gds_without_libcufile_says_why: libcufile is here ({})",
            lib.path()
        ),
    }
}

#[test]
fn auto_picks_gds_only_when_it_is_real() {
    let _g = serial();
    let dir = scratch_dir();
    let path = dir.path().join("cold.bin");
    std::fs::write(&path, vec![1u8; 1 << 20]).unwrap();
    let f = LocalFile::open(&path).unwrap();
    let _ = f.drop_cache();
    let (engine, _) = choose_engine(&path, EngineChoice::Auto, &f, true).unwrap();
    let state = gds::state();
    eprintln!("gds state {state:?}: auto chose {engine} for a CUDA load");
    if state != GdsState::Real {
        assert_ne!(engine, Engine::Gds);
    }
    // Host destinations never get GDS.
    let (engine, _) = choose_engine(&path, EngineChoice::Auto, &f, false).unwrap();
    assert_ne!(engine, Engine::Gds);
}

/// A scratch directory on a disk file system when possible (O_DIRECT; tmpfs refuses it).
fn scratch_dir() -> tempfile::TempDir {
    let base = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    if std::fs::create_dir_all(&base).is_ok() {
        if let Ok(d) = tempfile::tempdir_in(&base) {
            return d;
        }
    }
    tempfile::tempdir().unwrap()
}

/// Writes a safetensors file of U8 tensors of these sizes (patterned bytes).
fn write_checkpoint(path: &Path, sizes: &[(&str, usize)]) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, n) in sizes {
        let begin = data.len();
        data.extend((0..*n).map(|i| (i.wrapping_mul(31) ^ (i >> 9) ^ begin) as u8));
        header.insert(
            (*name).to_string(),
            serde_json::json!({"dtype": "U8", "shape": [n], "data_offsets": [begin, data.len()]}),
        );
    }
    let header = serde_json::to_vec(&header).unwrap();
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend(&header);
    out.extend(&data);
    std::fs::write(path, out).unwrap();
}

/// Why a real GDS load cannot run here (reading from `dir`), or `None` when it can.
fn gds_skip_reason(dir: &Path) -> Option<String> {
    if let Err(e) = cuda::init() {
        return Some(format!("no CUDA driver ({e})"));
    }
    if let Err(e) = cuda::Context::get(0) {
        return Some(format!("no CUDA device ({e})"));
    }
    let drv = match gds::driver() {
        Ok(d) => d,
        Err(e) => return Some(e.to_string()),
    };
    // libcufile may refuse files of this file system (in a VM without udev data, say).
    let probe = dir.join("probe");
    std::fs::write(&probe, [0u8; 4096]).unwrap();
    let f = LocalFile::open_direct(&probe).or_else(|_| LocalFile::open(&probe));
    match gds::FileHandle::register(drv, &f.unwrap()) {
        Ok(_) => None,
        // In a VM without udev's database, libcufile 1.15 refuses every file
        // ("udev property not found: ID_FS_USAGE" in cufile.log), even in compatibility
        // mode; /run/udev/data/b<major>:<minor> with ID_FS_USAGE=filesystem and
        // ID_FS_TYPE=ext4 lets it through.
        Err(e) => Some(e.to_string()),
    }
}

#[test]
fn a_forced_gds_load_is_bit_exact() {
    let _g = serial();
    let dir = scratch_dir();
    if let Some(why) = gds_skip_reason(dir.path()) {
        eprintln!("SKIPPED a_forced_gds_load_is_bit_exact: {why}");
        return;
    }
    eprintln!(
        "GDS from {} ({:?})",
        gds::library().unwrap().path(),
        gds::state()
    );
    let path = dir.path().join("model.safetensors");
    // Sizes straddle the 16 MiB chunks and 4 KiB pages; one tensor is empty.
    let sizes = [
        ("a", 1),
        ("b", 4097),
        ("c", (20 << 20) + 13),
        ("d", 0),
        ("e", 3 << 20),
        ("f", 65_537),
    ];
    write_checkpoint(&path, &sizes);
    let ck = Checkpoint::open(&path).unwrap();
    let loader = Loader::new(options(EngineChoice::Gds));

    // One buffer per tensor.
    let (tensors, report) = loader.load_checkpoint_cuda(&ck, 0).unwrap();
    assert!(
        report.files.iter().all(|f| f.engine == Engine::Gds),
        "{:?}",
        report.files
    );
    for t in &tensors {
        let e = ck.tensor(&t.name).unwrap();
        let want = file_region(&path, e.file_offset, e.len());
        assert!(
            t.data.to_host().unwrap() == want,
            "tensor {} differs",
            t.name
        );
    }

    // All tensors into one buffer, in reverse order, at odd offsets.
    let total: u64 = ck.tensors.iter().map(|t| t.len() + 3).sum();
    let buf = DeviceBuffer::alloc(cuda::Context::get(0).unwrap(), total as usize).unwrap();
    let mut at = 1;
    let mut extents = Vec::new();
    for t in ck.tensors.iter().rev() {
        extents.push(Extent {
            file: t.file,
            offset: t.file_offset,
            len: t.len(),
            dest: 0,
            dest_offset: at,
        });
        at += t.len() + 3;
    }
    let targets = [Target::Cuda {
        device: 0,
        ptr: buf.ptr(),
        len: total,
    }];
    // SAFETY: `buf` is ours and untouched until this returns.
    let report = unsafe { loader.read_into_targets(&ck.files, &extents, &targets, None) }.unwrap();
    assert!(report.files.iter().all(|f| f.engine == Engine::Gds));
    let host = buf.to_host().unwrap();
    for e in &extents {
        let want = file_region(&path, e.offset, e.len);
        let got = &host[e.dest_offset as usize..(e.dest_offset + e.len) as usize];
        assert!(got == want, "extent at file offset {} differs", e.offset);
    }
    eprintln!("a_forced_gds_load_is_bit_exact: {} bytes", report.bytes);
}
