//! Copies of whole files between local paths and object stores, in either direction:
//! byte ranges streamed through the staging pool (never a whole file in memory), files
//! in parallel. Local destinations are written durably (temporary file, `fsync`,
//! rename, `fsync` of the directory, as saves are); object destinations by multipart
//! upload, visible only once complete and aborted on any error or cancellation.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use crate::device::staging::StagingPool;
use crate::error::{Error, Result};
use crate::io::write::Parts;
use crate::io::Control;
use crate::saver::{cleanup_temps, split_path, sync_dir, SaveControl, TempFile};
use crate::settings;
use crate::source::{is_url, ObjectFile, ObjectOptions};

/// Options of [`copy_files`].
#[derive(Debug, Clone)]
pub struct CopyOptions {
    /// Files copied at once.
    pub files: usize,
    /// Ranges in flight at once within a file written locally.
    pub threads: usize,
    /// Staging slot size: the size of each range read and written.
    pub slot_size: usize,
    /// Staging slots: bound the memory a copy uses.
    pub slots: usize,
    /// Object store configuration for URLs.
    pub object: ObjectOptions,
}

impl Default for CopyOptions {
    fn default() -> Self {
        let save = crate::saver::SaveOptions::default();
        Self {
            files: 4,
            threads: save.threads,
            slot_size: save.slot_size,
            slots: save.slots,
            object: save.object,
        }
    }
}

/// What a copy did.
#[derive(Debug, Clone, Default)]
pub struct CopyReport {
    /// Bytes copied.
    pub bytes: u64,
    /// Wall time.
    pub seconds: f64,
    /// `(destination, bytes)` of each file, in the order given.
    pub files: Vec<(PathBuf, u64)>,
}

/// Where a file's bytes come from.
enum Reader {
    Local(File, PathBuf),
    Object(ObjectFile, usize),
}

impl Reader {
    fn open(path: &Path, opts: &ObjectOptions) -> Result<(Self, u64)> {
        if is_url(path) {
            let f = ObjectFile::open(&path.to_string_lossy(), opts)?;
            let len = f.len().unwrap_or(0);
            return Ok((Self::Object(f, opts.retries), len));
        }
        let f = File::open(path).map_err(|e| Error::io(path, "open", 0, e))?;
        let meta = f.metadata().map_err(|e| Error::io(path, "stat", 0, e))?;
        if meta.is_dir() {
            return Err(Error::InvalidArgument(format!(
                "{} is a directory",
                path.display()
            )));
        }
        Ok((Self::Local(f, path.to_path_buf()), meta.len()))
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        match self {
            Self::Local(f, path) => f.read_exact_at(buf, offset).map_err(|e| {
                if e.kind() == std::io::ErrorKind::UnexpectedEof {
                    Error::UnexpectedEof {
                        path: path.clone(),
                        at: offset,
                        needed: buf.len() as u64,
                    }
                } else {
                    Error::io(path, "read", offset, e)
                }
            }),
            Self::Object(o, retries) => o.read_exact_at(buf, offset, *retries),
        }
    }
}

/// Copies each `(source, destination)` pair, `opts.files` at a time, through one staging
/// pool. Every destination is complete or absent (as before) when this returns; the
/// first error stops the copy and is returned.
pub fn copy_files(
    pairs: &[(PathBuf, PathBuf)],
    opts: &CopyOptions,
    control: SaveControl<'_>,
) -> Result<CopyReport> {
    let start = Instant::now();
    let mut readers = Vec::with_capacity(pairs.len());
    for (src, _) in pairs {
        readers.push(Reader::open(src, &opts.object)?);
    }
    let total = readers.iter().map(|(_, len)| len).sum();
    let ctl = Control::new(total, control.cancel, control.progress);
    let pool = StagingPool::new(opts.slot_size, opts.slots)?;
    let files = opts.files.clamp(1, pairs.len().max(1));
    // Each file uploading holds at most one part's slots while gathering it: together
    // they never take the whole pool, so gathering cannot deadlock.
    let share = pool.count() / files;
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..files {
            s.spawn(|| {
                while !ctl.should_stop() {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(((reader, len), (_, dst))) = readers.iter().zip(pairs).nth(i) else {
                        break;
                    };
                    let r = if is_url(dst) {
                        upload(reader, *len, dst, &pool, share, opts, &ctl)
                    } else {
                        write_local(reader, *len, dst, &pool, opts.threads, &ctl)
                    };
                    if let Err(e) = r {
                        ctl.fail(e);
                    }
                }
            });
        }
    });
    ctl.finish()?;
    Ok(CopyReport {
        bytes: total,
        seconds: start.elapsed().as_secs_f64(),
        files: pairs
            .iter()
            .zip(&readers)
            .map(|((_, d), (_, len))| (d.clone(), *len))
            .collect(),
    })
}

