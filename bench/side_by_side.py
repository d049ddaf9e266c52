#!/usr/bin/env python3
"""Side-by-side checkpoint loading benchmark on one GPU machine, in one run.

The project's copy of ../shared/bench/side_by_side.py (same method, same checkpoint),
extended: tensorferry loads the checkpoint in one submission (its directory), each load
also reports peak host RSS growth and GPU memory left over, the machine is printed
first, and `plot` draws the table as a PNG.

    python3 side_by_side.py make [--dir D] [--layers N] # Qwen3-4B-shaped bf16 checkpoint, 2 shards
    python3 side_by_side.py run  [--dir D] [--loaders a,b,...] [--md OUT.md] [--json OUT.json]

`run` measures the machine's ceilings (pinned host->device copy, O_DIRECT disk read,
16-thread page-cache read) and then loads the checkpoint to cuda:0 with every loader
that imports, cold (page cache dropped) and hot (best of two), checking each tensor
against checksums taken when the checkpoint was made. Each load runs in a fresh
process. Loaders whose package is missing are reported as such, not skipped silently.
"""
import argparse, json, os, subprocess, sys, threading, time

DEV = "cuda:0"
HERE = os.path.abspath(__file__)


def shapes(layers=36):
    h, inter, q, kv, vocab = 2560, 9728, 4096, 1024, 151936
    out = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (q, h)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, q)), (p + "self_attn.q_norm.weight", (128,)),
                (p + "self_attn.k_norm.weight", (128,)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


def csum(t):
    import torch
    return int(t.contiguous().view(torch.int16).to(torch.int64).sum().item())


def files(d):
    idx = json.load(open(f"{d}/model.safetensors.index.json"))
    return sorted({f"{d}/{v}" for v in idx["weight_map"].values()})


def make(d, layers=36):
    """Qwen3-4B's shapes (36 layers: 8.82 GB in 2 shards); more layers make a larger
    checkpoint in shards of about the same 4.4 GB (168 layers: 35.5 GB, 4.0x, 9 shards)."""
    import torch
    from safetensors.torch import save_file
    os.makedirs(d, exist_ok=True)
    sh = shapes(layers)
    nshards = max(2, round(len(sh) / (len(shapes()) / 2)))
    cuts = [i * len(sh) // nshards for i in range(nshards + 1)]
    sums, wmap, total, tsave = {}, {}, 0, 0.0
    for n, part in enumerate((sh[cuts[i]:cuts[i + 1]] for i in range(nshards)), 1):
        name = f"model-{n:05d}-of-{nshards:05d}.safetensors"
        ts = {}
        for k, s in part:
            t = torch.randn(s, device=DEV, dtype=torch.bfloat16)
            sums[k] = csum(t); ts[k] = t.cpu(); wmap[k] = name; total += t.numel() * 2
        t0 = time.perf_counter(); save_file(ts, f"{d}/{name}"); os.sync(); tsave += time.perf_counter() - t0
    json.dump({"metadata": {"total_size": total}, "weight_map": wmap}, open(f"{d}/model.safetensors.index.json", "w"))
    json.dump(sums, open(f"{d}/sums.json", "w"))
    print(json.dumps({"made_bytes": total, "safetensors_save_file_GBps": round(total / tsave / 1e9, 2)}))


def drop(d):
    try:
        os.sync(); open("/proc/sys/vm/drop_caches", "w").write("3\n"); ok = True
    except OSError:
        ok = False
    for f in files(d):
        fd = os.open(f, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
    return ok


def warm(d):
    """Reads the files through the page cache, so a hot load starts with them cached
    whatever the loader before it did (a loader using O_DIRECT leaves the cache cold)."""
    for f in files(d):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(_WARM_BUF):
                pass
    return "warmed"


_WARM_BUF = bytearray(64 << 20)


# ---- loaders: each takes the file list, returns (dict name->cuda tensor, keepalive) ----
def l_safetensors(fs):
    from safetensors.torch import load_file
    out = {}
    for f in fs:
        out.update(load_file(f, device=DEV))
    return out, None


def l_safetensors_cpu_to_cuda(fs):
    from safetensors.torch import load_file
    out = {}
    for f in fs:
        out.update({k: v.to(DEV) for k, v in load_file(f).items()})
    return out, None


def l_fastsafetensors(fs):
    from fastsafetensors import fastsafe_open
    f = fastsafe_open(filenames=fs, framework="pt", device=DEV, nogds=True)
    f.__enter__()
    return {k: f.get_tensor(k) for k in f.keys()}, f


def l_runai_model_streamer(fs):
    from runai_model_streamer import SafetensorsStreamer
    out = {}
    with SafetensorsStreamer() as s:
        s.stream_files(fs)
        for k, t in s.get_tensors():
            out[k] = t.to(DEV)
    return out, None


def l_instanttensor(fs):
    from instanttensor import safe_open
    out = {}
    with safe_open(fs, framework="pt", device=0) as f:
        for k, t in f.tensors():
            out[k] = t
    return out, None


def l_tensorferry(fs):
    import tensorferry.torch as tft
    return tft.load_file(os.path.dirname(fs[0]), device=DEV), None


def l_tensorferry_per_file(fs):
    import tensorferry.torch as tft
    out = {}
    for f in fs:
        out.update(tft.load_file(f, device=DEV))
    return out, None


LOADERS = {k[2:]: v for k, v in list(globals().items()) if k.startswith("l_")}


def rss_kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def one(d, name, mode):
    import torch
    torch.empty(1, device=DEV); torch.cuda.synchronize()
    fs = files(d); nbytes = sum(os.path.getsize(f) for f in fs)
    dropped = drop(d) if mode == "cold" else warm(d)
    free0 = torch.cuda.mem_get_info()[0]
    try:
        open("/proc/self/clear_refs", "w").write("5\n")  # reset the peak-RSS mark
    except OSError:
        pass
    rss0 = rss_kib("VmRSS")
    if os.environ.get("TENSORFERRY_LOG") == "debug":  # marks to line up with the debug log's stamps
        print(f"[bench {time.monotonic():.6f}] load starts", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    res, keep = LOADERS[name](fs)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    if os.environ.get("TENSORFERRY_LOG") == "debug":
        print(f"[bench {time.monotonic():.6f}] load done", file=sys.stderr, flush=True)
    peak_growth = (rss_kib("VmHWM") - rss0) * 1024
    tensor_bytes = sum(t.numel() * t.element_size() for t in res.values())
    extra_gpu = (free0 - torch.cuda.mem_get_info()[0]) - tensor_bytes
    sums = json.load(open(f"{d}/sums.json"))
    bad = sum(1 for k, v in sums.items() if k not in res or csum(res[k]) != v)
    print(json.dumps({"loader": name, "mode": mode, "s": round(dt, 3), "GBps": round(nbytes / dt / 1e9, 2),
                      "bad_tensors": bad, "drop_caches": dropped, "peak_rss_growth_MiB": round(peak_growth / 2**20),
                      "gpu_beyond_tensors_MiB": round(extra_gpu / 2**20)}), flush=True)


def ceilings(d):
    import torch
    f = files(d)[0]; n = os.path.getsize(f) & ~4095
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device=DEV)
    dev.copy_(pinned, non_blocking=True); torch.cuda.synchronize()
    t0 = time.perf_counter(); dev.copy_(pinned, non_blocking=True); torch.cuda.synchronize()
    h2d = n / (time.perf_counter() - t0) / 1e9
    mv = memoryview(pinned.numpy())

    def par(threads, direct, chunk):
        fd = os.open(f, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        offs = iter(range(0, n, chunk)); lock = threading.Lock()

        def work():
            while True:
                with lock:
                    o = next(offs, None)
                if o is None:
                    return
                os.preadv(fd, [mv[o:min(o + chunk, n)]], o)
        t0 = time.perf_counter()
        ts = [threading.Thread(target=work) for _ in range(threads)]
        [t.start() for t in ts]; [t.join() for t in ts]
        os.close(fd)
        return n / (time.perf_counter() - t0) / 1e9
    # the best of a few shapes, each from a cold cache: the disk's ceiling as this machine shows it
    disk = 0.0
    for threads, direct, chunk in ((1, True, 64 << 20), (8, True, 8 << 20), (16, True, 32 << 20), (8, False, 8 << 20)):
        drop(d); disk = max(disk, par(threads, direct, chunk))
    par(8, False, 8 << 20)
    hot = max(par(threads, False, chunk) for threads, chunk in ((16, 8 << 20), (16, 32 << 20), (32, 4 << 20)))
    return {"h2d_pinned_GBps": round(h2d, 1), "disk_read_GBps": round(disk, 2), "pagecache_read_GBps": round(hot, 1)}


def machine():
    import platform, torch
    info = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "kernel": platform.release(),
            "cores": os.cpu_count(), "gds": "nvidia-fs loaded" if os.path.exists("/proc/driver/nvidia-fs") else "no nvidia-fs"}
    try:
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    try:
        info["fs"] = subprocess.run(["df", "-T", d_global], capture_output=True, text=True).stdout.splitlines()[-1]
    except (OSError, IndexError):
        pass
    return info


def run(d, loaders, md, js):
    import importlib
    global d_global
    d_global = d
    print(json.dumps({"machine": machine()}), flush=True)
    rows, ceil = [], ceilings(d)
    print(json.dumps(ceil), flush=True)
    for name in loaders:
        mod = {"safetensors": "safetensors", "safetensors_cpu_to_cuda": "safetensors", "fastsafetensors": "fastsafetensors",
               "runai_model_streamer": "runai_model_streamer", "instanttensor": "instanttensor", "tensorferry": "tensorferry",
               "tensorferry_per_file": "tensorferry"}[name]
        try:
            importlib.import_module(mod)
        except Exception as e:
            rows.append({"loader": name, "error": f"not importable: {e}"}); print(json.dumps(rows[-1])); continue
        for mode in ("cold", "hot", "hot"):
            try:
                r = subprocess.run([sys.executable, HERE, "one", name, mode, "--dir", d], capture_output=True, text=True, timeout=300)
                out = [l for l in r.stdout.splitlines() if l.startswith("{")]
                row = json.loads(out[-1]) if out else {"loader": name, "mode": mode, "error": (r.stderr or r.stdout)[-400:]}
            except subprocess.TimeoutExpired:
                row = {"loader": name, "mode": mode, "error": "timeout 300 s"}
            rows.append(row); print(json.dumps(row), flush=True)
    best = {}
    for r in rows:
        if "GBps" in r and r.get("bad_tensors") == 0:
            k = (r["loader"], r["mode"]); best[k] = max(best.get(k, 0), r["GBps"])
    lines = ["| loader | cold GB/s | hot GB/s |", "|---|---|---|"]
    for name in loaders:
        c, h = best.get((name, "cold")), best.get((name, "hot"))
        err = next((r.get("error") for r in rows if r["loader"] == name and "error" in r), None)
        lines.append(f"| {name} | {c if c else '-'} | {h if h else '-'} |" + (f" {err[:80]}" if err and not c and not h else ""))
    lines.append(f"\nceilings: {json.dumps(ceil)}")
    lines.append(f"machine: {json.dumps(machine())}")
    print("\n".join(lines))
    if md:
        open(md, "w").write("\n".join(lines) + "\n")
    if js:
        json.dump({"machine": machine(), "ceilings": ceil, "rows": rows}, open(js, "w"), indent=1)


def plot(js, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    data = json.load(open(js))
    best = {}
    for r in data["rows"]:
        if "GBps" in r and r.get("bad_tensors") == 0:
            k = (r["loader"], r["mode"]); best[k] = max(best.get(k, 0), r["GBps"])
    names = sorted({k[0] for k in best}, key=lambda n: best.get((n, "hot"), 0))
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.5 * len(names) + 2))
    c = data["ceilings"]
    for ax, mode, ceiling, label in ((axes[0], "cold", c["disk_read_GBps"], "disk ceiling"),
                                     (axes[1], "hot", c["h2d_pinned_GBps"], "pinned H2D ceiling")):
        vals = [best.get((n, mode), 0) for n in names]
        ax.barh(names, vals, color=["tab:orange" if n.startswith("tensorferry") else "tab:blue" for n in names])
        ax.axvline(ceiling, color="k", ls="--", label=f"{label} {ceiling} GB/s")
        for i, v in enumerate(vals):
            ax.text(v, i, f" {v:.2f}", va="center")
        ax.set_title(f"{mode} load to {DEV} (GB/s)"); ax.legend(loc="lower right")
    fig.suptitle(f"{data['machine'].get('gpu', '')}: 8.8 GB Qwen3-4B-shaped bf16 checkpoint")
    fig.tight_layout(); fig.savefig(png, dpi=110)


d_global = "/tmp/tf-bench"


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["make", "run", "one", "plot"])
    ap.add_argument("rest", nargs="*")
    ap.add_argument("--dir", default="/tmp/tf-bench")
    ap.add_argument("--layers", type=int, default=36, help="make: decoder layers (36: Qwen3-4B, 8.82 GB)")
    ap.add_argument("--loaders", default=",".join(LOADERS))
    ap.add_argument("--md"); ap.add_argument("--json"); ap.add_argument("--png")
    a = ap.parse_intermixed_args()
    if a.cmd == "make":
        make(a.dir, a.layers)
    elif a.cmd == "plot":
        plot(a.json, a.png)
    elif a.cmd == "one":
        one(a.dir, *a.rest)
    else:
        run(a.dir, a.loaders.split(","), a.md, a.json)
