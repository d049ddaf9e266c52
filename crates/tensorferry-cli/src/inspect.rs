//! `tensorferry inspect`: a checkpoint's layout, for people or as JSON.

use std::path::PathBuf;

use anyhow::Result;
use tensorferry::Checkpoint;

#[derive(clap::Args)]
pub struct Args {
    /// A .safetensors file, a sharded checkpoint's index.json, or a directory.
    path: PathBuf,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(args: &Args) -> Result<()> {
    let ck = Checkpoint::open(&args.path)?;
    if args.json {
        let tensors: serde_json::Map<String, serde_json::Value> = ck
            .tensors
            .iter()
            .map(|t| {
                (
                    t.name().to_string(),
                    serde_json::json!({
                        "dtype": t.dtype().name(),
                        "shape": t.shape(),
                        "data_offsets": [t.info.data_offsets.0, t.info.data_offsets.1],
                        "file": ck.files[t.file].display().to_string(),
                    }),
                )
            })
            .collect();
        let out = serde_json::json!({ "metadata": ck.metadata, "tensors": tensors });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    let name_w = ck
        .tensors
        .iter()
        .map(|t| t.name().len())
        .max()
        .unwrap_or(4)
        .max(4);
    println!(
        "{:<name_w$}  {:<8} {:<20} {:>14}  {:<24} file",
        "name", "dtype", "shape", "bytes", "data_offsets"
    );
    for t in &ck.tensors {
        let shape = format!("{:?}", t.shape());
        let offs = format!("[{}, {}]", t.info.data_offsets.0, t.info.data_offsets.1);
        let file = ck.files[t.file]
            .file_name()
            .map_or_else(String::new, |f| f.to_string_lossy().into_owned());
        println!(
            "{:<name_w$}  {:<8} {:<20} {:>14}  {:<24} {}",
            t.name(),
            t.dtype().name(),
            shape,
            t.len(),
            offs,
            file
        );
    }
    if let Some(meta) = &ck.metadata {
        println!("\nmetadata:");
        for (k, v) in meta {
            println!("  {k}: {v}");
        }
    }
    println!(
        "\n{} tensors, {} bytes ({:.3} GB) in {} file(s)",
        ck.tensors.len(),
        ck.total_bytes(),
        ck.total_bytes() as f64 / 1e9,
        ck.files.len()
    );
    Ok(())
}
