//! The store path: tensors in host or CUDA memory to safetensors files, sharded
//! checkpoints and raw files, through the write engine ([`crate::io::write`]).
//!
//! ```text
//!  tensors ─► header + layout ─► writes ─► D2H into pinned slot ─► pwrite ─► temp file
//!  (host or   (reference order)  (slot-    (a few streams,          (writer     fsync, rename,
//!   CUDA)                         sized)    event per slot)          threads)   fsync of dir
//! ```
//!
//! A safetensors file appears under its final name only once it is whole and durable:
//! it is written as `.{name}.tf-tmp-XXXXXXXX` in the same directory, synced, renamed and
//! the directory synced. On any error (no space left, cancellation, a CUDA fault) the
//! temporary file is removed and whatever was under the final name before stays intact;
//! a save killed outright leaves its temporary file, which the next save of the same name
//! removes. Large files are written with `O_DIRECT` where the file system accepts it
//! ([`DirectPolicy`]): slot-sized, aligned writes, the last one padded to 4 KiB and the
//! file then truncated to its exact size.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::marker::PhantomData;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::checksum::{self, RangeHasher};
use crate::device::cuda::{self, Context, DeviceBuffer, Event, Stream};
use crate::device::host::AlignedBuf;
use crate::device::staging::StagingPool;
use crate::error::{Error, Result};
use crate::format::{index, safetensors, Dtype};
use crate::io::write::{self, Dest, DeviceCopier, Pending, Piece, Segment, Src, WritePlan};
use crate::io::{Control, ProgressFn, DIRECT_ALIGN};
use crate::settings;
use crate::source::{is_url, Location, ObjectFile, ObjectOptions};

/// Files at least this large are written with `O_DIRECT` under [`DirectPolicy::Auto`].
pub const DIRECT_MIN_BYTES: u64 = 64 << 20;

/// What marks a temporary file: `.{final name}` + this + 8 random characters (the same
/// names the Python package's `durable_write` uses).
pub const TEMP_MARK: &str = ".tf-tmp-";

/// The `op` of every [`Error::Io`] the store path returns (all writes, none reads).
pub const WRITE_OPS: [&str; 9] = [
    "write",
    "open for writing",
    "allocate space",
    "truncate",
    "fsync",
    "rename",
    "remove",
    "create temporary file",
    "create directory",
];

/// Saves to object stores: when the destination is an object URL (`s3://`, `gs://`,
/// `az://`, ...), the same write plan (slot-sized writes) becomes the parts of a multipart
/// upload, sent in parallel from the staging slots; the object appears only when every
/// part has landed, and any error or cancellation aborts the upload (nothing appears).
/// A sharded save to a prefix writes the shards, then the index last.
///
/// When saves use `O_DIRECT` (which bypasses the page cache: no dirty gigabytes to flush
/// at `fsync`, no cache evicted). Where the file system refuses it, writes are buffered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DirectPolicy {
    /// For files of [`DIRECT_MIN_BYTES`] or more.
    #[default]
    Auto,
    /// For every safetensors file.
    On,
    /// Never.
    Off,
}

impl FromStr for DirectPolicy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Self::Auto,
            "on" | "true" | "yes" | "1" | "direct" => Self::On,
            "off" | "false" | "no" | "0" | "buffered" => Self::Off,
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "O_DIRECT policy {s:?}: expected auto, on or off"
                )))
            }
        })
    }
}

impl std::fmt::Display for DirectPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::On => "on",
            Self::Off => "off",
        })
    }
}

/// Options of a [`Saver`]. `Default` reads the `TENSORFERRY_*` variables (threads, slot
/// size and count, [`settings::SAVE_DIRECT`]), falling back to built-in defaults.
#[derive(Debug, Clone)]
pub struct SaveOptions {
    /// Writer threads (each has one write in flight).
    pub threads: usize,
    /// Staging slot size in bytes (rounded up to 4 KiB); also the size of `O_DIRECT` writes.
    pub slot_size: usize,
    /// Number of staging slots: bounds the memory a save uses.
    pub slots: usize,
    /// When to use `O_DIRECT`.
    pub direct: DirectPolicy,
    /// CUDA streams per device that device-to-host copies are spread over.
    pub streams: usize,
    /// Object store configuration, for destinations that are URLs.
    pub object: ObjectOptions,
    /// Records an xxh3-64 of each tensor's bytes in the header (see [`crate::checksum`])
    /// on every save of this saver (a call can also ask with [`SaveControl::checksums`]).
    pub checksums: bool,
}

impl Default for SaveOptions {
    fn default() -> Self {
        let num = |name: &str| settings::var(name).and_then(|v| settings::parse_size(&v));
        Self {
            threads: num(settings::THREADS)
                .map_or_else(|| settings::cores().clamp(4, 16), |n| n as usize)
                .max(1),
            slot_size: num(settings::SLOT_SIZE).map_or(settings::DEFAULT_SLOT_SIZE, |n| n as usize),
            slots: num(settings::SLOTS)
                .map_or(settings::DEFAULT_SLOTS, |n| n as usize)
                .max(1),
            direct: settings::var(settings::SAVE_DIRECT)
                .and_then(|v| v.parse().ok())
                .unwrap_or_default(),
            streams: settings::STREAMS_DEFAULT,
            object: crate::loader::default_object_options(),
            checksums: false,
        }
    }
}

/// CUDA memory to save from, borrowed for `'a`.
#[derive(Debug, Clone, Copy)]
pub struct DeviceRegion<'a> {
    device: usize,
    ptr: u64,
    len: u64,
    _borrow: PhantomData<&'a ()>,
}

