"""Every read engine, with tiny staging (8 KiB x 3 slots) so that loads take many slot
turns and unaligned tensors straddle slot and 4 KiB boundaries: bit-exact results."""
from __future__ import annotations

import mmap
import os

import pytest
import safetensors.torch
import torch

import tensorferry
import tensorferry.numpy as tfn
import tensorferry.torch as tft
from conftest import assert_same_array, assert_same_dict, assert_same_tensor, random_tensor, write_sharded

ENGINES = ["auto", "pread", "direct", "uring"]
# what last_report["files"][i]["engine"] says for each engine asked for
REPORTED = {"pread": "pread", "direct": "pread+O_DIRECT", "uring": "io_uring+O_DIRECT"}


def _direct_refused(directory) -> str | None:
    """Why O_DIRECT reads do not work in `directory` (None when they do)."""
    path = os.path.join(directory, ".odirect-probe")
    with open(path, "wb") as f:
        f.write(b"\0" * 8192)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        return f"O_DIRECT open refused: {e}"
    try:
        buf = mmap.mmap(-1, 4096)  # page aligned
        os.preadv(fd, [buf], 0)
    except OSError as e:
        return f"O_DIRECT read refused: {e}"
    finally:
        os.close(fd)
        os.unlink(path)
    return None


def _skip_reason(engine: str, directory) -> str | None:
    if engine in ("direct", "uring"):
        why = _direct_refused(directory)
        if why:
            return f"{engine}: the temporary file system ({directory}) refuses O_DIRECT ({why})"
    if engine == "uring":
        status = tensorferry.doctor().get("io_uring")
        if status != "available":
            return f"uring: io_uring is not available here ({status})"
    return None


@pytest.fixture(params=ENGINES)
def engine_loader(request, tmp_path):
    reason = _skip_reason(request.param, tmp_path)
    if reason:
        print(f"skipping: {reason}")
        pytest.skip(reason)
    return request.param, tensorferry.Loader(engine=request.param, staging_size=8192, slots=3)


@pytest.fixture
def odd_tensors() -> dict[str, torch.Tensor]:
    """Sizes chosen to be unaligned: odd byte counts, tensors crossing 4 KiB and 8 KiB."""
    out = {
        "a.u8": random_tensor((4097,), torch.uint8, seed=1),
        "b.f32": random_tensor((3001, 7), torch.float32, seed=2),   # 84 KB
        "c.bf16": random_tensor((123, 45), torch.bfloat16, seed=3),
        "d.i64": random_tensor((8193,), torch.int64, seed=4),
        "e.bool": random_tensor((77,), torch.bool, seed=5),
        "f.scalar": random_tensor((), torch.float16, seed=6),
        "g.empty": random_tensor((0, 3), torch.float32, seed=7),
        "h.one": random_tensor((1,), torch.int8, seed=8),
    }
    for i in range(20):
        out[f"small.{i:02d}"] = random_tensor((i * 37 + 1,), torch.int16, seed=100 + i)
    return out


def _check_engine(name: str, loader: tensorferry.Loader) -> None:
    files = loader.last_report["files"]
    assert files
    for f in files:
        if name in REPORTED:
            assert f["engine"] == REPORTED[name], f
        else:
            assert f["engine"] in REPORTED.values(), f


def test_load_file(engine_loader, odd_tensors, st_file, device):
    name, loader = engine_loader
    path = st_file(odd_tensors)
    got = tft.load_file(path, device=device, loader=loader)
    assert_same_dict(got, safetensors.torch.load_file(path), device, order=False)
    assert list(got) == list(tft.load_file(path))
    _check_engine(name, loader)
    assert loader.last_report["bytes"] == sum(t.numel() * t.element_size() for t in odd_tensors.values())


def test_numpy_and_slices(engine_loader, odd_tensors, st_file):
    name, loader = engine_loader
    path = st_file(odd_tensors)
    no_bf16 = {k: t for k, t in odd_tensors.items() if t.dtype != torch.bfloat16}
    got = tfn.load_file(st_file(no_bf16), loader=loader)
    for k, t in no_bf16.items():
        assert_same_array(got[k], t.numpy(), k)
    _check_engine(name, loader)
    with tensorferry.safe_open(path, "np", loader=loader) as f:
        assert_same_array(f.get_slice("d.i64")[4000:4200], odd_tensors["d.i64"][4000:4200].numpy())
    with tensorferry.safe_open(path, "pt", loader=loader) as f:
        for index in (slice(1, 2999), slice(1000, 1003), (slice(5, 2000, 7), slice(2, 5)), -1):
            assert_same_tensor(f.get_slice("b.f32")[index], odd_tensors["b.f32"][index].contiguous(), str(index))
            _check_engine(name, loader)
        assert_same_tensor(f.get_slice("a.u8")[4095:4097], odd_tensors["a.u8"][4095:4097])
        assert_same_tensor(f.get_tensor("f.scalar"), odd_tensors["f.scalar"])


def test_sharded(engine_loader, odd_tensors, tmp_path):
    name, loader = engine_loader
    index = write_sharded(str(tmp_path), odd_tensors, split=3)
    got = tft.load_file(index, loader=loader)
    assert_same_dict(got, odd_tensors, order=False)
    assert len(loader.last_report["files"]) == 3
    _check_engine(name, loader)


def test_raw(engine_loader, tmp_path, device):
    name, loader = engine_loader
    vals = random_tensor((50_001,), torch.int32, seed=3)
    path = tmp_path / "raw.bin"
    path.write_bytes(b"\x07" * 13 + vals.numpy().tobytes())
    t = tft.load_tensor(str(path), 50_001, dtype=torch.int32, device=device, offset=13, loader=loader)
    assert_same_tensor(t, vals)
    parts = tft.load_tensors([(str(path), 1000, 13 + 4 * 7), (str(path), 3, 13 + 4 * 40_000), str(path)],
                             dtype=torch.uint8, device=device, loader=loader)
    raw = path.read_bytes()
    assert bytes(parts[0].cpu().numpy()) == raw[41:1041]
    assert bytes(parts[1].cpu().numpy()) == raw[160_013:160_016]
    assert bytes(parts[2].cpu().numpy()) == raw
    _check_engine(name, loader)


def test_cold_file(engine_loader, odd_tensors, st_file):
    """After the file leaves the page cache, `auto` picks an O_DIRECT engine (where the
    file system takes it); every engine still reads the right bytes."""
    name, loader = engine_loader
    # big enough that the header read (and its readahead) leaves most of it uncached
    odd_tensors = {**odd_tensors, "big": random_tensor((1 << 20, 3), torch.uint8, seed=9)}
    path = st_file(odd_tensors)
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    tensorferry.drop_cache(path)
    got = tft.load_file(path, loader=loader)
    assert_same_dict(got, odd_tensors, order=False)
    f = loader.last_report["files"][0]
    if name == "auto":
        assert f["resident"] is not None
        if f["resident"] < 0.5 and _direct_refused(os.path.dirname(path)) is None:
            assert f["engine"] != "pread", f
    else:
        _check_engine(name, loader)


def test_handle_engines(engine_loader, tmp_path):
    name, _ = engine_loader
    path = str(tmp_path / "h.bin")
    a = random_tensor((10_007,), torch.float32, seed=5)
    with tensorferry.Handle(engine=name, staging_size=8192, slots=3) as h:
        h.pwrite(a, path, offset=3)
        b = torch.empty_like(a)
        h.pread(b, path, offset=3)
        assert h._loader.last_report["files"][0]["engine"] in REPORTED.values()
    assert_same_tensor(b, a)
