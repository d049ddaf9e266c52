#!/usr/bin/env python3
"""Save benchmark on one GPU machine, in one run: ~8.8 GB of Qwen3-4B-shaped bf16 tensors
on cuda:0 written to one safetensors file.

    python3 bench/save_bench.py [--dir D] [--methods a,b,...] [--repeat N] [--md OUT.md] [--json OUT.json]

Measures, in this order:
  - the disk's O_DIRECT write ceiling: `dd if=/dev/zero of=F oflag=direct bs=64M count=...
    conv=fsync` of the same size;
  - `safetensors`: `safetensors.torch.save_file({k: v.cpu() ...})` from the GPU tensors
    (the usual way), then `os.sync()`;
  - `tensorferry`: `tensorferry.torch.save_file` from the GPU tensors (device -> pinned
    staging -> O_DIRECT writes), then `os.sync()`;
  - `tensorferry_buffered`: the same with O_DIRECT off (buffered writes, then fsync).
Each method runs in a fresh process (the tensors are made again there from the same seed,
and the page cache is dropped first where allowed), timed from the call to the end of the
sync, with its peak host RSS growth (VmHWM reset through /proc/self/clear_refs, read from
/proc/self/status). Every saved file is verified: loaded back with safetensors onto the
GPU and compared bit for bit with the tensors, and the files of all methods must be
byte-identical in size and header. Prints one JSON line per measurement, then a markdown
table.
"""
import argparse, json, math, os, subprocess, sys, time

HERE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(HERE))
from side_by_side import shapes  # noqa: E402  (Qwen3-4B shapes, as the load benchmark uses)

DEV = "cuda:0"
METHODS = ("safetensors", "tensorferry", "tensorferry_buffered")


def make_tensors(seed=0):
    import torch
    g = torch.Generator(device=DEV).manual_seed(seed)
    return {k: torch.randn(s, device=DEV, dtype=torch.bfloat16, generator=g) for k, s in shapes()}


def total_bytes():
    return sum(math.prod(s) * 2 for _, s in shapes())


def status_kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def drop_caches():
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def save_safetensors(tensors, path):
    from safetensors.torch import save_file
    save_file({k: v.cpu() for k, v in tensors.items()}, path)


def save_tensorferry(tensors, path, direct="auto"):
    import tensorferry, tensorferry.torch as tft
    saver = tensorferry.Saver(direct=direct)
    tft.save_file(tensors, path, saver=saver)
    return saver.last_report


def one(method, path):
    """Runs in a fresh process: make the tensors, time one save, verify it."""
    import torch
    tensors = make_tensors()
    torch.cuda.synchronize()
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    dropped = drop_caches()
    if os.path.exists(path):
        os.unlink(path)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5\n")  # reset the peak-RSS mark
        hwm_reset = True
    except OSError:
        hwm_reset = False
    rss0 = status_kib("VmRSS")
    t0 = time.perf_counter()
    report = None
    if method == "safetensors":
        save_safetensors(tensors, path)
    elif method == "tensorferry":
        report = save_tensorferry(tensors, path)
    elif method == "tensorferry_buffered":
        report = save_tensorferry(tensors, path, direct="off")
    else:
        raise SystemExit(f"unknown method {method}")
    os.sync()
    dt = time.perf_counter() - t0
    peak = (status_kib("VmHWM") - rss0) * 1024
    size = os.path.getsize(path)
    # Verify: back onto the GPU with the reference loader, bit for bit.
    from safetensors.torch import load_file
    back = load_file(path, device=DEV)
    bad = [k for k, v in tensors.items() if k not in back or not torch.equal(back[k].view(torch.int16), v.view(torch.int16))]
    bad += [k for k in back if k not in tensors]
    row = {"method": method, "s": round(dt, 3), "GBps": round(size / dt / 1e9, 2), "file_bytes": size,
           "tensor_bytes": nbytes, "peak_rss_growth_MiB": round(peak / 2**20), "hwm_reset": hwm_reset,
           "drop_caches": dropped, "verified": not bad, "bad_tensors": bad[:5]}
    if report is not None:
        row["direct"] = report["files"][0]["direct"]
    print(json.dumps(row), flush=True)