impl DeviceRegion<'_> {
    /// `len` bytes at device address `ptr` on CUDA device `device`.
    ///
    /// # Safety
    /// The memory must be valid for reads of `len` bytes, with every write to it already
    /// complete, and stay so, unchanged, until every save given the region has returned.
    pub unsafe fn new(device: usize, ptr: u64, len: u64) -> Self {
        Self {
            device,
            ptr,
            len,
            _borrow: PhantomData,
        }
    }

    /// Device ordinal.
    pub fn device(&self) -> usize {
        self.device
    }

    /// Device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<'a> DeviceRegion<'a> {
    /// All of a buffer this library allocated.
    pub fn of(buf: &'a DeviceBuffer) -> Self {
        Self {
            device: buf.device(),
            ptr: buf.ptr(),
            len: buf.len() as u64,
            _borrow: PhantomData,
        }
    }
}

/// Where a tensor's bytes are.
#[derive(Debug, Clone, Copy)]
pub enum SaveSource<'a> {
    /// Host memory.
    Host(&'a [u8]),
    /// CUDA device memory.
    Cuda(DeviceRegion<'a>),
}

impl SaveSource<'_> {
    /// Length in bytes.
    pub fn len(&self) -> u64 {
        match self {
            SaveSource::Host(b) => b.len() as u64,
            SaveSource::Cuda(r) => r.len,
        }
    }

    /// Whether the source is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn src(&self) -> Src {
        match self {
            SaveSource::Host(b) => Src::Host(b.as_ptr()),
            SaveSource::Cuda(r) => Src::Device {
                device: r.device,
                ptr: r.ptr,
            },
        }
    }
}

/// A tensor to save: its header entry and where its bytes are (row-major, contiguous).
#[derive(Debug, Clone)]
pub struct SaveTensor<'a> {
    /// Name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape (empty for a scalar).
    pub shape: Vec<u64>,
    /// The bytes; their length must be what dtype and shape make.
    pub source: SaveSource<'a>,
}

/// What a save did.
#[derive(Debug, Clone, Default)]
pub struct SaveReport {
    /// Bytes written (every file, headers included).
    pub bytes: u64,
    /// Wall time, the syncs included.
    pub seconds: f64,
    /// The files written, in the order written.
    pub files: Vec<SavedFile>,
}

impl SaveReport {
    /// Throughput in GB/s (10^9 bytes per second).
    pub fn gbps(&self) -> f64 {
        crate::pipeline::gbps(self.bytes, self.seconds)
    }
}

/// One file of a [`SaveReport`].
#[derive(Debug, Clone)]
pub struct SavedFile {
    /// Its final path.
    pub path: PathBuf,
    /// Its size.
    pub bytes: u64,
    /// Whether it was written with `O_DIRECT`.
    pub direct: bool,
}

/// Cancellation and progress for one call.
#[derive(Clone, Copy, Default)]
pub struct SaveControl<'a> {
    /// Set to `true` to cancel: the call fails with [`Error::Cancelled`], the temporary
    /// file is removed and the previous file stays.
    pub cancel: Option<&'a AtomicBool>,
    /// Called from writer threads with `(bytes written, bytes total)`.
    pub progress: Option<&'a ProgressFn>,
    /// Records an xxh3-64 of each tensor's data bytes in the header's `__metadata__`
    /// under [`checksum::METADATA_KEY`] (safetensors files and shards; see
    /// [`crate::checksum`]), for loads with `verify`. The bytes are hashed as they pass
    /// through the writers and the header, sized up front with placeholder digits of the
    /// same width, is rewritten in place before the file is synced and renamed. For object
    /// store URLs the header goes out first, so host tensors are hashed in a first pass
    /// and CUDA tensors are refused ([`Error::Unsupported`]).
    pub checksums: bool,
}

/// Saves tensors. Holds options, a staging pool allocated on first use, and CUDA streams;
/// one saver may be shared by many threads.
pub struct Saver {
    opts: SaveOptions,
    pool: Mutex<Option<Arc<StagingPool>>>,
    streams: Mutex<HashMap<usize, Arc<Vec<Stream>>>>,
}

impl Default for Saver {
    fn default() -> Self {
        Self::new(SaveOptions::default())
    }
}

impl Drop for Saver {
    fn drop(&mut self) {
        let map = std::mem::take(&mut *self.streams.lock().expect("saver streams"));
        for (device, streams) in map {
            // Streams are destroyed in their context.
            if Context::get(device).and_then(Context::bind).is_ok() {
                drop(streams);
            } else {
                std::mem::forget(streams);
            }
        }
    }
}

/// A file ready to be written: its header and where every byte comes from.
struct Prepared {
    // Kept for its bytes: the first segment points into it.
    _header: Vec<u8>,
    segments: Vec<Segment>,
    total: u64,
    /// Checksums hashed while writing, for the header rewritten after the data.
    sums: Option<StreamedSums>,
}

/// How a save records checksums.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SumMode {
    /// Not at all: the file is what the reference implementation writes.
    Off,
    /// Hashed as the bytes are written; the header (placeholder digits) rewritten after.
    Streamed,
    /// Hashed before writing (uploads, whose header is sent first); host memory only.
    Upfront,
}

/// What rewriting the header with the streamed digests needs.
struct StreamedSums {
    described: Vec<(String, Dtype, Vec<u64>)>,
    metadata: BTreeMap<String, String>,
    /// Tensor names in file order, one per range of `hasher`.
    names: Vec<String>,
    hasher: RangeHasher,
    header_len: usize,
}

