#!/usr/bin/env python3
"""What pinning a staging pool costs, and what overlaps with it (GPU machine, one run).

Times `cuMemHostRegister` of an anonymous mapping (transparent huge pages advised) of
the loader's pool size, whole and slot by slot, with and without touching the pages
first; `cuMemHostAlloc` for comparison; and a registration in a second thread while
the first allocates a Qwen3-4B-shaped set of tensors with torch (do they contend?).

    python3 bench/pin_probe.py [--pool-mib 128] [--slot-mib 8]
"""
import argparse
import ctypes
import json
import mmap
import threading
import time

import torch

cu = ctypes.CDLL("libcuda.so.1")
PORTABLE = 1
MADV_HUGEPAGE = 14
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what}: CUresult {rc}")


def mapping(n):
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    libc.madvise(addr, n, MADV_HUGEPAGE)
    return m, addr


def touch(m, n):
    for off in range(0, n, 4096):
        m[off] = 1


def register(addr, n):
    t = time.perf_counter()
    check(cu.cuMemHostRegister_v2(ctypes.c_void_p(addr), ctypes.c_size_t(n), PORTABLE), "register")
    return time.perf_counter() - t


def unregister(addr):
    check(cu.cuMemHostUnregister(ctypes.c_void_p(addr)), "unregister")


def tensors_qwen3_4b():
    """Shapes of a Qwen3-4B-like checkpoint (36 layers, hidden 2560), bf16."""
    h, inter, kv, vocab = 2560, 9728, 1024, 151936
    shapes = [(vocab, h)]
    for _ in range(36):
        shapes += [(4096, h), (kv, h), (kv, h), (h, 4096), (inter, h), (inter, h), (h, inter),
                   (h,), (h,), (128,), (128,)]
    return shapes + [(h,)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pool-mib", type=int, default=128)
    ap.add_argument("--slot-mib", type=int, default=8)
    a = ap.parse_args()
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    ctx = ctypes.c_void_p()
    check(cu.cuCtxGetCurrent(ctypes.byref(ctx)), "ctx")
    n, slot = a.pool_mib << 20, a.slot_mib << 20
    out = {"pool_mib": a.pool_mib, "slot_mib": a.slot_mib}

    for rep in range(2):
        m, addr = mapping(n)
        out[f"register_whole_ms_{rep}"] = round(register(addr, n) * 1e3, 2)
        unregister(addr)
        m.close()

    m, addr = mapping(n)
    t = time.perf_counter()
    touch(m, n)
    out["touch_ms"] = round((time.perf_counter() - t) * 1e3, 2)
    out["register_touched_ms"] = round(register(addr, n) * 1e3, 2)
    unregister(addr)
    m.close()

    m, addr = mapping(n)
    per = [register(addr + o, slot) for o in range(0, n, slot)]
    out["register_per_slot_ms"] = [round(x * 1e3, 2) for x in per]
    out["register_per_slot_total_ms"] = round(sum(per) * 1e3, 2)
    for o in range(0, n, slot):
        unregister(addr + o)
    m.close()

    m, addr = mapping(n // 2)
    out["register_half_ms"] = round(register(addr, n // 2) * 1e3, 2)
    unregister(addr)
    m.close()

    p = ctypes.c_void_p()
    t = time.perf_counter()
    check(cu.cuMemHostAlloc(ctypes.byref(p), ctypes.c_size_t(n), PORTABLE), "hostalloc")
    out["hostalloc_ms"] = round((time.perf_counter() - t) * 1e3, 2)
    cu.cuMemFreeHost(p)

    shapes = tensors_qwen3_4b()
    t = time.perf_counter()
    ts = [torch.empty(s, dtype=torch.bfloat16, device="cuda") for s in shapes]
    out["torch_alloc_ms_alone"] = round((time.perf_counter() - t) * 1e3, 2)
    out["torch_alloc_gb"] = round(sum(x.nbytes for x in ts) / 1e9, 2)
    del ts
    torch.cuda.empty_cache()

    m, addr = mapping(n)
    took = {}

    def bg():
        check(cu.cuCtxSetCurrent(ctx), "set ctx")
        took["register"] = register(addr, n)

    t = time.perf_counter()
    th = threading.Thread(target=bg)
    th.start()
    ts = [torch.empty(s, dtype=torch.bfloat16, device="cuda") for s in shapes]
    out["torch_alloc_ms_beside_register"] = round((time.perf_counter() - t) * 1e3, 2)
    th.join()
    out["register_beside_alloc_ms"] = round(took["register"] * 1e3, 2)
    out["both_ms"] = round((time.perf_counter() - t) * 1e3, 2)
    unregister(addr)
    m.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
