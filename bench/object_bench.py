#!/usr/bin/env python3
"""Object-store loads on loopback, one run: a real S3 server (s3s-fs, signed requests)
serving a ~1 GiB checkpoint written by safetensors, loaded with tensorferry from s3://
and, for reference, from the local file and by a plain single-stream GET of the whole
object (what `aws s3 cp` of one object then a local load would start from). Every load is
checked against the reference. Needs s3s-fs (see .ci/run).

On the 2-core development machine this measures the server, not the client: s3s-fs
serves about 50 MB/s while using both cores (180% CPU in `top`), tensorferry's side idle.
A real object store or a faster S3-compatible server is needed for network-speed figures.

    python3 bench/object_bench.py [--size 1G] [--device cpu|cuda]
"""
import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import torch
from safetensors.torch import save_file as st_save

KEY, SECRET = "bench-key", "bench-secret-0123456789"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1G")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    size = int(float(a.size[:-1]) * (1 << 30)) if a.size.endswith("G") else int(a.size)
    exe = os.environ.get("S3S_FS") or shutil.which("s3s-fs") or os.path.expanduser("~/.cargo/bin/s3s-fs")
    if not os.path.isfile(exe):
        sys.exit("s3s-fs not found (cargo install s3s-fs --version 0.14.1 --features binary --locked)")
    root = tempfile.mkdtemp(prefix="tf-object-bench-")
    os.makedirs(f"{root}/bucket")
    n = size // (4096 * 1024 * 2)
    ref = {f"w{i}": torch.randn(4096, 1024, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
           for i in range(n)}
    path = f"{root}/bucket/model.safetensors"
    st_save(ref, path)
    nbytes = os.path.getsize(path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--host", "127.0.0.1", "--port", str(port), "--access-key", KEY,
                             "--secret-key", SECRET, root], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        os.environ.update({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": KEY,
                           "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"})
        import tensorferry.torch as tft
        rows = {}

        def timed(name, fn):
            best = None
            for _ in range(2):
                t0 = time.perf_counter()
                out = fn()
                if a.device != "cpu":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                best = dt if best is None else min(best, dt)
            if isinstance(out, dict):
                assert all(torch.equal(out[k].cpu().view(torch.int16), ref[k].view(torch.int16)) for k in ref), name
            rows[name] = {"s": round(best, 3), "GBps": round(nbytes / best / 1e9, 2)}
            print(json.dumps({name: rows[name]}), flush=True)

        timed("local file, tensorferry", lambda: tft.load_file(path, device=a.device))
        timed("s3:// (s3s-fs on loopback), tensorferry", lambda: tft.load_file("s3://bucket/model.safetensors",
                                                                                 device=a.device))
        # The same load with one request in flight: what a single-stream download gets.
        timed("s3://, one request at a time (TENSORFERRY_OBJECT_CONCURRENCY=1)", lambda: _one_stream(tft, a.device))
        print(f"\n| load of {nbytes / 1e9:.2f} GB to {a.device} | seconds | GB/s |\n|---|---|---|")
        for k, v in rows.items():
            print(f"| {k} | {v['s']} | {v['GBps']} |")
    finally:
        proc.kill()
        shutil.rmtree(root, ignore_errors=True)


def _one_stream(tft, device):
    import tensorferry
    os.environ["TENSORFERRY_OBJECT_CONCURRENCY"] = "1"  # read when a Loader is made
    try:
        loader = tensorferry.Loader()
    finally:
        del os.environ["TENSORFERRY_OBJECT_CONCURRENCY"]
    return tft.load_file("s3://bucket/model.safetensors", device=device, loader=loader)


if __name__ == "__main__":
    main()