impl StreamedSums {
    /// The final header: the placeholder digits replaced by the digests (same length).
    fn header(&self, path: &Path) -> Result<Vec<u8>> {
        let digests = self.hasher.digests();
        let mut pairs = Vec::with_capacity(self.names.len());
        for (name, d) in self.names.iter().zip(digests) {
            let d = d.ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{}: tensor {name:?} was not wholly written, so it has no checksum",
                    path.display()
                ))
            })?;
            pairs.push((name.as_str(), d));
        }
        let mut meta = self.metadata.clone();
        meta.insert(checksum::METADATA_KEY.into(), checksum::encode(pairs));
        let (header, _) = safetensors::serialize_header(&self.described, Some(&meta))
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        assert_eq!(
            header.len(),
            self.header_len,
            "checksum header changed size"
        );
        Ok(header)
    }
}

impl Saver {
    /// A saver with these options.
    pub fn new(opts: SaveOptions) -> Self {
        Self {
            opts,
            pool: Mutex::new(None),
            streams: Mutex::new(HashMap::new()),
        }
    }

    /// The saver's options.
    pub fn options(&self) -> &SaveOptions {
        &self.opts
    }

    /// The staging pool, allocated on first call.
    pub fn staging(&self) -> Result<Arc<StagingPool>> {
        let mut pool = self.pool.lock().expect("saver lock");
        if let Some(p) = pool.as_ref() {
            return Ok(Arc::clone(p));
        }
        let p = Arc::new(StagingPool::new(self.opts.slot_size, self.opts.slots)?);
        *pool = Some(Arc::clone(&p));
        Ok(p)
    }

