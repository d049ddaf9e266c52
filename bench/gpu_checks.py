#!/usr/bin/env python3
"""GPU checks for the H200 machine, one JSON line each: bit-exact loads of every dtype
through every engine (with tiny staging slots so tensors straddle slot and alignment
edges), error paths, stream semantics, and the small-load latency target.

    python3 bench/gpu_checks.py --dir /tmp/tf-checks
"""
import argparse
import json
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX must not take the GPU
import sys
import time

import torch
from safetensors.torch import load_file as st_load, save_file as st_save

import tensorferry
import tensorferry.torch as tft

DEV = "cuda:0"


def emit(**kw):
    print(json.dumps(kw), flush=True)


def same(a, b):
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.reshape(-1).view(torch.uint8).cpu(), b.reshape(-1).view(torch.uint8).cpu())


def make_all_dtypes(path):
    g = torch.Generator().manual_seed(0)
    t = {}
    for name in ("bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                 "float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"):
        dt = getattr(torch, name, None)
        if dt is None:
            continue
        for shape in ((), (0,), (1,), (7,), (3, 5), (1023, 17), (4099,)):
            n = 1
            for d in shape:
                n *= d
            size = torch.empty((), dtype=dt).element_size()
            raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
            x = raw.view(dt).reshape(shape)
            if dt == torch.bool:
                x = x.view(torch.uint8) % 2 == 1
            t[f"{name}.{'x'.join(map(str, shape)) or 'scalar'}"] = x.clone()
    t["big"] = torch.randn(3_000_000, generator=g)  # 12 MB: crosses many slots
    st_save(t, path, metadata={"format": "pt"})
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/tf-checks")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    emit(doctor=tensorferry.doctor(), torch=torch.__version__)

    path = os.path.join(a.dir, "all.safetensors")
    make_all_dtypes(path)
    ref = st_load(path)
    engines = ("auto", "pread", "direct", "uring", "gds")
    for engine in engines:
        for staging in (8192, None):
            loader = tensorferry.Loader(engine=engine, staging_size=staging, slots=3 if staging else None)
            try:
                tensorferry.drop_cache(path)
                got = tft.load_file(path, device=DEV, loader=loader)
                bad = [k for k in ref if not same(ref[k], got[k]) or got[k].device != torch.device(DEV)]
                emit(check="dtypes", engine=engine, staging=staging, tensors=len(ref), bad=bad[:5],
                     engines_used=sorted({f["engine"] for f in loader.last_report["files"]}))
            except Exception as e:  # noqa: BLE001 - reported
                emit(check="dtypes", engine=engine, staging=staging, error=repr(e))

    # safe_open on the GPU, slices
    with tensorferry.safe_open(path, framework="pt", device=DEV) as f:
        ok = same(f.get_tensor("float32.1023x17"), ref["float32.1023x17"])
        sl = f.get_slice("float32.1023x17")[100:200, 3:9]
        ok_slice = same(sl, ref["float32.1023x17"][100:200, 3:9].contiguous())
        emit(check="safe_open_cuda", ok=ok, slice_ok=ok_slice, device=str(sl.device))

    # Other frameworks through DLPack (CuPy, JAX).
    for fw in ("cupy", "jax"):
        try:
            with tensorferry.safe_open(path, framework=fw, device=DEV) as f:
                x = f.get_tensor("float32.1023x17")
            import numpy as np
            host = np.asarray(x.get()) if fw == "cupy" else np.asarray(x)
            want = ref["float32.1023x17"].numpy()
            # Compare bytes: the random bits include NaNs, which never compare equal.
            emit(check=f"dlpack_{fw}", ok=bool(np.array_equal(host.view(np.uint8), want.view(np.uint8))),
                 type=type(x).__name__)
        except Exception as e:  # noqa: BLE001 - reported
            emit(check=f"dlpack_{fw}", error=repr(e)[:300])

    # A destination the driver refuses (a bogus device address): a clear error, then
    # loads still work.
    try:
        tensorferry.default_loader().read_into([path], [(0, 8, 64, 0, 0)], [("cuda", 0, 1 << 40, 64)])
        bogus = "no error"
    except Exception as e:  # noqa: BLE001 - reported
        bogus = f"{type(e).__name__}: {e}"[:200]
    emit(check="bogus_destination", error=bogus, load_after_ok=same(tft.load_file(path, device=DEV)["big"], ref["big"]))

    # Raw files and handles on CUDA
    raw = os.path.join(a.dir, "raw.bin")
    data = torch.randn(1 << 20)
    data.numpy().tofile(raw)
    t = tft.load_tensor(raw, 1 << 19, dtype=torch.float32, device=DEV, offset=4 * 1000)
    h = tensorferry.Handle()
    dst = torch.empty(1 << 20, device=DEV)
    fut = h.async_pread(dst, raw)
    fut.wait()
    out_path = os.path.join(a.dir, "raw_out.bin")
    h.pwrite(dst, out_path)
    back = torch.from_file(out_path, size=1 << 20, dtype=torch.float32)
    emit(check="raw_cuda", load_tensor=bool(torch.equal(t.cpu(), data[1000:1000 + (1 << 19)])),
         handle_pread=bool(torch.equal(dst.cpu(), data)), handle_pwrite=bool(torch.equal(back, data)))

    # Stream semantics: load while the current stream is a side stream busy with work.
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        big = torch.empty(1 << 28, device=DEV)
        big.fill_(1.0)  # queued work on the caller's stream
        got = tft.load_file(path, device=DEV)
        ok = same(got["big"], ref["big"])
    torch.cuda.synchronize()
    emit(check="stream_semantics", ok=ok)

    # Errors: truncated file, missing file, bad device index, after which loads still work.
    trunc = os.path.join(a.dir, "trunc.safetensors")
    with open(path, "rb") as f_in, open(trunc, "wb") as f_out:
        f_out.write(f_in.read()[:-100])
    errs = {}
    for label, fn in (("truncated", lambda: tft.load_file(trunc, device=DEV)),
                      ("missing", lambda: tft.load_file(os.path.join(a.dir, "nope.safetensors"), device=DEV)),
                      ("bad_device", lambda: tft.load_file(path, device="cuda:99"))):
        try:
            fn()
            errs[label] = "no error"
        except Exception as e:  # noqa: BLE001 - reported
            errs[label] = f"{type(e).__name__}: {e}"[:200]
    again = same(tft.load_file(path, device=DEV)["big"], ref["big"])
    emit(check="errors", errors=errs, load_after_errors_ok=again)

    # GPU memory: after freeing the tensors it is back where it was.
    torch.cuda.synchronize(); torch.cuda.empty_cache()
    free0 = torch.cuda.mem_get_info()[0]
    got = tft.load_file(path, device=DEV)
    del got
    torch.cuda.synchronize(); torch.cuda.empty_cache()
    emit(check="gpu_memory_returned", leaked_MiB=round((free0 - torch.cuda.mem_get_info()[0]) / 2**20, 1))

    # Small loads: 1000 loads of a 4 MiB file from page cache (target: < 1 ms each after the first).
    small = os.path.join(a.dir, "small.safetensors")
    st_save({"w": torch.randn(1 << 20)}, small)
    tft.load_file(small, device=DEV)
    t0 = time.perf_counter()
    for _ in range(1000):
        tft.load_file(small, device=DEV)
    torch.cuda.synchronize()
    emit(check="small_loads", n=1000, bytes=4 << 20, avg_ms=round((time.perf_counter() - t0), 3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
