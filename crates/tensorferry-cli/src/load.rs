//! `tensorferry load`: load checkpoints or raw files and report how fast.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Result};
use tensorferry::format::RawSpec;
use tensorferry::source::LocalFile;
use tensorferry::{Checkpoint, Device, Dtype, EngineChoice, LoadOptions, Loader, Report};

use crate::progress::Bar;

#[derive(clap::Args)]
pub struct Args {
    /// Checkpoints (file, index.json or directory), or raw files with --raw.
    #[arg(required = true)]
    paths: Vec<PathBuf>,
    /// Where to load to: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Read engine: auto (per file, by page-cache residency), pread, direct, uring, gds.
    #[arg(long, default_value = "auto")]
    engine: EngineChoice,
    /// Treat the paths as raw flat files of this dtype (whole files).
    #[arg(long, value_name = "DTYPE")]
    raw: Option<Dtype>,
    /// Reader threads (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// Drop the files from the page cache first (a cold load, without root).
    #[arg(long)]
    drop_cache: bool,
    /// Print one JSON object per load instead of text.
    #[arg(long)]
    json: bool,
}

pub fn run(args: &Args) -> Result<()> {
    let device: Device = args.device.parse()?;
    if device != Device::Cpu {
        Loader::check_device(device)?;
    }
    if args.drop_cache {
        for p in &args.paths {
            for f in files_of(p, args.raw.is_some())? {
                LocalFile::open(&f)?.drop_cache()?;
            }
        }
    }
    let mut opts = LoadOptions {
        engine: args.engine,
        ..LoadOptions::default()
    };
    if let Some(t) = args.threads {
        opts.threads = t.max(1);
    }
    if let Some(dtype) = args.raw {
        if device != Device::Cpu {
            bail!("raw loads to {device} are not in the CLI yet; use the Python load_tensor API");
        }
        let specs: Vec<(PathBuf, RawSpec)> = args
            .paths
            .iter()
            .map(|p| {
                (
                    p.clone(),
                    RawSpec {
                        offset: 0,
                        num_elements: None,
                        dtype,
                    },
                )
            })
            .collect();
        let total = specs
            .iter()
            .map(|(p, _)| std::fs::metadata(p).map_or(0, |m| m.len()))
            .sum();
        let (loader, bar) = with_bar(opts, total, "raw", args.json);
        let (_tensors, report) = loader.load_raws(&specs)?;
        bar.finish();
        print_report("raw files", device, &report, args.json);
        return Ok(());
    }
    for p in &args.paths {
        let ck = Checkpoint::open(p)?;
        let (loader, bar) = with_bar(
            opts.clone(),
            ck.total_bytes(),
            &p.display().to_string(),
            args.json,
        );
        let report = match device {
            Device::Cpu => loader.load_checkpoint(&ck)?.1,
            Device::Cuda(n) => loader.load_checkpoint_cuda(&ck, n)?.1,
        };
        bar.finish();
        print_report(&p.display().to_string(), device, &report, args.json);
    }
    Ok(())
}

fn with_bar(mut opts: LoadOptions, total: u64, what: &str, quiet: bool) -> (Loader, Arc<Bar>) {
    let bar = Bar::new(total, what, quiet);
    let b = Arc::clone(&bar);
    opts.progress = Some(Arc::new(move |done, _| b.update(done)));
    (Loader::new(opts), bar)
}

/// The files a load of `path` reads.
pub fn files_of(path: &std::path::Path, raw: bool) -> Result<Vec<PathBuf>> {
    if raw {
        return Ok(vec![path.to_path_buf()]);
    }
    let ck = Checkpoint::open(path)?;
    if ck.files.is_empty() {
        bail!("{}: no files", path.display());
    }
    Ok(ck.files)
}

fn print_report(what: &str, device: Device, r: &Report, json: bool) {
    if json {
        let files: Vec<_> = r
            .files
            .iter()
            .map(|f| {
                serde_json::json!({
                    "path": f.path.display().to_string(),
                    "engine": f.engine.to_string(),
                    "bytes": f.bytes,
                    "resident": f.resident,
                })
            })
            .collect();
        let out = serde_json::json!({
            "path": what, "device": device.to_string(), "bytes": r.bytes,
            "seconds": r.seconds, "gbps": r.gbps(), "files": files,
        });
        println!("{out}");
        return;
    }
    println!(
        "{what} -> {device}: {} bytes in {:.3} s, {:.2} GB/s",
        r.bytes,
        r.seconds,
        r.gbps()
    );
    for f in &r.files {
        let resident = f
            .resident
            .map(|x| format!(" ({:.0}% cached)", x * 100.0))
            .unwrap_or_default();
        println!(
            "  {:<18} {:>14} bytes  {}{}",
            f.engine.to_string(),
            f.bytes,
            f.path.display(),
            resident
        );
    }
}
