#!/usr/bin/env python3
"""Host-memory benchmark (any machine, no GPU needed), all figures from one run:

- warm (page cache) loads of a ~2 GiB two-shard float16 checkpoint into host memory:
  tensorferry.numpy.load_file against safetensors.numpy.load_file, alternating, best of 3;
- cold loads: `dd iflag=direct bs=64M` over the same files (the disk's ceiling) against a
  tensorferry load after the page cache is dropped.

    python3 bench/host_bench.py [--size 2G] [--dir /tmp/tf-host-bench] [--json OUT]
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1].upper(), 1)
    return int(float(s[:-1] if s[-1].upper() in "KMG" else s) * mult)


def make(d, size):
    from safetensors.numpy import save_file
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(index):
        return
    os.makedirs(d, exist_ok=True)
    rows, h = 4096, 2048  # 16 MiB matrices plus small norms
    n = max(2, size // (rows * h * 2))
    base = (np.arange(rows * h, dtype=np.uint64) * 2654435761 % 65521).astype(np.uint16).view(np.float16)
    wmap, total = {}, 0
    for shard in (1, 2):
        name = f"model-0000{shard}-of-00002.safetensors"
        tensors = {}
        for i in range((shard - 1) * n // 2, shard * n // 2):
            tensors[f"layers.{i}.weight"] = np.roll(base, i).reshape(rows, h)
            tensors[f"layers.{i}.norm"] = np.full(h, i, np.float16)
        save_file(tensors, os.path.join(d, name))
        for k, v in tensors.items():
            wmap[k] = name
            total += v.nbytes
    json.dump({"metadata": {"total_size": total}, "weight_map": wmap}, open(index, "w"))
    os.sync()


def shards(d):
    idx = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    return sorted({os.path.join(d, v) for v in idx["weight_map"].values()})


def drop(d):
    os.sync()
    try:
        open("/proc/sys/vm/drop_caches", "w").write("3\n")
    except OSError:
        pass
    for f in shards(d):
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def machine(d):
    import tensorferry
    info = {"kernel": platform.release(), "cores": os.cpu_count(), "python": sys.version.split()[0],
            "numpy": np.__version__, "tensorferry": tensorferry.__version__, "doctor": tensorferry.doctor()}
    try:
        import safetensors
        info["safetensors"] = safetensors.__version__
    except ImportError:
        pass
    try:
        info["fs"] = subprocess.run(["df", "-T", d], capture_output=True, text=True).stdout.splitlines()[-1]
    except (OSError, IndexError):
        pass
    return info


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="2G")
    ap.add_argument("--dir", default="/tmp/tf-host-bench")
    ap.add_argument("--json")
    a = ap.parse_args()
    make(a.dir, parse_size(a.size))
    import safetensors.numpy as sn
    import tensorferry
    import tensorferry.numpy as tfn

    fs = shards(a.dir)
    nbytes = sum(os.path.getsize(f) for f in fs)
    out = {"machine": machine(a.dir), "bytes": nbytes}
    print(json.dumps(out["machine"]), flush=True)

    # Warm: make sure the files are cached, then alternate the two loaders.
    for f in fs:
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass
    best = {"safetensors.numpy": 1e9, "tensorferry.numpy": 1e9}
    for _ in range(3):
        t0 = time.perf_counter()
        ref = {}
        for f in fs:
            ref.update(sn.load_file(f))
        best["safetensors.numpy"] = min(best["safetensors.numpy"], time.perf_counter() - t0)
        del ref
        t0 = time.perf_counter()
        got = tfn.load_file(a.dir)
        best["tensorferry.numpy"] = min(best["tensorferry.numpy"], time.perf_counter() - t0)
        del got
    # Check once, outside the timing.
    got, ref = tfn.load_file(a.dir), {}
    for f in fs:
        ref.update(sn.load_file(f))
    assert list(got) == sorted(got, key=list(got).index) and set(got) == set(ref)
    assert all(np.array_equal(got[k].view(np.uint16), ref[k].view(np.uint16)) for k in ref)
    del got, ref
    warm = {k: {"s": round(v, 4), "GBps": round(nbytes / v / 1e9, 2)} for k, v in best.items()}
    warm["speedup"] = round(best["safetensors.numpy"] / best["tensorferry.numpy"], 2)
    out["warm"] = warm
    print(json.dumps({"warm": warm}), flush=True)

    # Cold: dd with O_DIRECT over the same files, then tensorferry (auto engine).
    drop(a.dir)
    t0 = time.perf_counter()
    for f in fs:
        subprocess.run(["dd", f"if={f}", "of=/dev/null", "iflag=direct", "bs=64M"], check=True, capture_output=True)
    dd = time.perf_counter() - t0
    cold = {"dd_iflag_direct": {"s": round(dd, 3), "GBps": round(nbytes / dd / 1e9, 3)}}
    for engine in ("auto", "uring", "direct"):
        drop(a.dir)
        loader = tensorferry.Loader(engine=engine)
        t0 = time.perf_counter()
        got = tfn.load_file(a.dir, loader=loader)
        dt = time.perf_counter() - t0
        del got
        cold[f"tensorferry {engine}"] = {"s": round(dt, 3), "GBps": round(nbytes / dt / 1e9, 3),
                                         "engines": sorted({f["engine"] for f in loader.last_report["files"]}),
                                         "of_dd": round(dd / dt, 3)}
    out["cold"] = cold
    print(json.dumps({"cold": cold}), flush=True)
    print(f"\n| load ({nbytes / 1e9:.2f} GB, host memory) | seconds | GB/s | ratio |\n|---|---|---|---|")
    print(f"| warm: safetensors.numpy.load_file | {warm['safetensors.numpy']['s']} | {warm['safetensors.numpy']['GBps']} | 1.00x |")
    print(f"| warm: tensorferry.numpy.load_file | {warm['tensorferry.numpy']['s']} | {warm['tensorferry.numpy']['GBps']} | {warm['speedup']}x |")
    print(f"| cold: dd iflag=direct bs=64M (ceiling) | {cold['dd_iflag_direct']['s']} | {cold['dd_iflag_direct']['GBps']} | 1.00x |")
    for k, v in cold.items():
        if k.startswith("tensorferry"):
            print(f"| cold: {k} ({', '.join(v['engines'])}) | {v['s']} | {v['GBps']} | {v['of_dd']}x of dd |")
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
