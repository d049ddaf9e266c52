//! `tensorferry cp SRC DST`: copy a file or a sharded checkpoint (its index and shards)
//! between local paths and object stores, in any direction. Ranges are streamed through
//! a bounded staging pool, files in parallel; local destinations are written durably,
//! object destinations by multipart upload (visible only once complete). A checkpoint's
//! index is copied last, so it never names a shard that is not there yet.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Result;
use tensorferry::copy::{copy_files, CopyOptions};
use tensorferry::source::{is_url, Location};
use tensorferry::{Checkpoint, SaveControl};

use crate::progress::Bar;

#[derive(clap::Args)]
pub struct Args {
    /// A file, or a sharded checkpoint (its directory or prefix, or its index.json); a
    /// local path or a URL (s3://, gs://, az://, http(s)://).
    src: PathBuf,
    /// Where to: a file path or URL for a file (a directory or a path ending in `/`
    /// takes the source's name), a directory or prefix for a checkpoint.
    dst: PathBuf,
    /// Files copied at once.
    #[arg(long, default_value_t = 4)]
    jobs: usize,
    /// Print a JSON summary on stdout instead of text.
    #[arg(long)]
    json: bool,
}

/// Set by the first Ctrl-C; the copy stops, discards the file in progress (a local
/// temporary file is removed, an upload aborted) and exits with status 130.
static CANCEL: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    if CANCEL.swap(true, Ordering::SeqCst) {
        // A second Ctrl-C: stop at once.
        // SAFETY: `_exit` is async-signal-safe.
        unsafe { libc::_exit(130) };
    }
}

pub fn run(args: &Args) -> Result<()> {
    // SAFETY: the handler only stores to an atomic and calls `_exit`, both
    // async-signal-safe.
    unsafe { libc::signal(libc::SIGINT, on_sigint as *const () as libc::sighandler_t) };
    let opts = CopyOptions {
        files: args.jobs.max(1),
        ..CopyOptions::default()
    };
    let pairs = plan(&args.src, &args.dst, &opts)?;
    let bar = Bar::new(0, &format!("copying {}", args.src.display()), args.json);
    let b = Arc::clone(&bar);
    let progress = move |done: u64, total: u64| b.update_of(done, total);
    let report = match copy_files(
        &pairs,
        &opts,
        SaveControl {
            cancel: Some(&CANCEL),
            progress: Some(&progress),
            ..SaveControl::default()
        },
    ) {
        Ok(r) => r,
        Err(tensorferry::Error::Cancelled) => {
            bar.finish();
            eprintln!(
                "cancelled: the file in progress was discarded (files copied before it stay; a \
                 checkpoint's index is copied last)"
            );
            std::process::exit(130);
        }
        Err(e) => return Err(e.into()),
    };
    bar.finish();
    if args.json {
        let files: Vec<_> = pairs
            .iter()
            .zip(&report.files)
            .map(|((src, dst), (_, bytes))| {
                serde_json::json!({
                    "src": src.display().to_string(),
                    "dst": dst.display().to_string(),
                    "bytes": bytes,
                })
            })
            .collect();
        let gbps = if report.seconds > 0.0 {
            report.bytes as f64 / report.seconds / 1e9
        } else {
            0.0
        };
        let out = serde_json::json!({
            "src": args.src.display().to_string(),
            "dst": args.dst.display().to_string(),
            "bytes": report.bytes, "seconds": report.seconds, "gbps": gbps, "files": files,
        });
        println!("{out}");
    } else {
        println!(
            "copied {} file(s), {} bytes in {:.3} s",
            pairs.len(),
            report.bytes,
            report.seconds
        );
        for (src, dst) in &pairs {
            println!("  {} -> {}", src.display(), dst.display());
        }
    }
    Ok(())
}

/// Whether `src` names one file rather than a checkpoint (a directory, a prefix or an
/// index): a local file, or a URL whose last segment has an extension other than `.json`.
fn is_single_file(src: &Path) -> bool {
    let text = src.to_string_lossy();
    if is_json(src) {
        return false;
    }
    if is_url(src) {
        let last = text.trim_end_matches('/').rsplit('/').next().unwrap_or("");
        !text.ends_with('/') && last.contains('.')
    } else {
        src.is_file()
    }
}

fn is_json(p: &Path) -> bool {
    p.extension()
        .is_some_and(|x| x.eq_ignore_ascii_case("json"))
}

/// The `(source, destination)` pairs to copy, a checkpoint's index last.
fn plan(src: &Path, dst: &Path, opts: &CopyOptions) -> Result<Vec<(PathBuf, PathBuf)>> {
    let dst_text = dst.to_string_lossy();
    if is_single_file(src) {
        let text = src.to_string_lossy();
        let name = text.trim_end_matches('/').rsplit('/').next().unwrap_or("");
        let into_dir = dst_text.ends_with('/') || (!is_url(dst) && dst.is_dir());
        let to = if into_dir {
            Location::of(dst).join(name)
        } else {
            dst.to_path_buf()
        };
        return Ok(vec![(src.to_path_buf(), to)]);
    }
    let ck = Checkpoint::open_with(src, &opts.object)?;
    let ck_text = ck.path.to_string_lossy().into_owned();
    let index = is_json(&ck.path).then(|| ck.path.clone());
    let base = match &index {
        Some(_) => ck_text
            .rsplit_once('/')
            .map_or(String::new(), |(d, _)| d.to_string()),
        None => ck_text.trim_end_matches('/').to_string(),
    };
    let to = Location::of(dst);
    let rel = |f: &Path| -> String {
        let t = f.to_string_lossy();
        match t.strip_prefix(&format!("{base}/")) {
            Some(r) if !base.is_empty() => r.to_string(),
            _ => t.rsplit('/').next().unwrap_or("").to_string(),
        }
    };
    let mut pairs: Vec<(PathBuf, PathBuf)> = ck
        .files
        .iter()
        .map(|f| (f.clone(), to.join(&rel(f))))
        .collect();
    if let Some(i) = index {
        let j = to.join(&rel(&i));
        pairs.push((i, j));
    }
    Ok(pairs)
}
