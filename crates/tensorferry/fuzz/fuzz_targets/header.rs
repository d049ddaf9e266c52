//! Fuzzes the safetensors header parser: any bytes, any claimed file length; it must
//! return Ok or Err, never panic, and an accepted header must be self-consistent.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tensorferry::format::safetensors::{parse_header, serialize_header};

fuzz_target!(|data: &[u8]| {
    // The file as given, and the same prefix claimed to belong to a longer file.
    for file_len in [data.len() as u64, (data.len() as u64).saturating_mul(3) + 1] {
        if let Ok(h) = parse_header(data, file_len) {
            // Offsets are contiguous from 0 and end at the data section's end.
            let mut cursor = 0;
            for t in &h.tensors {
                assert_eq!(t.data_offsets.0, cursor);
                cursor = t.data_offsets.1;
            }
            assert_eq!(8 + h.header_len + cursor, file_len);
            // What we accept we can write back, and read again to the same tensors.
            let spec: Vec<_> = h.tensors.iter().map(|t| (t.name.clone(), t.dtype, t.shape.clone())).collect();
            let (bytes, infos) = serialize_header(&spec, h.metadata.as_ref()).expect("re-serialize");
            let again = parse_header(&bytes, bytes.len() as u64 + cursor).expect("re-parse");
            assert_eq!(again.tensors.len(), infos.len());
            assert_eq!(again.metadata, h.metadata);
        }
    }
});
