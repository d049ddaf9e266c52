//! `tensorferry demo`: makes a sample sharded checkpoint once, then loads it with
//! tensorferry and with the plain baseline (mmap and copy, as safetensors does), and
//! prints both, side by side, from the same run.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use tensorferry::device::cuda::{Context as CudaContext, DeviceBuffer};
use tensorferry::format::index::INDEX_FILE_NAME;
use tensorferry::format::safetensors::serialize_header;
use tensorferry::{Checkpoint, Device, Dtype, Loader};

#[derive(clap::Args)]
pub struct Args {
    /// Approximate checkpoint size (K, M, G suffixes).
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    size: u64,
    /// Where to keep the sample checkpoint.
    #[arg(long, default_value = "demo-data")]
    dir: PathBuf,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
    /// Load to host memory even when a GPU is present.
    #[arg(long)]
    cpu: bool,
}

fn parse_size(s: &str) -> Result<u64, String> {
    tensorferry::settings::parse_size(s)
        .ok_or_else(|| format!("{s:?} is not a size (e.g. 512M, 2G)"))
}

pub fn run(args: &Args) -> Result<()> {
    let dir = args.dir.join(format!("sample-{}", args.size));
    if !dir.join(INDEX_FILE_NAME).exists() {
        eprintln!(
            "making a sample checkpoint of about {} MB in {} ...",
            args.size / 1_000_000,
            dir.display()
        );
        make_sample(&dir, args.size)?;
    }
    let ck = Checkpoint::open(&dir)?;
    let total = ck.total_bytes();
    let gpu = !args.cpu && Loader::check_device(Device::Cuda(0)).is_ok();
    let device = if gpu { Device::Cuda(0) } else { Device::Cpu };
    eprintln!(
        "{} tensors, {:.2} GB in {} shards; loading to {device}",
        ck.tensors.len(),
        total as f64 / 1e9,
        ck.files.len()
    );
    if gpu {
        return run_gpu(&ck, args.json);
    }

    // Best of two runs each (the first warms the page cache).
    let mut base_best = f64::MAX;
    let mut base_out = Vec::new();
    for _ in 0..2 {
        let t = Instant::now();
        base_out = baseline_load(&ck)?;
        base_best = base_best.min(t.elapsed().as_secs_f64());
    }
    let loader = Loader::default();
    let mut tf_best = f64::MAX;
    let mut engines = String::new();
    for _ in 0..2 {
        let (tensors, report) = loader.load_checkpoint(&ck)?;
        tf_best = tf_best.min(report.seconds);
        engines = report
            .files
            .iter()
            .map(|f| f.engine.to_string())
            .collect::<Vec<_>>()
            .join(", ");
        for (a, b) in tensors.iter().zip(&base_out) {
            if *a.data != **b {
                bail!(
                    "tensor {} differs between tensorferry and the baseline",
                    a.name
                );
            }
        }
    }
    let gbps = |s: f64| total as f64 / s / 1e9;
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "bytes": total, "device": "cpu",
                "baseline": {"seconds": base_best, "gbps": gbps(base_best)},
                "tensorferry": {"seconds": tf_best, "gbps": gbps(tf_best), "engines": engines},
                "speedup": base_best / tf_best,
            })
        );
        return Ok(());
    }
    println!(
        "{:<32} {:>9} {:>8} {:>8}",
        "loader (page cache -> host)", "seconds", "GB/s", "ratio"
    );
    println!(
        "{:<32} {:>9.3} {:>8.2} {:>7.2}x",
        "mmap + copy (safetensors way)",
        base_best,
        gbps(base_best),
        1.0
    );
    println!(
        "{:<32} {:>9.3} {:>8.2} {:>7.2}x",
        format!("tensorferry ({engines})"),
        tf_best,
        gbps(tf_best),
        base_best / tf_best
    );
    println!(
        "every tensor checked equal; {} tensors, {} bytes",
        ck.tensors.len(),
        total
    );
    Ok(())
}

