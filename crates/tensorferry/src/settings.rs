//! Every environment variable the library reads, with its default, in one place.

/// Engine policy: `auto`, `pread`, `direct`, `uring` or `gds`. Default `auto`.
pub const ENGINE: &str = "TENSORFERRY_ENGINE";
/// Reader threads for the pread engines. Default: the number of cores, at most 16.
pub const THREADS: &str = "TENSORFERRY_THREADS";
/// Staging slot size in bytes (suffixes K, M, G allowed). Default 4 MiB.
pub const SLOT_SIZE: &str = "TENSORFERRY_SLOT_SIZE";
/// Number of staging slots. Default 32, or twice the reader threads if more (so 128 MiB
/// of staging with the default 4 MiB slots).
pub const SLOTS: &str = "TENSORFERRY_SLOTS";
/// `io_uring` queue depth. Default 32.
pub const URING_DEPTH: &str = "TENSORFERRY_URING_DEPTH";
/// Path of libcufile for the `gds` engine. When set, only this file is tried; unset,
/// `libcufile.so.0`, `libcufile.so` and the CUDA toolkit's directories are searched (see
/// [`crate::io::gds::SEARCH_PATH`]).
pub const CUFILE_LIB: &str = "TENSORFERRY_CUFILE_LIB";
/// `O_DIRECT` policy of saves: `auto` (for files of 64 MiB or more, where the file
/// system accepts it), `on` (wherever accepted) or `off`. Default `auto`.
pub const SAVE_DIRECT: &str = "TENSORFERRY_SAVE_DIRECT";
/// Bytes of one ranged GET from an object store (suffixes K, M, G). Default 8 MiB.
pub const OBJECT_CHUNK: &str = "TENSORFERRY_OBJECT_CHUNK";
/// Ranged GETs (or upload parts) in flight at once per load (or save). Default 16.
pub const OBJECT_CONCURRENCY: &str = "TENSORFERRY_OBJECT_CONCURRENCY";
/// Retries of a failed object store request (5xx, 429, timeouts, dropped connections).
/// Default 10.
pub const OBJECT_RETRIES: &str = "TENSORFERRY_OBJECT_RETRIES";
/// Seconds an object store request may go without progress before it is retried.
/// Default 30.
pub const OBJECT_TIMEOUT: &str = "TENSORFERRY_OBJECT_TIMEOUT";
/// Log filter for the CLI (`error`, `warn`, `info`, `debug`, `trace`). Default `warn`.
pub const LOG: &str = "TENSORFERRY_LOG";

/// Most reader threads chosen by default (page-cache reads stop scaling about there).
pub const MAX_DEFAULT_THREADS: usize = 16;
/// Default staging slot size.
pub const DEFAULT_SLOT_SIZE: usize = 4 << 20;
/// Default number of staging slots.
pub const DEFAULT_SLOTS: usize = 32;
/// Size a multipart upload's parts aim for (S3 wants at least 5 MiB but the last); a
/// part is as many staging slots as make this, within the pool.
pub const UPLOAD_PART_SIZE: u64 = 8 << 20;
/// Default `io_uring` queue depth.
pub const DEFAULT_URING_DEPTH: u32 = 32;
/// CUDA streams the copy stage spreads host-to-device copies over.
pub const STREAMS_DEFAULT: usize = 4;
/// Largest buffered read that lands straight in host memory (split for parallelism).
pub const DIRECT_CHUNK: u64 = 8 << 20;

/// Largest single `cuFileRead` of the `gds` engine (extents are split into chunks this
/// size, spread over the reader threads).
pub const GDS_CHUNK: u64 = 16 << 20;

/// Default bytes of one ranged GET (and of one multipart upload part).
pub const DEFAULT_OBJECT_CHUNK: u64 = 8 << 20;
/// Default ranged GETs (or upload parts) in flight.
pub const DEFAULT_OBJECT_CONCURRENCY: usize = 16;
/// Default retries of one object store request.
pub const DEFAULT_OBJECT_RETRIES: usize = 10;
/// Default per-request timeout, in seconds.
pub const DEFAULT_OBJECT_TIMEOUT_S: u64 = 30;
/// Longest time, in seconds, a request is retried before its error is final.
pub const DEFAULT_OBJECT_RETRY_WINDOW_S: u64 = 180;

/// Reads a variable, or `None` when unset or empty.
pub fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// Parses a byte size: a number with an optional `K`, `M`, `G` (powers of 1024) suffix.
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last()? {
        (i, 'k' | 'K') => (&s[..i], 1u64 << 10),
        (i, 'm' | 'M') => (&s[..i], 1 << 20),
        (i, 'g' | 'G') => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    num.trim().parse::<u64>().ok()?.checked_mul(mult)
}

/// Number of cores available to this process.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(4, std::num::NonZero::get)
}

#[cfg(test)]
mod tests {
    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!(super::parse_size("8M"), Some(8 << 20));
        assert_eq!(super::parse_size("4096"), Some(4096));
        assert_eq!(super::parse_size("2g"), Some(2 << 30));
        assert_eq!(super::parse_size("x"), None);
    }
}
