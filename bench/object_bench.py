#!/usr/bin/env python3
"""Object-store loads on loopback, one run, against one real S3 server (s3s-fs, signed
requests) serving a multi-GB checkpoint written by safetensors:

- ceiling: what the server delivers to many parallel ranged GETs discarded on arrival
  (curl --aws-sigv4, one process per stream, the loader's chunk size and concurrency);
- tensorferry: ``load_file("s3://...")`` to the device;
- boto3 + safetensors: ``download_file`` (boto3's default multi-threaded transfer) to a
  local file, then ``safetensors.torch.load_file`` to the device: what people do today;
- for reference, tensorferry from the local file (and with ``--one-stream`` from s3://
  with one request at a time).

Every load is checked against the reference tensors. Needs s3s-fs (see .ci/run), curl
and boto3 (which also uploads the checkpoint). Each row is the best of ``--repeat`` runs.

    python3 bench/object_bench.py [--size 4G] [--device cpu|cuda] [--repeat 2] [--json OUT] [--one-stream]
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
from safetensors.torch import load_file as st_load, save_file as st_save

KEY, SECRET = "bench-key", "bench-secret-0123456789"
CHUNK, STREAMS = 8 << 20, 16  # tensorferry's defaults (TENSORFERRY_OBJECT_CHUNK / _CONCURRENCY)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="4G")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("--one-stream", action="store_true", help="also load with one request in flight")
    a = ap.parse_args()
    scale = {"G": 1 << 30, "M": 1 << 20}.get(a.size[-1:].upper())
    size = int(float(a.size[:-1]) * scale) if scale else int(a.size)
    exe = os.environ.get("S3S_FS") or shutil.which("s3s-fs") or os.path.expanduser("~/.cargo/bin/s3s-fs")
    if not os.path.isfile(exe):
        sys.exit("s3s-fs not found (cargo install s3s-fs --version 0.14.1 --features binary --locked)")
    root = tempfile.mkdtemp(prefix="tf-object-bench-")
    os.makedirs(f"{root}/bucket")
    n = size // (4096 * 1024 * 2)
    ref = {f"w{i}": torch.randn(4096, 1024, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
           for i in range(n)}
    path = f"{root}/model.safetensors"
    st_save(ref, path)
    nbytes = os.path.getsize(path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([exe, "--host", "127.0.0.1", "--port", str(port), "--access-key", KEY,
                             "--secret-key", SECRET, root], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = {}
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": KEY,
                           "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"})
        import tensorferry.torch as tft
        # Uploaded through the S3 API (not copied into the server's directory): s3s-fs
        # keeps the ETag of an uploaded object, and hashes the whole file on every GET of
        # one it did not receive (1.1 s per ranged GET of a 256 MiB file on 2 cores).
        t0 = time.perf_counter()
        _s3().upload_file(path, "bucket", "model.safetensors")
        print(json.dumps({"bytes": nbytes, "upload_with_boto3_s": round(time.perf_counter() - t0, 2)}), flush=True)

        def timed(name, fn):
            best = None
            for _ in range(a.repeat):
                t0 = time.perf_counter()
                out = fn()
                if a.device != "cpu":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                best = dt if best is None else min(best, dt)
                if isinstance(out, dict):
                    assert sorted(out) == sorted(ref), name
                    assert all(torch.equal(out[k].cpu().view(torch.int16), ref[k].view(torch.int16)) for k in ref), name
                del out
            rows[name] = {"s": round(best, 3), "GBps": round(nbytes / best / 1e9, 3)}
            print(json.dumps({name: rows[name]}), flush=True)

        url = f"{endpoint}/bucket/model.safetensors"
        timed("ceiling: curl, 16 parallel 8 MiB ranged GETs, discarded", lambda: _curl_ceiling(url, nbytes, root))
        timed("tensorferry, s3://", lambda: tft.load_file("s3://bucket/model.safetensors", device=a.device))
        timed("boto3 download_file + safetensors load_file", lambda: _boto3_then_safetensors(root, a.device))
        timed("tensorferry, local file (page cache)", lambda: tft.load_file(path, device=a.device))
        if a.one_stream:
            timed("tensorferry, s3://, one request at a time", lambda: _one_stream(tft, a.device))
    finally:
        proc.kill()
        shutil.rmtree(root, ignore_errors=True)
    ceiling = next(iter(rows.values()))["GBps"]
    print(f"\n| {nbytes / 1e9:.2f} GB from s3s-fs on loopback to {a.device} | seconds | GB/s | of ceiling |\n|---|---|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v['s']} | {v['GBps']} | {v['GBps'] / ceiling:.0%} |")
    if a.json:
        json.dump({"bytes": nbytes, "device": a.device, "cores": os.cpu_count(), "rows": rows}, open(a.json, "w"), indent=1)


def _curl_ceiling(url, nbytes, root):
    """STREAMS curl processes, each GETting every STREAMS-th CHUNK range in turn into
    /dev/null, requests signed with SigV4 as the server requires."""
    procs = []
    for s in range(STREAMS):
        cfg = os.path.join(root, f"curl{s}.cfg")
        with open(cfg, "w") as f:
            for k, off in enumerate(range(s * CHUNK, nbytes, STREAMS * CHUNK)):
                if k:
                    f.write("next\n")
                end = min(off + CHUNK, nbytes) - 1
                f.write(f'url = "{url}"\nrange = "{off}-{end}"\noutput = "/dev/null"\n'
                        f'aws-sigv4 = "aws:amz:us-east-1:s3"\nuser = "{KEY}:{SECRET}"\n'
                        'header = "x-amz-content-sha256: UNSIGNED-PAYLOAD"\nfail\nsilent\nshow-error\n')
        procs.append(subprocess.Popen(["curl", "-K", cfg]))
    bad = [p.wait() for p in procs]
    if any(bad):
        raise RuntimeError(f"curl failed: exit codes {bad}")
    return None


def _s3():
    import boto3
    from botocore.config import Config
    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], aws_access_key_id=KEY,
                        aws_secret_access_key=SECRET, region_name="us-east-1",
                        config=Config(s3={"addressing_style": "path"}))


def _boto3_then_safetensors(root, device):
    local = os.path.join(root, "downloaded.safetensors")
    _s3().download_file("bucket", "model.safetensors", local)
    try:
        return st_load(local, device=device)
    finally:
        os.unlink(local)


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