    /// Saves `tensors` as one safetensors file at `path`, byte for byte what the
    /// reference implementation writes, durably (see the module's documentation). Device
    /// memory is copied to pinned staging slots and written from there; host memory is
    /// written from where it lies (or through the slots with `O_DIRECT`).
    pub fn save_safetensors(
        &self,
        path: impl AsRef<Path>,
        tensors: &[SaveTensor<'_>],
        metadata: Option<&BTreeMap<String, String>>,
    ) -> Result<SaveReport> {
        self.save_safetensors_with(path, tensors, metadata, SaveControl::default())
    }

    /// [`Saver::save_safetensors`] with cancellation and progress.
    pub fn save_safetensors_with(
        &self,
        path: impl AsRef<Path>,
        tensors: &[SaveTensor<'_>],
        metadata: Option<&BTreeMap<String, String>>,
        control: SaveControl<'_>,
    ) -> Result<SaveReport> {
        let start = Instant::now();
        let path = path.as_ref();
        let all: Vec<&SaveTensor> = tensors.iter().collect();
        let mode = self.sum_mode(control, is_url(path));
        let prepared = prepare(&all, metadata, mode)?;
        let ctl = Control::new(prepared.total, control.cancel, control.progress);
        let file = self.commit(path, &prepared, self.opts.direct, &ctl)?;
        Ok(SaveReport {
            bytes: file.bytes,
            seconds: start.elapsed().as_secs_f64(),
            files: vec![file],
        })
    }

    /// Saves `tensors` as a sharded checkpoint in `dir` (created if missing), as Hugging
    /// Face's tools do: shards filled greedily in the order given up to `max_shard_size`
    /// bytes of tensor data, a tensor larger than that in a shard of its own, named
    /// `model-00001-of-0000N.safetensors`, and `model.safetensors.index.json` with
    /// `{"metadata": {"total_size": ...}, "weight_map": {...}}` (pretty-printed, names
    /// sorted); `metadata` goes in every shard's header. When everything fits one shard,
    /// the checkpoint is a single `model.safetensors` and has no index (again as Hugging
    /// Face's tools do).
    ///
    /// Every file is written durably; the previous index is removed first and the new one
    /// written last, so an index names only complete shards of one save. Files of an
    /// earlier save that this one did not rewrite (`model*.safetensors`,
    /// `model.safetensors.index.json`) are removed at the end.
    pub fn save_sharded(
        &self,
        dir: impl AsRef<Path>,
        tensors: &[SaveTensor<'_>],
        max_shard_size: u64,
        metadata: Option<&BTreeMap<String, String>>,
    ) -> Result<SaveReport> {
        self.save_sharded_with(
            dir,
            tensors,
            max_shard_size,
            metadata,
            None,
            SaveControl::default(),
        )
    }

    /// [`Saver::save_sharded`] with metadata for the index, cancellation and progress.
    /// `index_metadata` goes in the index's `metadata` next to `total_size` (and wins over
    /// it), or, when the checkpoint is a single file, in that file's header next to
    /// `metadata` (and wins over it): what Hugging Face's `save_torch_state_dict` does
    /// with its `metadata` (the shards' headers get `{"format": "pt"}` from it).
    pub fn save_sharded_with(
        &self,
        dir: impl AsRef<Path>,
        tensors: &[SaveTensor<'_>],
        max_shard_size: u64,
        metadata: Option<&BTreeMap<String, String>>,
        index_metadata: Option<&BTreeMap<String, String>>,
        control: SaveControl<'_>,
    ) -> Result<SaveReport> {
        let start = Instant::now();
        let dir = dir.as_ref();
        if max_shard_size == 0 {
            return Err(Error::InvalidArgument(
                "max_shard_size must be at least 1 byte".into(),
            ));
        }
        // Everything is checked before anything is written.
        let lens: Vec<u64> = tensors.iter().map(|t| t.source.len()).collect();
        let mut shards = plan_shards(&lens, max_shard_size);
        if shards.is_empty() {
            shards.push(Vec::new());
        }
        let n = shards.len();
        let names: Vec<String> = (1..=n)
            .map(|i| {
                if n == 1 {
                    SINGLE_FILE.to_string()
                } else {
                    format!("model-{i:05}-of-{n:05}.safetensors")
                }
            })
            .collect();
        let mut seen = HashSet::new();
        if let Some(t) = tensors.iter().find(|t| !seen.insert(t.name.as_str())) {
            return Err(Error::InvalidArgument(format!(
                "tensor {:?} is given more than once",
                t.name
            )));
        }
        let single_meta: Option<BTreeMap<String, String>> = match (metadata, index_metadata) {
            (None, None) => None,
            (m, i) => Some(
                m.into_iter()
                    .chain(i)
                    .flat_map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())))
                    .collect(),
            ),
        };
        let metadata = if n == 1 {
            single_meta.as_ref()
        } else {
            metadata
        };
        let loc = Location::of(dir);
        let mode = self.sum_mode(control, matches!(loc, Location::Url(_)));
        let prepared: Vec<Prepared> = shards
            .iter()
            .map(|s| {
                prepare(
                    &s.iter().map(|&i| &tensors[i]).collect::<Vec<_>>(),
                    metadata,
                    mode,
                )
            })
            .collect::<Result<_>>()?;
        let index_path = loc.join(index::INDEX_FILE_NAME);
        if let Location::Url(_) = loc {
            ObjectFile::at(&index_path.to_string_lossy(), &self.opts.object)?.delete()?;
        } else {
            std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, "create directory", 0, e))?;
            match std::fs::remove_file(&index_path) {
                Ok(()) => sync_dir(dir)?,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io(&index_path, "remove", 0, e)),
            }
        }
        let total = prepared.iter().map(|p| p.total).sum();
        let ctl = Control::new(total, control.cancel, control.progress);
        let mut files = Vec::with_capacity(n + 1);
        for (p, name) in prepared.iter().zip(&names) {
            files.push(self.commit(&loc.join(name), p, self.opts.direct, &ctl)?);
        }
        if n > 1 {
            let mut weight_map = BTreeMap::new();
            for (shard, name) in shards.iter().zip(&names) {
                for &i in shard {
                    weight_map.insert(tensors[i].name.as_str(), name.as_str());
                }
            }
            let mut meta = serde_json::Map::new();
            meta.insert("total_size".into(), lens.iter().sum::<u64>().into());
            for (k, v) in index_metadata.into_iter().flatten() {
                meta.insert(k.clone(), v.clone().into());
            }
            let idx = serde_json::json!({"metadata": meta, "weight_map": weight_map});
            let mut text = serde_json::to_string_pretty(&idx).expect("index serializes");
            text.push('\n');
            let p = Prepared {
                segments: vec![Segment {
                    offset: 0,
                    len: text.len() as u64,
                    src: Src::Host(text.as_ptr()),
                }],
                total: text.len() as u64,
                _header: Vec::new(),
                sums: None,
            };
            let ctl = Control::new(p.total, control.cancel, None);
            files.push(self.commit(&index_path, &p, DirectPolicy::Off, &ctl)?);
        }
        match &loc {
            Location::Url(url) => remove_stale_objects(url, &names, &self.opts.object)?,
            Location::Local(_) => remove_stale(dir, &names)?,
        }
        Ok(SaveReport {
            bytes: files.iter().map(|f| f.bytes).sum(),
            seconds: start.elapsed().as_secs_f64(),
            files,
        })
    }

    /// Writes `source` into the file at `path` (created if missing, never truncated) at
    /// byte `offset`: a positioned write, like DeepNVMe's `pwrite`, neither atomic nor
    /// synced. Device memory goes through the staging slots.
    pub fn write_at(
        &self,
        path: impl AsRef<Path>,
        offset: u64,
        source: &SaveSource<'_>,
    ) -> Result<SaveReport> {
        self.write_at_with(path, offset, source, SaveControl::default())
    }

    /// [`Saver::write_at`] with cancellation and progress.
    pub fn write_at_with(
        &self,
        path: impl AsRef<Path>,
        offset: u64,
        source: &SaveSource<'_>,
        control: SaveControl<'_>,
    ) -> Result<SaveReport> {
        let start = Instant::now();
        let path = path.as_ref();
        let len = source.len();
        if offset
            .checked_add(len)
            .is_none_or(|end| end > i64::MAX as u64)
        {
            return Err(Error::InvalidArgument(format!(
                "{}: {len} bytes at offset {offset} go past the largest file offset",
                path.display()
            )));
        }
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o666)
            .open(path)
            .map_err(|e| Error::io(path, "open for writing", 0, e))?;
        let segments = [Segment {
            offset,
            len,
            src: source.src(),
        }];
        let ctl = Control::new(len, control.cancel, control.progress);
        self.run(Dest { file: &file, path }, &segments, false, None, &ctl)?;
        ctl.finish()?;
        Ok(SaveReport {
            bytes: len,
            seconds: start.elapsed().as_secs_f64(),
            files: vec![SavedFile {
                path: path.to_path_buf(),
                bytes: len,
                direct: false,
            }],
        })
    }

    /// Writes `prepared` to `path` durably: temporary file, writes, sync, rename, sync of
    /// the directory.
    fn commit(
        &self,
        path: &Path,
        prepared: &Prepared,
        policy: DirectPolicy,
        ctl: &Control,
    ) -> Result<SavedFile> {
        if is_url(path) {
            return self.upload(&path.to_string_lossy(), prepared, ctl);
        }
        let (dir, name) = split_path(path)?;
        if path.is_dir() {
            return Err(Error::InvalidArgument(format!(
                "{} is a directory",
                path.display()
            )));
        }
        cleanup_temps(&dir, &name);
        let tmp = TempFile::create(&dir, &name)?;
        reserve(&tmp.file, prepared.total, path)?;
        let want_direct = match policy {
            DirectPolicy::Off => false,
            DirectPolicy::On => true,
            DirectPolicy::Auto => prepared.total >= DIRECT_MIN_BYTES,
        };
        let direct = if want_direct {
            open_direct(&tmp.path, path)?
        } else {
            None
        };
        if want_direct && direct.is_none() {
            log::debug!(
                "{}: the file system refuses O_DIRECT, writing buffered",
                dir.display()
            );
        }
        let used_direct = direct.is_some();
        let file = direct.as_ref().unwrap_or(&tmp.file);
        self.run(
            Dest { file, path },
            &prepared.segments,
            used_direct,
            prepared.sums.as_ref().map(|s| &s.hasher),
            ctl,
        )?;
        ctl.finish()?;
        if let Some(sums) = &prepared.sums {
            // Same length as the placeholder header: no data offset moves.
            let header = sums.header(path)?;
            write::write_all_at(
                Dest {
                    file: &tmp.file,
                    path,
                },
                &header,
                0,
            )?;
        }
        if used_direct {
            // The last write was padded to 4 KiB.
            tmp.file
                .set_len(prepared.total)
                .map_err(|e| Error::io(path, "truncate", prepared.total, e))?;
        }
        tmp.file
            .sync_all()
            .map_err(|e| Error::io(path, "fsync", 0, e))?;
        drop(direct);
        std::fs::rename(&tmp.path, path).map_err(|e| Error::io(path, "rename", 0, e))?;
        tmp.keep();
        sync_dir(&dir)?;
        Ok(SavedFile {
            path: path.to_path_buf(),
            bytes: prepared.total,
            direct: used_direct,
        })
    }

    /// Uploads `prepared` to the object at `url` as a multipart upload: the write plan's
    /// slot-sized writes (as for `O_DIRECT`) gathered into parts and sent from the slots.
    /// The object appears only once complete; on any error the upload is aborted.
    fn upload(&self, url: &str, prepared: &Prepared, ctl: &Control) -> Result<SavedFile> {
        let object = ObjectFile::at(url, &self.opts.object)?;
        let pool = self.staging()?;
        let writes = write::plan(
            &prepared.segments,
            WritePlan {
                direct: true,
                slot_size: pool.slot_size(),
                max_host_write: settings::DIRECT_CHUNK as usize,
            },
        );
        let copier = self.copier(&pool, &prepared.segments)?;
        let mut upload = object.upload()?;
        let parts = write::Parts::new(&mut upload, pool.slot_size(), pool.count(), pool.count());
        // SAFETY: as in `run`.
        unsafe {
            write::run_upload(
                parts,
                &writes,
                &pool,
                copier.as_ref().map(|c| c as &dyn DeviceCopier),
                ctl,
            );
        }
        // On error the upload is dropped here, which aborts it.
        ctl.finish()?;
        upload.complete()?;
        Ok(SavedFile {
            path: PathBuf::from(url),
            bytes: prepared.total,
            direct: false,
        })
    }

    /// How a call with `control` records checksums, to a URL or not.
    fn sum_mode(&self, control: SaveControl<'_>, url: bool) -> SumMode {
        match (self.opts.checksums || control.checksums, url) {
            (false, _) => SumMode::Off,
            (true, false) => SumMode::Streamed,
            (true, true) => SumMode::Upfront,
        }
    }

    /// Plans and runs the writes of `segments` into `dest`, feeding `hasher`.
    fn run(
        &self,
        dest: Dest<'_>,
        segments: &[Segment],
        direct: bool,
        hasher: Option<&RangeHasher>,
        ctl: &Control,
    ) -> Result<()> {
        let pool = self.staging()?;
        let writes = write::plan(
            segments,
            WritePlan {
                direct,
                slot_size: pool.slot_size(),
                max_host_write: settings::DIRECT_CHUNK as usize,
            },
        );
        let copier = self.copier(&pool, segments)?;
        // SAFETY: the sources are the callers' borrows (host slices, device regions whose
        // constructor's contract covers this call), alive until this returns.
        unsafe {
            write::run(
                dest,
                &writes,
                &pool,
                self.opts.threads,
                copier.as_ref().map(|c| c as &dyn DeviceCopier),
                hasher,
                ctl,
            );
        }
        Ok(())
    }

    /// The device-to-host stage for the devices `segments` read from (none for host
    /// memory only).
    fn copier(&self, pool: &StagingPool, segments: &[Segment]) -> Result<Option<CudaCopier>> {
        let mut devices: Vec<usize> = segments
            .iter()
            .filter(|s| s.len > 0)
            .filter_map(|s| match s.src {
                Src::Device { device, .. } => Some(device),
                Src::Host(_) => None,
            })
            .collect();
        devices.sort_unstable();
        devices.dedup();
        if devices.is_empty() {
            return Ok(None);
        }
        cuda::register_pool(pool)?;
        let mut by_device = HashMap::new();
        for d in devices {
            by_device.insert(d, self.streams(d)?);
        }
        Ok(Some(CudaCopier {
            devices: by_device,
            next: AtomicUsize::new(0),
        }))
    }

    /// The streams of device `device`, created on first use.
    fn streams(&self, device: usize) -> Result<(&'static Context, Arc<Vec<Stream>>)> {
        let ctx = Context::get(device)?;
        let mut map = self.streams.lock().expect("saver streams");
        if let Some(s) = map.get(&device) {
            return Ok((ctx, Arc::clone(s)));
        }
        ctx.bind()?;
        let streams = Arc::new(
            (0..self.opts.streams.max(1))
                .map(|_| Stream::new())
                .collect::<Result<Vec<_>>>()?,
        );
        map.insert(device, Arc::clone(&streams));
        Ok((ctx, streams))
    }
}

