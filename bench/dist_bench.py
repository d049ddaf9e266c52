#!/usr/bin/env python3
"""Distributed loading on one host, one process per GPU (torchrun), NCCL:

    torchrun --nproc_per_node=N bench/dist_bench.py --dir /tmp/tf-bench

For each case (plain: every GPU loads alone; group: ranks share the reading through
process_group; tp: each rank reads only its dim-0 slice of every 2-D weight), cold (page
cache dropped) then hot; and, where its wheel imports, InstantTensor alone on every GPU
(it_plain) and in its distributed mode (it_group: safe_open with the process group):
seconds (max over ranks), GB/s of checkpoint bytes delivered to
every GPU, and per rank bytes read from storage and received over the group. Every
tensor is checked against the checksums side_by_side.py `make` recorded (slices against
slices of the plain load). Rank 0 prints one JSON line per case.
"""
import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist

import tensorferry
import tensorferry.distributed as tfd
import tensorferry.torch as tft


def csum(t):
    return int(t.contiguous().view(torch.int16).to(torch.int64).sum().item())


def drop(d):
    os.sync()
    try:
        open("/proc/sys/vm/drop_caches", "w").write("3\n")
    except OSError:
        pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/tf-bench")
    ap.add_argument("--cases", default="plain,group,tp")
    a = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120), device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    nbytes = sum(os.path.getsize(os.path.join(a.dir, f)) for f in os.listdir(a.dir) if f.endswith(".safetensors"))
    sums = json.load(open(os.path.join(a.dir, "sums.json")))
    for case in a.cases.split(","):
        for mode in ("cold", "hot"):
            if mode == "cold" and rank == 0:
                drop(a.dir)
            elif mode == "hot":
                for f in os.listdir(a.dir):  # same warm cache for every case
                    if f.endswith(".safetensors") and rank == 0:
                        with open(os.path.join(a.dir, f), "rb") as fh:
                            while fh.read(64 << 20):
                                pass
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if case == "plain":
                out = tft.load_file(a.dir, device=dev)
                rep = {"bytes_read": sum(t.numel() * t.element_size() for t in out.values()), "bytes_received": 0}
            elif case == "group":
                out = tft.load_file(a.dir, device=dev, process_group=dist.group.WORLD)
                rep = tfd.last_report()
            elif case == "tp":
                out = tfd.load_file(a.dir, device=dev, process_group=dist.group.WORLD,
                                    shard=lambda name: (0, rank, world) if name.endswith("proj.weight") else None)
                rep = tfd.last_report()
            else:  # it_plain, it_group: InstantTensor, all files in one safe_open as its README says
                from instanttensor import safe_open
                files = sorted(os.path.join(a.dir, f) for f in os.listdir(a.dir) if f.endswith(".safetensors"))
                pg = dist.group.WORLD if case == "it_group" else None
                out = {}
                with safe_open(files, framework="pt", device=local, process_group=pg) as f:
                    for k, t in f.tensors():
                        out[k] = t  # copy=True (the default): tensors own their memory
                rep = {}
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if case == "tp":
                bad = sum(1 for k, v in sums.items() if not k.endswith("proj.weight") and csum(out[k]) != v)
            else:
                bad = sum(1 for k, v in sums.items() if k not in out or csum(out[k]) != v)
            del out
            torch.cuda.empty_cache()
            rows = [None] * world
            dist.all_gather_object(rows, {"rank": rank, "s": round(dt, 3), "bad": bad,
                                          "read": rep.get("bytes_read"), "received": rep.get("bytes_received")})
            if rank == 0:
                slowest = max(r["s"] for r in rows)
                print(json.dumps({"case": case, "mode": mode, "world": world, "s": slowest,
                                  "GBps_per_gpu": round(nbytes / slowest / 1e9, 2), "ranks": rows}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