/// Streams `reader` into a multipart upload to `dst`, holding at most `share` slots.
fn upload(
    reader: &Reader,
    len: u64,
    dst: &Path,
    pool: &StagingPool,
    share: usize,
    opts: &CopyOptions,
    ctl: &Control,
) -> Result<()> {
    let object = ObjectFile::at(&dst.to_string_lossy(), &opts.object)?;
    let mut up = object.upload()?;
    let mut parts = Parts::new(&mut up, pool.slot_size(), pool.count(), share);
    let slot = pool.slot_size() as u64;
    let mut offset = 0u64;
    while offset < len {
        if ctl.should_stop() {
            return Ok(()); // the upload is dropped: aborted
        }
        let n = (len - offset).min(slot) as usize;
        let mut s = pool.acquire();
        reader.read_at(&mut s.as_mut_slice()[..n], offset)?;
        parts.push(s, n)?;
        ctl.add(n as u64);
        offset += n as u64;
    }
    parts.finish()?;
    if ctl.should_stop() {
        return Ok(());
    }
    up.complete()
}

/// Streams `reader` into a temporary file next to `dst`, ranges in parallel, then syncs
/// and renames it.
fn write_local(
    reader: &Reader,
    len: u64,
    dst: &Path,
    pool: &StagingPool,
    threads: usize,
    ctl: &Control,
) -> Result<()> {
    if dst.is_dir() {
        return Err(Error::InvalidArgument(format!(
            "{} is a directory",
            dst.display()
        )));
    }
    let (dir, name) = split_path(dst)?;
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, "create directory", 0, e))?;
    cleanup_temps(&dir, &name);
    let tmp = TempFile::create(&dir, &name)?;
    let slot = pool.slot_size() as u64;
    let chunks = len.div_ceil(slot);
    let next = AtomicUsize::new(0);
    let local = Control::new(len, None, None);
    let worker = || {
        while !ctl.should_stop() && !local.should_stop() {
            let chunk = next.fetch_add(1, Ordering::Relaxed) as u64;
            if chunk >= chunks {
                break;
            }
            let offset = chunk * slot;
            let take = (len - offset).min(slot) as usize;
            let mut held = pool.acquire();
            let buf = &mut held.as_mut_slice()[..take];
            let r = reader.read_at(buf, offset).and_then(|()| {
                tmp.file
                    .write_all_at(buf, offset)
                    .map_err(|e| Error::io(dst, "write", offset, e))
            });
            match r {
                Ok(()) => ctl.add(take as u64),
                Err(e) => local.fail(e),
            }
        }
    };
    let threads = threads.clamp(1, settings::MAX_DEFAULT_THREADS);
    std::thread::scope(|scope| {
        for _ in 0..threads.min(usize::try_from(chunks).unwrap_or(usize::MAX)) {
            scope.spawn(worker);
        }
    });
    local.finish()?;
    if ctl.should_stop() {
        return Ok(()); // the temporary file is removed; the run's error says why
    }
    tmp.file
        .sync_all()
        .map_err(|e| Error::io(dst, "fsync", 0, e))?;
    std::fs::rename(&tmp.path, dst).map_err(|e| Error::io(dst, "rename", 0, e))?;
    tmp.keep();
    sync_dir(&dir)
}