/// File name of a checkpoint that fits one shard.
const SINGLE_FILE: &str = "model.safetensors";

/// Splits tensors of these byte lengths into shards as Hugging Face's
/// `split_state_dict_into_shards` does: greedily in order, a new shard when the next
/// tensor would take the current one over `max_shard_size`, and a tensor larger than
/// that in a shard of its own (placed before the shard being filled). Returns the
/// tensors' indices per shard.
pub fn plan_shards(lens: &[u64], max_shard_size: u64) -> Vec<Vec<usize>> {
    let mut shards = Vec::new();
    let mut current = Vec::new();
    let mut size = 0u64;
    for (i, &len) in lens.iter().enumerate() {
        if len > max_shard_size {
            shards.push(vec![i]);
            continue;
        }
        if size + len > max_shard_size {
            shards.push(std::mem::take(&mut current));
            size = 0;
        }
        current.push(i);
        size += len;
    }
    if !current.is_empty() {
        shards.push(current);
    }
    shards
}

/// Checks the tensors, serializes the header and lays out the file.
fn prepare(
    tensors: &[&SaveTensor<'_>],
    metadata: Option<&BTreeMap<String, String>>,
    mode: SumMode,
) -> Result<Prepared> {
    let mut seen = HashSet::with_capacity(tensors.len());
    let mut described = Vec::with_capacity(tensors.len());
    for t in tensors {
        if t.name == "__metadata__" {
            return Err(Error::InvalidArgument(
                "a tensor may not be called __metadata__ (the header's metadata key)".into(),
            ));
        }
        if !seen.insert(t.name.as_str()) {
            return Err(Error::InvalidArgument(format!(
                "tensor {:?} is given more than once",
                t.name
            )));
        }
        let need = t
            .shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| {
                Error::InvalidArgument(format!("tensor {:?}: shape overflows 64 bits", t.name))
            })
            .and_then(|n| {
                t.dtype
                    .bytes_for(n)
                    .map_err(|e| Error::InvalidArgument(format!("tensor {:?}: {e}", t.name)))
            })?;
        if need != t.source.len() {
            return Err(Error::InvalidArgument(format!(
                "tensor {:?}: shape {:?} of {} needs {need} bytes but its memory holds {}",
                t.name,
                t.shape,
                t.dtype.name(),
                t.source.len()
            )));
        }
        described.push((t.name.clone(), t.dtype, t.shape.clone()));
    }
    let with_sums = match mode {
        SumMode::Off => None,
        SumMode::Streamed | SumMode::Upfront => {
            let mut m = metadata.cloned().unwrap_or_default();
            if m.contains_key(checksum::METADATA_KEY) {
                return Err(Error::InvalidArgument(format!(
                    "metadata key {:?} is reserved for checksums=True",
                    checksum::METADATA_KEY
                )));
            }
            let digests = tensors
                .iter()
                .map(|t| match (mode, t.source) {
                    (SumMode::Upfront, SaveSource::Host(b)) => {
                        Ok((t.name.as_str(), checksum::xxh3_64(b)))
                    }
                    (SumMode::Upfront, SaveSource::Cuda(_)) => Err(Error::Unsupported(format!(
                        "checksums of CUDA tensors saved to an object store: the header is sent \
                         before the data (tensor {:?}); save to a local file, or from host memory",
                        t.name
                    ))),
                    // Placeholder digits, as wide as the real ones.
                    _ => Ok((t.name.as_str(), 0)),
                })
                .collect::<Result<Vec<_>>>()?;
            m.insert(checksum::METADATA_KEY.into(), checksum::encode(digests));
            Some(m)
        }
    };
    let (header, infos) =
        safetensors::serialize_header(&described, with_sums.as_ref().or(metadata))
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
    let by_name: HashMap<&str, &SaveTensor> =
        tensors.iter().map(|t| (t.name.as_str(), *t)).collect();
    let start = header.len() as u64;
    let mut segments = Vec::with_capacity(infos.len() + 1);
    segments.push(Segment {
        offset: 0,
        len: start,
        src: Src::Host(header.as_ptr()),
    });
    for info in &infos {
        let t = by_name[info.name.as_str()];
        segments.push(Segment {
            offset: start + info.data_offsets.0,
            len: info.len(),
            src: t.source.src(),
        });
    }
    let total = start + infos.last().map_or(0, |i| i.data_offsets.1);
    let sums = match (mode, with_sums) {
        (SumMode::Streamed, Some(metadata)) => Some(StreamedSums {
            hasher: RangeHasher::new(
                infos
                    .iter()
                    .map(|i| (start + i.data_offsets.0, i.len()))
                    .collect(),
            ),
            names: infos.iter().map(|i| i.name.clone()).collect(),
            described,
            metadata,
            header_len: header.len(),
        }),
        _ => None,
    };
    Ok(Prepared {
        _header: header,
        segments,
        total,
        sums,
    })
}