/// The demo on cuda:0: the baseline maps each file and copies each tensor with a plain
/// (pageable) host-to-device copy, as `safetensors.load_file(device="cuda")` does.
fn run_gpu(ck: &Checkpoint, json: bool) -> Result<()> {
    let total = ck.total_bytes();
    let ctx = CudaContext::get(0)?;
    let mut base_best = f64::MAX;
    for _ in 0..2 {
        let t = Instant::now();
        let maps: Vec<Mapping> = ck
            .files
            .iter()
            .map(|f| Mapping::new(f))
            .collect::<Result<_>>()?;
        let mut bufs = Vec::with_capacity(ck.tensors.len());
        for t in &ck.tensors {
            let src =
                &maps[t.file].bytes()[t.file_offset as usize..(t.file_offset + t.len()) as usize];
            let mut b = DeviceBuffer::alloc(ctx, src.len())?;
            b.copy_from_host(src)?;
            bufs.push(b);
        }
        base_best = base_best.min(t.elapsed().as_secs_f64());
    }
    let loader = Loader::default();
    let mut tf_best = f64::MAX;
    let mut engines = String::new();
    for round in 0..2 {
        let (tensors, report) = loader.load_checkpoint_cuda(ck, 0)?;
        tf_best = tf_best.min(report.seconds);
        engines = report
            .files
            .iter()
            .map(|f| f.engine.to_string())
            .collect::<Vec<_>>()
            .join(", ");
        if round == 1 {
            let maps: Vec<Mapping> = ck
                .files
                .iter()
                .map(|f| Mapping::new(f))
                .collect::<Result<_>>()?;
            for (t, d) in ck.tensors.iter().zip(&tensors) {
                let want = &maps[t.file].bytes()
                    [t.file_offset as usize..(t.file_offset + t.len()) as usize];
                if d.data.to_host()? != want {
                    bail!("tensor {} differs on the GPU from the file", t.name());
                }
            }
        }
    }
    print_table(
        total,
        "page cache -> cuda:0",
        ("mmap + pageable copy (safetensors way)", base_best),
        (&engines, tf_best),
        json,
    );
    println!(
        "every tensor checked equal; {} tensors, {} bytes",
        ck.tensors.len(),
        total
    );
    Ok(())
}

fn print_table(total: u64, what: &str, base: (&str, f64), tf: (&str, f64), json: bool) {
    let gbps = |s: f64| total as f64 / s / 1e9;
    if json {
        println!(
            "{}",
            serde_json::json!({
                "bytes": total, "what": what,
                "baseline": {"seconds": base.1, "gbps": gbps(base.1)},
                "tensorferry": {"seconds": tf.1, "gbps": gbps(tf.1), "engines": tf.0},
                "speedup": base.1 / tf.1,
            })
        );
        return;
    }
    println!(
        "{:<40} {:>9} {:>8} {:>8}",
        format!("loader ({what})"),
        "seconds",
        "GB/s",
        "ratio"
    );
    println!(
        "{:<40} {:>9.3} {:>8.2} {:>7.2}x",
        base.0,
        base.1,
        gbps(base.1),
        1.0
    );
    println!(
        "{:<40} {:>9.3} {:>8.2} {:>7.2}x",
        format!("tensorferry ({})", tf.0),
        tf.1,
        gbps(tf.1),
        base.1 / tf.1
    );
}

/// The safetensors way: map each file, copy each tensor into a fresh buffer, one thread.
fn baseline_load(ck: &Checkpoint) -> Result<Vec<Vec<u8>>> {
    let mut out = Vec::with_capacity(ck.tensors.len());
    let maps: Vec<Mapping> = ck
        .files
        .iter()
        .map(|f| Mapping::new(f))
        .collect::<Result<_>>()?;
    for t in &ck.tensors {
        let src = &maps[t.file].bytes()[t.file_offset as usize..(t.file_offset + t.len()) as usize];
        out.push(src.to_vec());
    }
    Ok(out)
}

struct Mapping {
    ptr: *mut libc::c_void,
    len: usize,
}

