//! Opening a checkpoint: one safetensors file, a sharded checkpoint's index, or a
//! directory holding either; headers are read with one or two preads per file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::format::{index, safetensors, Dtype, FormatError, Header, TensorInfo};
use crate::source::{is_url, LocalFile, Location, ObjectFile, ObjectOptions};

/// Bytes read first from a file, in the hope the whole header is in them.
const FIRST_READ: usize = 64 * 1024;

/// A tensor in a checkpoint, with the file that holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorEntry {
    /// The tensor's header entry.
    pub info: TensorInfo,
    /// Index into [`Checkpoint::files`].
    pub file: usize,
    /// Absolute offset of its first byte in that file.
    pub file_offset: u64,
}

impl TensorEntry {
    /// The tensor's name.
    pub fn name(&self) -> &str {
        &self.info.name
    }
    /// Its dtype.
    pub fn dtype(&self) -> Dtype {
        self.info.dtype
    }
    /// Its shape.
    pub fn shape(&self) -> &[u64] {
        &self.info.shape
    }
    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.info.len()
    }
    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.info.is_empty()
    }
    /// The extent that reads this whole tensor into the start of destination `dest`.
    pub fn extent(&self, dest: usize) -> crate::plan::Extent {
        crate::plan::Extent {
            file: self.file,
            offset: self.file_offset,
            len: self.len(),
            dest,
            dest_offset: 0,
        }
    }
}

/// A checkpoint's layout: its files, their headers, and every tensor sorted by name.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// What the caller opened (file, index or directory).
    pub path: PathBuf,
    /// The safetensors files, in the order tensors refer to them.
    pub files: Vec<PathBuf>,
    /// Each file's header, in the same order.
    pub headers: Vec<Header>,
    /// Each file's size.
    pub file_lens: Vec<u64>,
    /// Every tensor, sorted by name.
    pub tensors: Vec<TensorEntry>,
    /// `__metadata__` of a single file; of a sharded checkpoint, the index's `metadata`
    /// values (strings as they are, other values as JSON text).
    pub metadata: Option<BTreeMap<String, String>>,
    /// Whether this came from an index.
    pub sharded: bool,
}

impl Checkpoint {
    /// Opens a `.safetensors` file, a `*.index.json`, or a directory holding
    /// `model.safetensors.index.json` or `*.safetensors` files. Each may be an object
    /// store URL (`s3://`, `gs://`, `az://`, `http(s)://`; a URL that names neither a
    /// `.safetensors` nor a `.json` object is a prefix, like a directory), configured
    /// from the environment.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_with(path, &crate::loader::default_object_options())
    }

    /// [`Checkpoint::open`] with object store options (credentials, endpoint, ...).
    pub fn open_with(path: impl AsRef<Path>, object: &ObjectOptions) -> Result<Self> {
        let path = path.as_ref();
        if is_url(path) {
            return Self::open_url(path, object);
        }
        let meta = std::fs::metadata(path).map_err(|e| Error::io(path, "stat", 0, e))?;
        if meta.is_dir() {
            let idx = path.join(index::INDEX_FILE_NAME);
            if idx.exists() {
                return Self::open_index(&idx, path, object);
            }
            let mut files: Vec<PathBuf> = std::fs::read_dir(path)
                .map_err(|e| Error::io(path, "read_dir", 0, e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            files.sort();
            if files.is_empty() {
                return Err(Error::InvalidArgument(format!(
                    "{}: directory holds neither {} nor *.safetensors files",
                    path.display(),
                    index::INDEX_FILE_NAME
                )));
            }
            return Self::from_files(path, files, None, true, object);
        }
        if path.to_string_lossy().ends_with(".json") {
            let dir = path.parent().unwrap_or(Path::new("."));
            return Self::open_index(path, dir, object);
        }
        Self::from_files(path, vec![path.to_path_buf()], None, false, object)
    }

    fn open_url(url: &Path, object: &ObjectOptions) -> Result<Self> {
        let text = url.to_string_lossy();
        if text.ends_with(".json") {
            let dir = text.rsplit_once('/').map_or(&*text, |(d, _)| d);
            return Self::open_index(url, Path::new(dir), object);
        }
        if text.ends_with(".safetensors") {
            return Self::from_files(url, vec![url.to_path_buf()], None, false, object);
        }
        // A prefix: its index if it has one, else its *.safetensors objects.
        let loc = Location::of(url);
        let idx = loc.join(index::INDEX_FILE_NAME);
        match Self::open_index(&idx, url, object) {
            Err(Error::NotFound { path }) if path == idx => {}
            other => return other,
        }
        let prefix = ObjectFile::at(&text, object)?;
        let mut files: Vec<PathBuf> = prefix
            .list_children()?
            .into_iter()
            .filter(|p| p.to_string_lossy().ends_with(".safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(Error::NotFound {
                path: url.to_path_buf(),
            });
        }
        Self::from_files(url, files, None, true, object)
    }

    fn open_index(idx_path: &Path, dir: &Path, object: &ObjectOptions) -> Result<Self> {
        let bytes = if is_url(idx_path) {
            read_url(idx_path, object)?
        } else {
            std::fs::read(idx_path).map_err(|e| Error::io(idx_path, "read", 0, e))?
        };
        let dir_loc = Location::of(dir);
        let idx = index::parse_index(&bytes).map_err(|e| Error::invalid(idx_path, e))?;
        // One file per path, however the index spells it (`a`, `./a`): paths compare by
        // components.
        let mut shards: Vec<PathBuf> = Vec::new();
        for s in idx.shards() {
            let p = dir_loc.join(s);
            if !shards.contains(&p) {
                shards.push(p);
            }
        }
        let mut ck = Self::from_files(idx_path, shards, Some(&idx), true, object)?;
        // The index is the truth: every tensor it lists must be in its shard, and only
        // those tensors are part of the checkpoint.
        let shard_of: BTreeMap<&str, PathBuf> = idx
            .weight_map
            .iter()
            .map(|(n, s)| (n.as_str(), dir_loc.join(s)))
            .collect();
        for (name, shard) in &shard_of {
            let found = ck
                .tensors
                .iter()
                .any(|t| t.name() == *name && ck.files[t.file] == *shard);
            if !found {
                return Err(Error::TensorNotFound {
                    path: shard.clone(),
                    name: (*name).to_string(),
                });
            }
        }
        ck.tensors.retain(|t| {
            shard_of
                .get(t.name())
                .is_some_and(|s| *s == ck.files[t.file])
        });
        Ok(ck)
    }

    fn from_files(
        path: &Path,
        files: Vec<PathBuf>,
        index: Option<&index::Index>,
        sharded: bool,
        object: &ObjectOptions,
    ) -> Result<Self> {
        let index_meta = index.and_then(|i| i.metadata.as_ref());
        let mut headers = Vec::with_capacity(files.len());
        let mut file_lens = Vec::with_capacity(files.len());
        let mut tensors = Vec::new();
        for (i, f) in files.iter().enumerate() {
            let (header, len) = read_header_with(f, object)?;
            for t in &header.tensors {
                tensors.push(TensorEntry {
                    info: t.clone(),
                    file: i,
                    file_offset: header.data_start() + t.data_offsets.0,
                });
            }
            headers.push(header);
            file_lens.push(len);
        }
        tensors.sort_by(|a, b| a.info.name.cmp(&b.info.name));
        if let Some(w) = tensors
            .windows(2)
            .find(|w| w[0].info.name == w[1].info.name)
        {
            // With an index, the index says which copy counts (see `open_index`).
            if index.is_none() {
                return Err(Error::invalid(
                    &files[w[1].file],
                    FormatError::DuplicateTensor {
                        name: w[1].info.name.clone(),
                    },
                ));
            }
        }
        let metadata = match index_meta {
            Some(m) => Some(
                m.iter()
                    .map(|(k, v)| {
                        (
                            k.clone(),
                            v.as_str().map_or_else(|| v.to_string(), str::to_string),
                        )
                    })
                    .collect(),
            ),
            None if !sharded => headers.first().and_then(|h| h.metadata.clone()),
            None => None,
        };
        Ok(Self {
            path: path.to_path_buf(),
            files,
            headers,
            file_lens,
            tensors,
            metadata,
            sharded,
        })
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Result<&TensorEntry> {
        self.tensors
            .binary_search_by(|t| t.info.name.as_str().cmp(name))
            .map(|i| &self.tensors[i])
            .map_err(|_| Error::TensorNotFound {
                path: self.path.clone(),
                name: name.to_string(),
            })
    }

    /// Total bytes of tensor data.
    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().map(TensorEntry::len).sum()
    }
}

