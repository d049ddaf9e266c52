//! `tensorferry doctor`: what this machine offers and what `auto` would choose.

use std::path::PathBuf;

use anyhow::Result;
use tensorferry::device::cuda;
use tensorferry::source::{local, LocalFile};
use tensorferry::{io, EngineChoice};

#[derive(clap::Args)]
pub struct Args {
    /// A file (or directory) to check O_DIRECT support and the auto engine choice for.
    #[arg(default_value = ".")]
    path: PathBuf,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

pub fn run(args: &Args) -> Result<()> {
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_string();
    let uring = io::uring::available().clone();
    let probe_file = probe_file(&args.path)?;
    let direct = local::supports_direct(&probe_file);
    let driver = cuda::driver_version();
    let gpus = cuda::devices();
    let choose = |to_cuda: bool| match LocalFile::open(&probe_file) {
        Ok(f) if !f.is_empty() => {
            match tensorferry::pipeline::choose_engine(&probe_file, EngineChoice::Auto, &f, to_cuda)
            {
                Ok((e, r)) => (Some(e.to_string()), r),
                Err(e) => (Some(format!("error: {e}")), None),
            }
        }
        _ => (None, None),
    };
    let (auto_engine, resident) = choose(false);
    // What auto would read the file with into GPU memory (GDS when it is real).
    let auto_engine_cuda = if driver.is_ok() { choose(true).0 } else { None };
    let gds = io::gds::state();
    let cufile_lib = io::gds::library().map(io::gds::Cufile::path);
    // cuFileDriverOpen needs the CUDA driver: try it only where there is one.
    let cufile_driver = match (&cufile_lib, &driver) {
        (Ok(_), Ok(_)) => Some(io::gds::driver().map(|_| ())),
        _ => None,
    };
    if args.json {
        let out = serde_json::json!({
            "kernel": kernel,
            "io_uring": uring.as_ref().err().map_or_else(|| "available".to_string(), |e| format!("unavailable: {e}")),
            "path": probe_file.display().to_string(),
            "o_direct": direct,
            "auto_engine": auto_engine,
            "resident": resident,
            "cuda_driver": driver.as_ref().map_or_else(|e| serde_json::Value::String(e.to_string()), |v| serde_json::json!(v)),
            "gpus": gpus.as_ref().map(|g| g.iter().map(|d| serde_json::json!({"ordinal": d.ordinal, "name": d.name, "total_mem": d.total_mem})).collect::<Vec<_>>()).unwrap_or_default(),
            "gds": format!("{gds:?}").to_lowercase(),
            "libcufile": cufile_lib.as_ref().map_or_else(|e| serde_json::json!({"error": e.to_string()}), |p| serde_json::json!({"path": p})),
            "cufile_driver_open": cufile_driver.as_ref().map_or_else(|| serde_json::json!("skipped"), |r| r.as_ref().map_or_else(|e| serde_json::json!({"error": e.to_string()}), |()| serde_json::json!("ok"))),
            "auto_engine_cuda": auto_engine_cuda,
            "cores": tensorferry::settings::cores(),
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!("kernel        {kernel}");
    println!("cores         {}", tensorferry::settings::cores());
    match &uring {
        Ok(()) => println!("io_uring      available (probed with a real read)"),
        Err(e) => println!("io_uring      unavailable: {e} (the pread pool is used instead)"),
    }
    println!(
        "O_DIRECT      {} on the file system of {}",
        if direct { "supported" } else { "refused" },
        probe_file.display()
    );
    match (&auto_engine, resident) {
        (Some(e), Some(r)) => println!(
            "auto engine   {e} for {} ({:.0}% in page cache)",
            probe_file.display(),
            r * 100.0
        ),
        _ => println!("auto engine   (give a non-empty file to see the choice)"),
    }
    match (&driver, &gpus) {
        (Ok(v), Ok(g)) => {
            println!("CUDA driver   {}.{}", v / 1000, (v % 1000) / 10);
            for d in g {
                println!(
                    "  cuda:{}      {} ({:.1} GiB)",
                    d.ordinal,
                    d.name,
                    d.total_mem as f64 / (1u64 << 30) as f64
                );
            }
        }
        (Err(e), _) | (_, Err(e)) => println!("CUDA          {e}"),
    }
    let gds_line = match gds {
        cuda::GdsState::NoLibrary => "not installed (libcufile not found)",
        cuda::GdsState::Compat => {
            "libcufile found, nvidia-fs not loaded: compatibility mode, staging pipeline preferred"
        }
        cuda::GdsState::Real => "real (libcufile + nvidia-fs)",
    };
    println!("GDS           {gds_line}");
    match &cufile_lib {
        Ok(p) => println!("libcufile     loaded from {p}"),
        Err(e) => println!("libcufile     {e}"),
    }
    match &cufile_driver {
        Some(Ok(())) => println!("cuFile driver cuFileDriverOpen succeeded"),
        Some(Err(e)) => println!("cuFile driver {e}"),
        None if cufile_lib.is_ok() => println!("cuFile driver not tried (no CUDA driver)"),
        None => println!("cuFile driver not tried (no libcufile)"),
    }
    if let Some(e) = &auto_engine_cuda {
        println!("auto to GPU   {e} for {}", probe_file.display());
    }
    Ok(())
}

/// The file to probe: `path` itself, or a file inside it (a temporary one if it is empty).
fn probe_file(path: &std::path::Path) -> Result<PathBuf> {
    if path.is_file() {
        return Ok(path.to_path_buf());
    }
    if let Some(f) = std::fs::read_dir(path)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.is_file())
    {
        return Ok(f);
    }
    Ok(path.to_path_buf())
}
