//! Resource limits: file descriptors and io_uring rings are released after every load.

use std::path::PathBuf;

use tensorferry::format::safetensors::serialize_header;
use tensorferry::{Checkpoint, Dtype, EngineChoice, LoadOptions, Loader};

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, Iterator::count)
}

fn small_file(dir: &std::path::Path, i: usize) -> PathBuf {
    let (mut bytes, infos) = serialize_header(
        &[("w".to_string(), Dtype::U8, vec![(i % 97 + 1) as u64])],
        None,
    )
    .unwrap();
    bytes.extend((0..infos[0].len()).map(|b| (b as usize + i) as u8));
    let p = dir.join(format!("f{i}.safetensors"));
    std::fs::write(&p, bytes).unwrap();
    p
}

/// 10,000 files loaded one after another (through the buffered and the io_uring
/// engines) leave the process's descriptor count where it was.
#[test]
fn ten_thousand_loads_release_every_descriptor() {
    let dir = tempfile::tempdir().unwrap();
    let files: Vec<PathBuf> = (0..10_000).map(|i| small_file(dir.path(), i)).collect();
    let mut engines = vec![EngineChoice::Pread];
    match tensorferry::io::uring::available() {
        Ok(()) => engines.push(EngineChoice::Uring),
        Err(why) => eprintln!("skipping the io_uring half: {why}"),
    }
    for engine in engines {
        let loader = Loader::new(LoadOptions {
            engine,
            slot_size: 4096,
            slots: 4,
            ..LoadOptions::default()
        });
        // Warm up once (lazy pools, probes), then count.
        let _ = loader
            .load_checkpoint(&Checkpoint::open(&files[0]).unwrap())
            .unwrap();
        let before = open_fds();
        for (i, f) in files
            .iter()
            .enumerate()
            .step_by(if engine == EngineChoice::Uring { 5 } else { 1 })
        {
            let ck = Checkpoint::open(f).unwrap();
            let (t, _) = loader.load_checkpoint(&ck).unwrap();
            assert_eq!(
                t[0].data[0],
                i as u8,
                "{engine}: wrong data for {}",
                f.display()
            );
        }
        let after = open_fds();
        assert_eq!(
            before, after,
            "{engine}: descriptors leaked ({before} before, {after} after)"
        );
    }
}