/// Reads and validates one file's header with one pread (two when the header is longer
/// than the first read). Returns the header and the file's size.
pub fn read_header(path: &Path) -> Result<(Header, u64)> {
    read_header_with(path, &crate::loader::default_object_options())
}

/// [`read_header`] for a path or URL: from an object store, one ranged GET (two when
/// the header is longer than the first).
pub fn read_header_with(path: &Path, object: &ObjectOptions) -> Result<(Header, u64)> {
    if is_url(path) {
        let mut f = ObjectFile::at(&path.to_string_lossy(), object)?;
        let mut buf = f.read_prefix(FIRST_READ as u64)?;
        let len = f.len().unwrap_or(buf.len() as u64);
        let n = safetensors::header_len(&buf, len).map_err(|e| Error::invalid(path, e))?;
        let need = 8 + n as usize;
        if need > buf.len() {
            let first = buf.len();
            buf.resize(need, 0);
            f.read_exact_at(&mut buf[first..], first as u64, object.retries)?;
        }
        let header =
            safetensors::parse_header(&buf[..need], len).map_err(|e| Error::invalid(path, e))?;
        return Ok((header, len));
    }
    let f = LocalFile::open(path)?;
    let len = f.len();
    let first = (len as usize).min(FIRST_READ);
    let mut buf = vec![0u8; first];
    f.read_exact_at(&mut buf, 0)?;
    let n = safetensors::header_len(&buf, len).map_err(|e| Error::invalid(path, e))?;
    let need = 8 + n as usize;
    if need > buf.len() {
        buf.resize(need, 0);
        f.read_exact_at(&mut buf[first..], first as u64)?;
    }
    let header =
        safetensors::parse_header(&buf[..need], len).map_err(|e| Error::invalid(path, e))?;
    Ok((header, len))
}

/// Reads a whole (small) object, such as an index.
fn read_url(url: &Path, object: &ObjectOptions) -> Result<Vec<u8>> {
    let mut f = ObjectFile::at(&url.to_string_lossy(), object)?;
    let mut buf = f.read_prefix(FIRST_READ as u64)?;
    let len = f.len().unwrap_or(buf.len() as u64);
    if len > buf.len() as u64 {
        let first = buf.len();
        buf.resize(len as usize, 0);
        f.read_exact_at(&mut buf[first..], first as u64, object.retries)?;
    }
    Ok(buf)
}
