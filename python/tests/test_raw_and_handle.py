"""Raw flat files (load_tensor, load_tensors, load_tensor_timed) and the DeepNVMe-style
Handle (pread / pwrite and their async forms)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import tensorferry
import tensorferry.torch as tft
from conftest import assert_same_array, assert_same_tensor, random_tensor


@pytest.fixture
def raw(tmp_path):
    """A raw file of 1000 float32 values followed by 7 stray bytes; (path, values)."""
    vals = random_tensor((1000,), torch.float32, seed=11)
    path = tmp_path / "raw.bin"
    path.write_bytes(vals.numpy().tobytes() + b"\x01\x02\x03\x04\x05\x06\x07")
    return str(path), vals


@pytest.fixture
def raw_exact(tmp_path):
    vals = random_tensor((4096 + 3,), torch.int16, seed=12)
    path = tmp_path / "exact.bin"
    path.write_bytes(vals.numpy().tobytes())
    return str(path), vals


def test_load_tensor_count_and_offset(raw, device):
    path, vals = raw
    t = tft.load_tensor(path, 100, dtype=torch.float32, device=device, offset=0)
    assert t.device.type == device
    assert_same_tensor(t, vals[:100])
    t = tft.load_tensor(path, 250, dtype=torch.float32, device=device, offset=40 * 4)
    assert_same_tensor(t, vals[40:290])
    # an offset that is not a multiple of the element size
    t = tft.load_tensor(path, 3, dtype=torch.uint8, device=device, offset=4001)
    assert_same_tensor(t, torch.tensor([2, 3, 4], dtype=torch.uint8))


def test_load_tensor_reinterprets_dtype(raw):
    path, vals = raw
    t = tft.load_tensor(path, 20, dtype=torch.int16, device="cpu")
    assert_same_tensor(t, vals[:10].view(torch.int16))
    t = tft.load_tensor(path, 8, dtype="bfloat16", device="cpu", offset=8)
    assert_same_tensor(t, vals[2:6].view(torch.bfloat16))


def test_load_tensor_whole_file(raw_exact, device):
    path, vals = raw_exact
    t = tft.load_tensor(path, None, dtype=torch.int16, device=device)
    assert_same_tensor(t, vals)
    t = tft.load_tensor(path, dtype=torch.int16, device=device, offset=2 * 100)
    assert_same_tensor(t, vals[100:])
    t = tft.load_tensor(path, None, dtype=torch.uint8, device=device, offset=os.path.getsize(path))
    assert t.numel() == 0


def test_load_tensor_whole_file_partial_element_is_an_error(raw):
    path, _ = raw  # 4007 bytes: not whole float32 elements
    with pytest.raises(tensorferry.InvalidFileError) as ei:
        tft.load_tensor(path, None, dtype=torch.float32, device="cpu")
    assert path in str(ei.value)


def test_load_tensor_top_level_alias(raw):
    path, vals = raw
    assert_same_tensor(tensorferry.load_tensor(path, 5, dtype=torch.float32, device="cpu"), vals[:5])


def test_load_tensors_one_submission(raw, raw_exact, device):
    p1, v1 = raw
    p2, v2 = raw_exact
    loader = tensorferry.Loader()
    out = tft.load_tensors([(p1, 10), (p1, 20, 400), p2, (p2, 5, 2)], dtype=torch.int16, device=device, loader=loader)
    assert len(out) == 4
    b1 = v1.view(torch.int16)
    assert_same_tensor(out[0], b1[:10])
    assert_same_tensor(out[1], b1[200:220])
    assert_same_tensor(out[2], v2)
    assert_same_tensor(out[3], v2[1:6])
    # one submission: one report covering every byte of all four
    assert loader.last_report["bytes"] == 2 * (10 + 20 + v2.numel() + 5)
    assert sorted(os.path.basename(f["path"]) for f in loader.last_report["files"]) == ["exact.bin", "raw.bin"]


def test_load_tensors_outputs_are_independent(raw):
    path, vals = raw
    a, b = tft.load_tensors([(path, 10), (path, 10)], dtype=torch.float32, device="cpu")
    a.zero_()
    assert_same_tensor(b, vals[:10])
    assert b.untyped_storage().nbytes() == 40


def test_load_tensor_timed(raw, device):
    path, vals = raw
    res = tft.load_tensor_timed(path, 64, dtype=torch.float32, device=device, offset=4)
    assert isinstance(res, tuple) and len(res) == 2
    t, secs = res
    assert isinstance(secs, float) and secs >= 0.0
    assert_same_tensor(t, vals[1:65])


@pytest.mark.parametrize("n,offset", [(1002, 0), (1000, 8), (1, 4004), (0, 5000), (2**62, 0)])
def test_load_tensor_too_many_elements(raw, n, offset):
    path, _ = raw
    with pytest.raises(tensorferry.InvalidFileError) as ei:
        tft.load_tensor(path, n, dtype=torch.float32, device="cpu", offset=offset)
    assert path in str(ei.value)
    assert isinstance(ei.value, ValueError)


def test_load_tensor_missing_file(tmp_path):
    p = str(tmp_path / "nope.bin")
    with pytest.raises(FileNotFoundError) as ei:
        tft.load_tensor(p, 1, dtype=torch.float32, device="cpu")
    assert p in str(ei.value)


def test_load_tensor_bad_spec(raw):
    with pytest.raises(ValueError):
        tft.load_tensors([(raw[0], 1, 0, 9)], device="cpu")


# --- Handle ------------------------------------------------------------------------------


def test_handle_pwrite_pread_torch_roundtrip(tmp_path):
    path = str(tmp_path / "h.bin")
    a = random_tensor((33, 7), torch.float32, seed=1)
    b = random_tensor((5,), torch.int64, seed=2)
    with tensorferry.Handle() as h:
        assert h.pwrite(a, path) == a.numel() * 4
        assert h.pwrite(b, path, offset=a.numel() * 4 + 3) == 40
        assert os.path.getsize(path) == a.numel() * 4 + 3 + 40
        a2 = torch.empty_like(a)
        b2 = torch.zeros_like(b)
        assert h.pread(a2, path) == a.numel() * 4
        assert h.pread(b2, path, offset=a.numel() * 4 + 3) == 40
    assert_same_tensor(a2, a)
    assert_same_tensor(b2, b)
    data = open(path, "rb").read()
    assert data[:a.numel() * 4] == a.numpy().tobytes()
    assert data[-40:] == b.numpy().tobytes()


def test_handle_pwrite_overwrites_in_place(tmp_path):
    path = str(tmp_path / "h.bin")
    with tensorferry.Handle() as h:
        h.pwrite(torch.zeros(10, dtype=torch.uint8), path)
        h.pwrite(torch.full((3,), 7, dtype=torch.uint8), path, offset=4)
    assert open(path, "rb").read() == bytes([0, 0, 0, 0, 7, 7, 7, 0, 0, 0])


def test_handle_numpy_roundtrip(tmp_path):
    path = str(tmp_path / "n.bin")
    a = np.arange(1234, dtype=np.float64) * 1.5
    with tensorferry.Handle() as h:
        assert h.pwrite(a, path, offset=16) == a.nbytes
        back = np.empty_like(a)
        assert h.pread(back, path, offset=16) == a.nbytes
    assert_same_array(back, a)


def test_handle_async_and_wait(tmp_path):
    tensors = [random_tensor((100 + i,), torch.float16, seed=i) for i in range(6)]
    arrays = [np.arange(50 + i, dtype=np.int32) for i in range(3)]
    paths = [str(tmp_path / f"a{i}.bin") for i in range(len(tensors) + len(arrays))]
    with tensorferry.Handle(workers=3) as h:
        futs = [h.async_pwrite(t, p) for t, p in zip(tensors, paths)]
        futs += [h.async_pwrite(a, p) for a, p in zip(arrays, paths[len(tensors):])]
        assert h.wait() == len(futs)
        assert all(f.done() for f in futs)
        assert [f.wait() for f in futs] == [t.numel() * 2 for t in tensors] + [a.nbytes for a in arrays]
        outs = [torch.empty_like(t) for t in tensors]
        aouts = [np.zeros_like(a) for a in arrays]
        rf = [h.async_pread(o, p) for o, p in zip(outs, paths)]
        rf += [h.async_pread(o, p) for o, p in zip(aouts, paths[len(tensors):])]
        assert rf[0].wait() == tensors[0].numel() * 2
        assert h.wait() == len(rf)
        assert h.wait() == 0
    for o, t in zip(outs, tensors):
        assert_same_tensor(o, t)
    for o, a in zip(aouts, arrays):
        assert_same_array(o, a)


def test_handle_pread_past_end_fails(tmp_path):
    path = str(tmp_path / "short.bin")
    open(path, "wb").write(b"\0" * 10)
    with tensorferry.Handle() as h:
        with pytest.raises(tensorferry.TensorferryError) as ei:
            h.pread(torch.empty(100, dtype=torch.uint8), path)
        assert "short.bin" in str(ei.value)
        fut = h.async_pread(torch.empty(100, dtype=torch.uint8), path)
        with pytest.raises(tensorferry.TensorferryError):
            h.wait()
        with pytest.raises(tensorferry.TensorferryError):
            fut.wait()


def test_handle_refuses_non_contiguous(tmp_path):
    path = str(tmp_path / "x.bin")
    open(path, "wb").write(b"\0" * 64)
    with tensorferry.Handle() as h:
        with pytest.raises(ValueError):
            h.pread(torch.empty(4, 4).t(), path)
        ro = np.zeros(4, np.float32)
        ro.flags.writeable = False
        with pytest.raises(ValueError):
            h.pread(ro, path)