/// `(directory, file name)` of a path to save to.
pub(crate) fn split_path(path: &Path) -> Result<(PathBuf, std::ffi::OsString)> {
    let name = path
        .file_name()
        .ok_or_else(|| Error::InvalidArgument(format!("{}: not a file path", path.display())))?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((dir, name.to_os_string()))
}

/// The prefix of temporary files of a save of `name`.
fn temp_prefix(name: &std::ffi::OsStr) -> Vec<u8> {
    let mut p = Vec::with_capacity(name.len() + 16);
    p.push(b'.');
    p.extend_from_slice(name.as_bytes());
    p.extend_from_slice(TEMP_MARK.as_bytes());
    p
}

/// Removes the temporary files that interrupted saves of `name` left in `dir`. Returns
/// how many it removed. (A save running concurrently on the same final name loses its
/// temporary file: one writer per file name.)
pub fn cleanup_temps(dir: &Path, name: &std::ffi::OsStr) -> usize {
    let prefix = temp_prefix(name);
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        if e.file_name().as_bytes().starts_with(&prefix) && std::fs::remove_file(e.path()).is_ok() {
            log::debug!("removed stale temporary file {}", e.path().display());
            removed += 1;
        }
    }
    removed
}

/// A temporary file in the destination directory, removed on drop unless kept.
pub(crate) struct TempFile {
    pub(crate) path: PathBuf,
    pub(crate) file: File,
    keep: bool,
}

