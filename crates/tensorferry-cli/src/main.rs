//! `tensorferry`: inspect, load, copy, demo and diagnose tensor checkpoints from the shell.
//! Data goes to stdout, progress and logs to stderr; `--json` for scripts.

mod cp;
mod demo;
mod doctor;
mod inspect;
mod load;
mod progress;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "tensorferry",
    version,
    about = "Move tensors between storage and memory as fast as the hardware allows"
)]
struct Cli {
    /// More logging on stderr (-v info, -vv debug); TENSORFERRY_LOG overrides.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List a checkpoint's tensors (dtype, shape, bytes, offsets, file) and metadata.
    Inspect(inspect::Args),
    /// Load checkpoints or raw files and report bytes, seconds, GB/s and engines.
    Load(load::Args),
    /// Copy a file or a sharded checkpoint between local paths and object stores.
    Cp(cp::Args),
    /// Make a sample sharded checkpoint and load it with tensorferry and a plain baseline.
    Demo(demo::Args),
    /// Report what this machine offers: kernel, io_uring, O_DIRECT, CUDA, GDS.
    Doctor(doctor::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let default_level = match cli.verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    env_logger::Builder::from_env(
        env_logger::Env::new().filter_or(tensorferry::settings::LOG, default_level),
    )
    .format_timestamp(None)
    .init();
    let result = match cli.command {
        Command::Inspect(a) => inspect::run(&a),
        Command::Load(a) => load::run(&a),
        Command::Cp(a) => cp::run(&a),
        Command::Demo(a) => demo::run(&a),
        Command::Doctor(a) => doctor::run(&a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let top = e.to_string();
            eprintln!("error: {top}");
            let mut source = e.source();
            while let Some(s) = source {
                let s_text = s.to_string();
                if !top.contains(&s_text) {
                    eprintln!("  caused by: {s_text}");
                }
                source = s.source();
            }
            if let Some(hint) = hint(&e) {
                eprintln!("hint: {hint}");
            }
            ExitCode::FAILURE
        }
    }
}

/// A line of advice for the errors people meet most.
fn hint(e: &anyhow::Error) -> Option<&'static str> {
    use tensorferry::Error as E;
    match e.downcast_ref::<E>()? {
        E::NotFound { .. } => Some("check the path; a sharded checkpoint can be given as its directory or its index.json"),
        E::PermissionDenied { .. } => Some("check the file's permissions"),
        E::InvalidFile { .. } => Some("the file is not a valid safetensors file (or is truncated); `tensorferry inspect` shows what was read"),
        E::TensorNotFound { .. } => Some("`tensorferry inspect PATH` lists the tensors"),
        E::Unsupported(_) | E::Cuda(_) => Some("`tensorferry doctor` shows what this machine supports"),
        _ => None,
    }
}
