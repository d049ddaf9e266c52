//! Fuzzes the sharded-checkpoint index parser: never a panic, and no accepted shard name
//! may leave the checkpoint's directory.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::{Component, Path};
use tensorferry::format::index::parse_index;

fuzz_target!(|data: &[u8]| {
    if let Ok(idx) = parse_index(data) {
        for shard in idx.weight_map.values() {
            assert!(!shard.is_empty());
            assert!(Path::new(shard).components().all(|c| matches!(c, Component::Normal(_) | Component::CurDir)));
        }
        let _ = idx.shards();
    }
});
