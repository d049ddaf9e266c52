"""Loads from object stores through the Python API: s3:// (a real `s3s-fs` server with
signature checks) and http:// (a local server honouring Range), of files written by the
reference safetensors. Tests whose server is missing skip, saying why."""
from __future__ import annotations

import http.server
import os
import shutil
import socket
import subprocess
import threading
import time

import pytest
import safetensors.torch
import torch

import tensorferry
import tensorferry.torch as tft

KEY, SECRET = "pyaccesskey", "py-secret-never-printed-42"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _s3s_fs() -> str | None:
    for c in (os.environ.get("S3S_FS"), shutil.which("s3s-fs"), os.path.expanduser("~/.cargo/bin/s3s-fs")):
        if c and os.path.isfile(c):
            return c
    return None


@pytest.fixture
def s3(tmp_path, monkeypatch):
    exe = _s3s_fs()
    if exe is None:
        pytest.skip("s3s-fs not installed (cargo install s3s-fs --version 0.14.1 --features binary --locked)")
    root = tmp_path / "s3root"
    (root / "bucket").mkdir(parents=True)
    port = _free_port()
    proc = subprocess.Popen([exe, "--host", "127.0.0.1", "--port", str(port), "--access-key", KEY,
                             "--secret-key", SECRET, str(root)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if time.time() > deadline:
                proc.kill()
                pytest.skip("s3s-fs did not start")
            time.sleep(0.05)
    for k, v in {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": KEY,
                 "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}.items():
        monkeypatch.setenv(k, v)
    yield root / "bucket"
    proc.kill()
    proc.wait()


class _RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Serves a directory, honouring `Range: bytes=a-b`."""

    def log_message(self, *args):  # quiet
        pass

    def send_head(self):
        path = self.translate_path(self.path)
        if not os.path.isfile(path):
            self.send_error(404)
            return None
        size = os.path.getsize(path)
        f = open(path, "rb")  # noqa: SIM115 - closed by copyfile's caller
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            a, b = rng[6:].split("-")
            lo, hi = int(a), min(int(b) if b else size - 1, size - 1)
            f.seek(lo)
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {lo}-{hi}/{size}")
            length = hi - lo + 1
        else:
            self.send_response(200)
            length = size
        self.send_header("Content-Length", str(length))
        self.send_header("ETag", f'"{size:x}"')
        self.send_header("Last-Modified", self.date_time_string(int(os.path.getmtime(path))))
        self.end_headers()
        self._left = length
        return f

    def copyfile(self, source, outputfile):
        outputfile.write(source.read(self._left))


@pytest.fixture
def http_dir(tmp_path):
    d = tmp_path / "www"
    d.mkdir()
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                          lambda *a: _RangeHandler(*a, directory=str(d)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield d, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def _tensors():
    g = torch.Generator().manual_seed(7)
    return {"a": torch.randn(300, 77, generator=g), "b": torch.arange(1001, dtype=torch.int16),
            "c": torch.randn(3, dtype=torch.float64), "empty": torch.zeros(0, 4)}


def _same(got, want, device="cpu"):
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].device.type == torch.device(device).type, k
        assert got[k].dtype == want[k].dtype and torch.equal(got[k].cpu(), want[k]), k


def test_load_file_and_safe_open_from_s3(s3, device):
    ref = _tensors()
    safetensors.torch.save_file(ref, str(s3 / "model.safetensors"), metadata={"format": "pt"})
    _same(tft.load_file("s3://bucket/model.safetensors", device=device), ref, device)
    with tensorferry.safe_open("s3://bucket/model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert torch.equal(f.get_tensor("b"), ref["b"])


def test_sharded_prefix_from_s3(s3):
    ref = _tensors()
    d = s3 / "ck"
    d.mkdir()
    safetensors.torch.save_file({"a": ref["a"]}, str(d / "m-1.safetensors"))
    safetensors.torch.save_file({"b": ref["b"], "c": ref["c"]}, str(d / "m-2.safetensors"))
    (d / "model.safetensors.index.json").write_text(
        '{"metadata": {}, "weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors", "c": "m-2.safetensors"}}')
    got = tft.load_file("s3://bucket/ck")
    _same(got, {k: ref[k] for k in "abc"})


def test_s3_errors_name_url_not_secret(s3, monkeypatch):
    with pytest.raises(tensorferry.errors.NotFoundError) as e:
        tft.load_file("s3://bucket/missing.safetensors")
    assert "s3://bucket/missing.safetensors" in str(e.value)
    safetensors.torch.save_file(_tensors(), str(s3 / "m.safetensors"))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "bad-secret-value-1234")
    with pytest.raises(tensorferry.errors.PermissionDeniedError) as e:
        tft.load_file("s3://bucket/m.safetensors")
    assert "s3://bucket/m.safetensors" in str(e.value) and "bad-secret-value-1234" not in str(e.value)


def test_load_file_and_raw_tensor_from_http(http_dir, device):
    d, base = http_dir
    ref = _tensors()
    safetensors.torch.save_file(ref, str(d / "m.safetensors"))
    _same(tft.load_file(f"{base}/m.safetensors", device=device), ref, device)
    raw = torch.arange(5000, dtype=torch.float32)
    (d / "raw.bin").write_bytes(raw.numpy().tobytes())
    got = tft.load_tensor(f"{base}/raw.bin", 5000, dtype=torch.float32, device=device)
    assert got.device.type == torch.device(device).type and torch.equal(got.cpu(), raw)


def test_save_file_and_sharded_to_s3_load_back_equal(s3, tmp_path):
    sd = {"w": torch.randn(300, 257), "b": torch.arange(1000, dtype=torch.int64), "s": torch.tensor(3.5)}
    tft.save_file(sd, "s3://bucket/out/model.safetensors", metadata={"format": "pt"})
    # Byte-identical to what safetensors writes, and loads back equal.
    ref = tmp_path / "ref.safetensors"
    safetensors.torch.save_file(sd, str(ref), metadata={"format": "pt"})
    assert (s3 / "out" / "model.safetensors").read_bytes() == ref.read_bytes()
    back = tft.load_file("s3://bucket/out/model.safetensors")
    assert back.keys() == sd.keys()
    for k, v in sd.items():
        assert torch.equal(back[k], v), k
    tft.save_sharded(sd, "s3://bucket/ck", max_shard_size=100_000)
    assert (s3 / "ck" / "model.safetensors.index.json").is_file()
    back = tft.load_file("s3://bucket/ck")
    for k, v in sd.items():
        assert torch.equal(back[k], v), k


@pytest.fixture
def s3_opts(s3, monkeypatch):
    """The s3s-fs server with no AWS_* variables set: its settings as storage_options."""
    opts = {"aws_endpoint": os.environ["AWS_ENDPOINT_URL"], "aws_access_key_id": KEY,
            "aws_secret_access_key": SECRET, "aws_region": "us-east-1", "aws_allow_http": "true"}
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    return s3, opts


def test_storage_options_load_save_safe_open_without_env(s3_opts, tmp_path):
    root, opts = s3_opts
    ref = _tensors()
    safetensors.torch.save_file(ref, str(root / "model.safetensors"), metadata={"format": "pt"})
    _same(tft.load_file("s3://bucket/model.safetensors", storage_options=opts), ref)
    with tensorferry.safe_open("s3://bucket/model.safetensors", framework="pt", storage_options=opts) as f:
        assert f.metadata() == {"format": "pt"}
        assert torch.equal(f.get_tensor("b"), ref["b"])
    import tensorferry.numpy as tfn
    got = tfn.load_file("s3://bucket/model.safetensors", storage_options=opts)
    assert (got["b"] == ref["b"].numpy()).all()
    # Short key forms, and options held by a Loader / Saver.
    short = {k.removeprefix("aws_"): v for k, v in opts.items()}
    loader = tensorferry.Loader(storage_options=short)
    _same(tft.load_file("s3://bucket/model.safetensors", loader=loader), ref)
    sd = {"w": torch.randn(40, 30), "i": torch.arange(10)}
    tft.save_file(sd, "s3://bucket/out/m.safetensors", storage_options=opts)
    ref_path = tmp_path / "ref.safetensors"
    safetensors.torch.save_file(sd, str(ref_path))
    assert (root / "out" / "m.safetensors").read_bytes() == ref_path.read_bytes()
    tft.save_sharded(sd, "s3://bucket/ck", max_shard_size=1000, saver=tensorferry.Saver(storage_options=opts))
    back = tft.load_file("s3://bucket/ck", storage_options=opts)
    for k, v in sd.items():
        assert torch.equal(back[k], v), k


def test_storage_options_wrong_secret_is_permission_denied_not_leaked(s3_opts):
    root, opts = s3_opts
    safetensors.torch.save_file(_tensors(), str(root / "m.safetensors"))
    bad = {**opts, "aws_secret_access_key": "wrong-secret-value-5678"}
    for call in (lambda: tft.load_file("s3://bucket/m.safetensors", storage_options=bad),
                 lambda: tensorferry.safe_open("s3://bucket/m.safetensors", storage_options=bad),
                 lambda: tft.save_file({"x": torch.zeros(3)}, "s3://bucket/x.safetensors", storage_options=bad)):
        with pytest.raises(tensorferry.errors.PermissionDeniedError) as e:
            call()
        assert "s3://bucket/" in str(e.value)
        assert "wrong-secret-value-5678" not in str(e.value) and SECRET not in str(e.value)
        assert "wrong-secret-value-5678" not in repr(e.value)


def test_storage_options_repr_shows_names_only():
    opts = {"aws_access_key_id": "AKIDVISIBLE", "aws_secret_access_key": "top-secret-value-99"}
    for obj in (tensorferry.Loader(storage_options=opts), tensorferry.Saver(storage_options=opts)):
        text = repr(obj) + str(obj.options)
        assert "aws_secret_access_key" in text and "aws_access_key_id" in text
        assert "top-secret-value-99" not in text and "AKIDVISIBLE" not in text
    with pytest.raises(tensorferry.errors.InvalidArgumentError) as e:
        tensorferry.Loader(storage_options={"aws_secret_access_key": 12345})
    assert "12345" not in str(e.value)


def test_storage_options_merge_over_loader_and_saver_options():
    from tensorferry import _core
    base = tensorferry.Loader(threads=3, storage_options={"aws_region": "eu-west-1"})
    merged = _core.loader_for(base, {"aws_endpoint": "http://127.0.0.1:1"})
    assert merged.options["threads"] == 3
    assert merged.options["storage_options"] == ["aws_endpoint", "aws_region"]
    assert _core.loader_for(base, None) is base
    saver = _core.saver_for(tensorferry.Saver(threads=2, direct="off"), {"region": "x"})
    assert saver.options["threads"] == 2 and saver.options["storage_options"] == ["region"]