impl Mapping {
    fn new(path: &Path) -> Result<Self> {
        use std::os::unix::io::AsRawFd;
        let f = std::fs::File::open(path).with_context(|| format!("{}: open", path.display()))?;
        let len = f.metadata()?.len() as usize;
        // SAFETY: read-only shared mapping of a file we do not modify; unmapped on drop.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len.max(1),
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            bail!(
                "{}: mmap: {}",
                path.display(),
                std::io::Error::last_os_error()
            );
        }
        Ok(Self { ptr, len })
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping is `len` bytes and lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.cast(), self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unmapped once.
        unsafe { libc::munmap(self.ptr, self.len.max(1)) };
    }
}

/// Qwen-like tensor shapes (bf16) adding up to about `size` bytes, in two shards.
fn sample_tensors(size: u64) -> Vec<(String, Dtype, Vec<u64>)> {
    let (h, kv, inter, vocab) = (1024u64, 256u64, 3072u64, 32_000u64);
    let layer_bytes = 2 * (2 * h * h + 2 * kv * h + 3 * inter * h + 2 * h + 2 * 128);
    let fixed = 2 * (2 * vocab * h + h);
    let layers = size.saturating_sub(fixed) / layer_bytes;
    let mut t = vec![
        (
            "model.embed_tokens.weight".to_string(),
            Dtype::BF16,
            vec![vocab, h],
        ),
        ("lm_head.weight".to_string(), Dtype::BF16, vec![vocab, h]),
        ("model.norm.weight".to_string(), Dtype::BF16, vec![h]),
    ];
    for l in 0..layers.max(1) {
        let p = format!("model.layers.{l}");
        for (n, shape) in [
            ("self_attn.q_proj.weight", vec![h, h]),
            ("self_attn.k_proj.weight", vec![kv, h]),
            ("self_attn.v_proj.weight", vec![kv, h]),
            ("self_attn.o_proj.weight", vec![h, h]),
            ("self_attn.q_norm.weight", vec![128]),
            ("self_attn.k_norm.weight", vec![128]),
            ("mlp.gate_proj.weight", vec![inter, h]),
            ("mlp.up_proj.weight", vec![inter, h]),
            ("mlp.down_proj.weight", vec![h, inter]),
            ("input_layernorm.weight", vec![h]),
            ("post_attention_layernorm.weight", vec![h]),
        ] {
            t.push((format!("{p}.{n}"), Dtype::BF16, shape));
        }
    }
    t
}

/// Writes the sample checkpoint: two shards and an index, each file under a temporary
/// name first, renamed when complete.
pub fn make_sample(dir: &Path, size: u64) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("{}: create", dir.display()))?;
    let tensors = sample_tensors(size);
    let half = tensors.len() / 2;
    let shards = [&tensors[..half], &tensors[half..]];
    let mut weight_map = BTreeMap::new();
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let mut total_size = 0u64;
    for (i, shard) in shards.iter().enumerate() {
        let name = format!("model-{:05}-of-{:05}.safetensors", i + 1, shards.len());
        let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        let (header, infos) = serialize_header(shard, Some(&meta))?;
        let tmp = dir.join(format!(".{name}.tmp"));
        let mut w = std::io::BufWriter::with_capacity(8 << 20, std::fs::File::create(&tmp)?);
        w.write_all(&header)?;
        let mut buf = Vec::new();
        for info in &infos {
            buf.resize(info.len() as usize, 0);
            for chunk in buf.chunks_mut(8) {
                // xorshift64: fast, deterministic filler.
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                chunk.copy_from_slice(&rng.to_le_bytes()[..chunk.len()]);
            }
            w.write_all(&buf)?;
            total_size += info.len();
            weight_map.insert(info.name.clone(), name.clone());
        }
        w.into_inner()
            .map_err(std::io::IntoInnerError::into_error)?
            .sync_all()?;
        std::fs::rename(&tmp, dir.join(&name))?;
    }
    let index =
        serde_json::json!({ "metadata": {"total_size": total_size}, "weight_map": weight_map });
    let tmp = dir.join(".index.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(&index)?)?;
    std::fs::rename(&tmp, dir.join(INDEX_FILE_NAME))?;
    Ok(())
}