impl TempFile {
    pub(crate) fn create(dir: &Path, name: &std::ffi::OsStr) -> Result<Self> {
        const CHARS: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789_";
        let prefix = temp_prefix(name);
        let mut last = None;
        for _ in 0..100 {
            let mut rnd = [0u8; 8];
            fill_random(&mut rnd);
            let mut file_name = prefix.clone();
            file_name.extend(rnd.iter().map(|b| CHARS[*b as usize % CHARS.len()]));
            let path = dir.join(std::ffi::OsStr::from_bytes(&file_name));
            match OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o666)
                .open(&path)
            {
                Ok(file) => {
                    return Ok(Self {
                        path,
                        file,
                        keep: false,
                    })
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(e),
                Err(e) => return Err(Error::io(dir, "create temporary file", 0, e)),
            }
        }
        Err(Error::io(
            dir,
            "create temporary file",
            0,
            last.unwrap_or_else(|| std::io::Error::other("no free temporary name")),
        ))
    }

    /// The file was renamed to its final name: nothing to remove.
    pub(crate) fn keep(mut self) {
        self.keep = true;
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Random bytes from the kernel (a clock-and-pid mix where `getrandom` fails).
fn fill_random(buf: &mut [u8]) {
    // SAFETY: `buf` is valid for writes of its length.
    let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
    if usize::try_from(n).ok() != Some(buf.len()) {
        let mut x = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ (u64::from(std::process::id()) << 32);
        for b in buf {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
    }
}

/// Allocates the file's blocks up front (`fallocate`), so that a disk without room
/// fails before any byte is written. File systems without `fallocate` skip it.
fn reserve(file: &File, len: u64, path: &Path) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    let len = libc::off_t::try_from(len)
        .map_err(|_| Error::InvalidArgument(format!("{}: file too large", path.display())))?;
    // SAFETY: plain syscall on an open descriptor.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) };
    if rc == 0 {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EOPNOTSUPP | libc::ENOSYS | libc::EINVAL) => Ok(()),
        _ => Err(Error::io(path, "allocate space", 0, e)),
    }
}

/// Opens the temporary file a second time with `O_DIRECT` and proves it with one aligned
/// write at offset 0 (which the first real write overwrites); `None` where the file
/// system refuses `O_DIRECT`.
fn open_direct(tmp: &Path, path: &Path) -> Result<Option<File>> {
    let refused =
        |e: &std::io::Error| matches!(e.raw_os_error(), Some(libc::EINVAL | libc::EOPNOTSUPP));
    let file = match OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(tmp)
    {
        Ok(f) => f,
        Err(e) if refused(&e) => return Ok(None),
        Err(e) => return Err(Error::io(path, "open for writing", 0, e)),
    };
    let block = AlignedBuf::zeroed(DIRECT_ALIGN as usize)?;
    match file.write_all_at(&block, 0) {
        Ok(()) => Ok(Some(file)),
        Err(e) if refused(&e) => Ok(None),
        Err(e) => Err(Error::io(path, "write", 0, e)),
    }
}

/// Deletes the checkpoint objects under the prefix `url` (see [`is_checkpoint_file`])
/// other than `keep` and the index: what [`remove_stale`] does for a directory.
fn remove_stale_objects(url: &str, keep: &[String], opts: &ObjectOptions) -> Result<()> {
    let keep_index = keep.len() > 1;
    for child in ObjectFile::at(url, opts)?.list_children()? {
        let text = child.to_string_lossy();
        let name = text.rsplit('/').next().unwrap_or_default();
        if !is_checkpoint_file(name.as_bytes())
            || keep.iter().any(|k| k == name)
            || (keep_index && name == index::INDEX_FILE_NAME)
        {
            continue;
        }
        ObjectFile::at(&text, opts)?.delete()?;
        log::debug!("removed {text} of an earlier save");
    }
    Ok(())
}

/// Makes a directory's entries (a rename, a removal) durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io(dir, "fsync", 0, e))
}

/// Whether `name` is a file of a checkpoint saved by [`Saver::save_sharded`]:
/// `model(-DDDDD-of-DDDDD)?.safetensors(.index.json)?`, the pattern Hugging Face's
/// tools clean before saving.
fn is_checkpoint_file(name: &[u8]) -> bool {
    let Some(rest) = name.strip_prefix(b"model") else {
        return false;
    };
    let shard = |r: &[u8]| -> Option<usize> {
        let digits = |s: &[u8]| s.len() == 5 && s.iter().all(u8::is_ascii_digit);
        (r.len() >= 15
            && r[0] == b'-'
            && digits(&r[1..6])
            && &r[6..10] == b"-of-"
            && digits(&r[10..15]))
        .then_some(15)
    };
    let rest = &rest[shard(rest).unwrap_or(0)..];
    matches!(rest, b".safetensors" | b".safetensors.index.json")
}