def dd_ceiling(d, nbytes):
    f = os.path.join(d, "dd-ceiling.bin")
    count = math.ceil(nbytes / (64 << 20))
    drop_caches()
    t0 = time.perf_counter()
    r = subprocess.run(["dd", "if=/dev/zero", f"of={f}", "oflag=direct", "bs=64M", f"count={count}", "conv=fsync",
                        "status=none"], capture_output=True, text=True)
    dt = time.perf_counter() - t0
    try:
        os.unlink(f)
    except OSError:
        pass
    if r.returncode != 0:
        return {"method": "dd_oflag_direct", "error": r.stderr.strip()[-300:]}
    n = count * (64 << 20)
    return {"method": "dd_oflag_direct", "s": round(dt, 3), "GBps": round(n / dt / 1e9, 2), "file_bytes": n}


def machine(d):
    import platform, torch
    info = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "kernel": platform.release(),
            "cores": os.cpu_count()}
    for mod in ("safetensors", "tensorferry"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            info[mod] = f"not importable: {e}"
    try:
        info["fs"] = " ".join(subprocess.run(["df", "-T", d], capture_output=True, text=True).stdout.splitlines()[-1].split())
    except (OSError, IndexError):
        pass
    return info


def headers_match(paths):
    """Every file has the same size and the same header bytes."""
    heads = set()
    for p in paths:
        with open(p, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            heads.add((os.path.getsize(p), f.read(n)))
    return len(heads) == 1


def run(d, methods, repeat, md, js):
    os.makedirs(d, exist_ok=True)
    info = machine(d)
    print(json.dumps({"machine": info}), flush=True)
    nbytes = total_bytes()
    rows = [dd_ceiling(d, nbytes)]
    print(json.dumps(rows[0]), flush=True)
    paths = {}
    for m in methods:
        paths[m] = os.path.join(d, f"{m}.safetensors")
        for _ in range(repeat):
            try:
                r = subprocess.run([sys.executable, HERE, "one", m, paths[m]], capture_output=True, text=True, timeout=900)
                out = [l for l in r.stdout.splitlines() if l.startswith("{")]
                row = json.loads(out[-1]) if out else {"method": m, "error": (r.stderr or r.stdout)[-600:]}
            except subprocess.TimeoutExpired:
                row = {"method": m, "error": "timeout 900 s"}
            rows.append(row)
            print(json.dumps(row), flush=True)
    done = [p for m, p in paths.items() if os.path.exists(p)]
    same = headers_match(done) if len(done) > 1 else None
    print(json.dumps({"files_identical_size_and_header": same}), flush=True)
    for p in done:
        os.unlink(p)

    best = {}
    for r in rows:
        if "GBps" in r and r.get("verified", True):
            if r["method"] not in best or r["GBps"] > best[r["method"]]["GBps"]:
                best[r["method"]] = r
    lines = [f"Save of {nbytes / 1e9:.2f} GB (Qwen3-4B shapes, bf16) from {DEV} to one safetensors file, "
             f"timed to the end of sync; best of {repeat}.", "",
             "| method | seconds | GB/s | peak RSS growth | verified |", "|---|---|---|---|---|"]
    for m in ("dd_oflag_direct",) + tuple(methods):
        r = best.get(m)
        if r is None:
            err = next((x.get("error", "") for x in rows if x["method"] == m and "error" in x), "not verified")
            lines.append(f"| {m} | - | - | - | {err[:80]} |")
            continue
        rss = f"{r['peak_rss_growth_MiB']} MiB" if "peak_rss_growth_MiB" in r else "-"
        ver = "yes" if r.get("verified") else ("-" if m == "dd_oflag_direct" else "NO")
        extra = f" (O_DIRECT: {r['direct']})" if "direct" in r else ""
        lines.append(f"| {m}{extra} | {r['s']} | {r['GBps']} | {rss} | {ver} |")
    lines += ["", f"files byte-identical in size and header: {same}", f"machine: {json.dumps(info)}"]
    print("\n".join(lines))
    if md:
        with open(md, "w") as f:
            f.write("\n".join(lines) + "\n")
    if js:
        with open(js, "w") as f:
            json.dump({"machine": info, "rows": rows, "identical": same}, f, indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", nargs="?", default="run", choices=["run", "one"])
    ap.add_argument("rest", nargs="*")
    ap.add_argument("--dir", default="/tmp/tf-save-bench")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--md")
    ap.add_argument("--json")
    a = ap.parse_intermixed_args()
    if a.cmd == "one":
        one(*a.rest)
    else:
        run(a.dir, [m for m in a.methods.split(",") if m], max(1, a.repeat), a.md, a.json)
