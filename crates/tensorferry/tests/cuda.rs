//! Loads into device memory the library allocates itself (the Rust API), on a real GPU.
//! Without a CUDA device each test prints why it skipped.

mod common;

use std::io::Write;
use std::path::Path;

use tensorferry::device::cuda::{self, Context, DeviceBuffer};
use tensorferry::{Checkpoint, Error, Loader};

fn cuda_skip() -> Option<String> {
    match cuda::devices() {
        Ok(d) if !d.is_empty() => None,
        Ok(_) => Some("the CUDA driver sees no device".into()),
        Err(e) => Some(e.to_string()),
    }
}

/// A safetensors file of `count` U8 tensors `w0, w1, ...` of `each` bytes.
fn write_u8_tensors(path: &Path, count: usize, each: usize) -> Vec<Vec<u8>> {
    let data: Vec<Vec<u8>> = (0..count)
        .map(|i| common::pseudo_random_bytes(each, i as u64 + 1))
        .collect();
    let entries: Vec<String> = (0..count)
        .map(|i| {
            format!(
                "\"w{i}\":{{\"dtype\":\"U8\",\"shape\":[{each}],\"data_offsets\":[{},{}]}}",
                i * each,
                (i + 1) * each
            )
        })
        .collect();
    let header = format!("{{{}}}", entries.join(","));
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(&(header.len() as u64).to_le_bytes()).unwrap();
    f.write_all(header.as_bytes()).unwrap();
    for d in &data {
        f.write_all(d).unwrap();
    }
    data
}

const EACH: usize = 256 << 20;

#[test]
fn out_of_memory_part_way_frees_what_was_allocated() {
    if let Some(why) = cuda_skip() {
        eprintln!("SKIP out_of_memory_part_way_frees_what_was_allocated: {why}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("four.safetensors");
    let want = write_u8_tensors(&path, 4, EACH);
    let ck = Checkpoint::open(&path).unwrap();
    let loader = Loader::default();
    let ctx = Context::get(0).unwrap();
    // A first load sets up what loads keep (streams, events, pinned staging).
    drop(loader.load_checkpoint_cuda(&ck, 0).unwrap());

    // Fill the device until about two and a half of the four tensors fit.
    let (free, _) = ctx.mem_info().unwrap();
    let filler = DeviceBuffer::alloc(ctx, free as usize - EACH * 5 / 2).unwrap();
    let (before, _) = ctx.mem_info().unwrap();
    let Err(err) = loader.load_checkpoint_cuda(&ck, 0) else {
        panic!("a load of 1 GiB into {} MiB succeeded", before >> 20);
    };
    let msg = err.to_string();
    assert!(matches!(err, Error::OutOfMemory(_)), "{msg}");
    assert!(
        msg.contains(&path.display().to_string()) && msg.contains("\"w2\""),
        "{msg}"
    );
    let (after, _) = ctx.mem_info().unwrap();
    assert_eq!(
        after, before,
        "device memory not given back after the failed load"
    );

    drop(filler);
    let (got, _) = loader.load_checkpoint_cuda(&ck, 0).unwrap();
    for (i, t) in got.iter().enumerate() {
        assert_eq!(t.name, format!("w{i}"));
        assert!(t.data.to_host().unwrap() == want[i], "w{i} differs");
    }
}