/// Removes checkpoint files in `dir` (see [`is_checkpoint_file`]) other than `keep` and
/// the index, and syncs the directory.
fn remove_stale(dir: &Path, keep: &[String]) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, "read_dir", 0, e))?;
    let keep_index = keep.len() > 1;
    for e in entries.flatten() {
        let name = e.file_name();
        let bytes = name.as_bytes();
        if !is_checkpoint_file(bytes) || keep.iter().any(|k| k.as_bytes() == bytes) {
            continue;
        }
        if keep_index && bytes == index::INDEX_FILE_NAME.as_bytes() {
            continue;
        }
        if e.file_type().is_ok_and(|t| t.is_file()) {
            std::fs::remove_file(e.path()).map_err(|err| Error::io(&e.path(), "remove", 0, err))?;
            log::debug!("removed {} of an earlier save", e.path().display());
        }
    }
    sync_dir(dir)
}

/// The device-to-host stage on CUDA: each slot's copies on one of a few streams per
/// device (round robin), then an event the writer waits on.
struct CudaCopier {
    devices: HashMap<usize, (&'static Context, Arc<Vec<Stream>>)>,
    next: AtomicUsize,
}

struct CudaPending(Vec<(&'static Context, Event)>);

impl Pending for CudaPending {
    fn wait(self: Box<Self>) -> Result<()> {
        for (ctx, event) in &self.0 {
            ctx.bind()?;
            event.wait()?;
        }
        Ok(())
    }
}

impl CudaCopier {
    fn queue_on<'a>(
        &'a self,
        pieces: &[Piece],
        base: *mut u8,
        turn: usize,
        used: &mut Vec<(&'static Context, &'a Stream)>,
        events: &mut Vec<(&'static Context, Event)>,
    ) -> Result<()> {
        let mut devices: Vec<usize> = pieces
            .iter()
            .filter_map(|p| match p.src {
                Src::Device { device, .. } => Some(device),
                Src::Host(_) => None,
            })
            .collect();
        devices.sort_unstable();
        devices.dedup();
        for d in devices {
            let (ctx, streams) = self
                .devices
                .get(&d)
                .ok_or_else(|| Error::InvalidArgument(format!("cuda:{d} was not prepared")))?;
            ctx.bind()?;
            let stream = &streams[turn % streams.len()];
            used.push((ctx, stream));
            for p in pieces {
                if let Src::Device { device, ptr } = p.src {
                    if device == d {
                        // SAFETY: the source is device memory valid for the save (the
                        // region's contract); the destination lies inside the slot, which
                        // the writer keeps until the event below completes.
                        unsafe {
                            cuda::copy_dtoh_async(base.add(p.slot_offset), ptr, p.len, stream)?;
                        }
                    }
                }
            }
            let event = Event::create()?;
            event.record_on(stream)?;
            events.push((ctx, event));
        }
        Ok(())
    }
}

impl DeviceCopier for CudaCopier {
    fn queue(&self, pieces: &[Piece], base: *mut u8) -> Result<Box<dyn Pending>> {
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        let mut used = Vec::new();
        let mut events = Vec::new();
        if let Err(e) = self.queue_on(pieces, base, turn, &mut used, &mut events) {
            // Copies already queued must land before the slot can be reused.
            for (ctx, stream) in used {
                let _ = ctx.bind().and_then(|()| stream.synchronize());
            }
            return Err(e);
        }
        Ok(Box::new(CudaPending(events)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_follow_hugging_face() {
        assert_eq!(plan_shards(&[], 10), Vec::<Vec<usize>>::new());
        assert_eq!(plan_shards(&[4, 4, 4], 10), vec![vec![0, 1], vec![2]]);
        assert_eq!(plan_shards(&[4, 6, 1], 10), vec![vec![0, 1], vec![2]]);
        // A tensor over the limit gets its own shard, placed before the one being filled.
        assert_eq!(
            plan_shards(&[3, 11, 3, 5], 10),
            vec![vec![1], vec![0, 2], vec![3]]
        );
        assert_eq!(plan_shards(&[0, 0], 1), vec![vec![0, 1]]);
    }

    #[test]
    fn checkpoint_file_names() {
        for ok in [
            "model.safetensors",
            "model.safetensors.index.json",
            "model-00001-of-00002.safetensors",
            "model-00010-of-00123.safetensors",
        ] {
            assert!(is_checkpoint_file(ok.as_bytes()), "{ok}");
        }
        for no in [
            "model-1-of-2.safetensors",
            "model.bin",
            "other.safetensors",
            ".model.safetensors.tf-tmp-abc",
            "model-00001-of-00002.safetensorsx",
        ] {
            assert!(!is_checkpoint_file(no.as_bytes()), "{no}");
        }
    }

    #[test]
    fn policy_parses() {
        assert_eq!("AUTO".parse::<DirectPolicy>().unwrap(), DirectPolicy::Auto);
        assert_eq!("on".parse::<DirectPolicy>().unwrap(), DirectPolicy::On);
        assert_eq!("0".parse::<DirectPolicy>().unwrap(), DirectPolicy::Off);
        assert!("sometimes".parse::<DirectPolicy>().is_err());
    }
}
