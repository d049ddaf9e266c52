"""Per-tensor checksums: save_file(checksums=True) records an xxh3-64 per tensor in the
header's metadata (the file stays a plain safetensors file the reference reads), and
load_file(verify=True) / safe_open(verify=True) check them as the bytes pass through
staging, naming the tensor whose bytes changed."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

import tensorferry
import tensorferry.numpy as tfn
import tensorferry.torch as tft
from conftest import assert_same_dict, assert_same_tensor, random_array, random_tensor

KEY = "tensorferry.xxh3_64"


def _state() -> dict[str, torch.Tensor]:
    return {
        "empty": random_tensor((0, 3), torch.float32, 1),
        "scalar": random_tensor((), torch.float64, 2),
        "odd": random_tensor((10_007,), torch.uint8, 3),
        "big": random_tensor((9001, 3), torch.float32, 4),
        "bf": random_tensor((4097,), torch.bfloat16, 5),
        "wide": random_tensor((70_001,), torch.int8, 6),
    }


def _tiny_saver() -> tensorferry.Saver:
    return tensorferry.Saver(threads=4, staging_size=4096, slots=3, direct="off")


def _flip(path, name: str) -> None:
    """Flips one bit in the middle of tensor `name`'s data."""
    with safetensors.safe_open(path, "np") as f:
        keys = f.keys()
    assert name in keys
    data = bytearray(open(path, "rb").read())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    begin, end = header[name]["data_offsets"]
    data[8 + n + (begin + end) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("staging", [4096, 8192])
def test_checksums_round_trip_bit_exact_through_tiny_staging(tmp_path, device, staging):
    state = {k: v.to(device) for k, v in _state().items()}
    path = str(tmp_path / "m.safetensors")
    tft.save_file(state, path, metadata={"format": "pt"}, saver=_tiny_saver(), checksums=True)
    # Still a safetensors file: the reference reads it, metadata is a string map.
    ref = safetensors.torch.load_file(path)
    assert_same_dict(ref, {k: v.cpu() for k, v in state.items()}, order=False)
    with safetensors.safe_open(path, "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt"
    sums = json.loads(meta[KEY])
    assert list(sums) == sorted(state)
    assert all(re.fullmatch(r"[0-9a-f]{16}", v) for v in sums.values())
    loader = tensorferry.Loader(threads=4, staging_size=staging, slots=4)
    got = tft.load_file(path, device=device, loader=loader, verify=True)
    assert_same_dict(got, state, order=False)
    with tensorferry.safe_open(path, "pt", device=device, loader=loader, verify=True) as f:
        assert_same_dict(f.get_tensors(), state, order=False)
        assert_same_tensor(f.get_tensor("big"), state["big"].cpu(), "big")


def test_without_checksums_the_bytes_are_the_reference(tmp_path):
    state = _state()
    ours, ref = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    tft.save_file(state, ours, saver=_tiny_saver())
    safetensors.torch.save_file(state, ref)
    assert open(ours, "rb").read() == open(ref, "rb").read()


@pytest.mark.parametrize("victim", ["big", "wide", "scalar"])
def test_a_flipped_byte_fails_verify_naming_the_tensor(tmp_path, victim):
    path = str(tmp_path / "m.safetensors")
    tft.save_file(_state(), path, saver=_tiny_saver(), checksums=True)
    _flip(path, victim)
    tft.load_file(path)  # unverified: loads
    loader = tensorferry.Loader(threads=4, staging_size=4096, slots=4)
    with pytest.raises(tensorferry.errors.InvalidFileError, match=f"checksum mismatch in tensor \"{victim}\"") as e:
        tft.load_file(path, loader=loader, verify=True)
    assert "m.safetensors" in str(e.value)
    with tensorferry.safe_open(path, "pt", verify=True) as f:
        with pytest.raises(tensorferry.errors.InvalidFileError, match=victim):
            f.get_tensor(victim)
        f.get_tensor("odd")  # the others still verify
        if victim != "scalar":
            f.get_slice(victim)[:1]  # slices are not verified


def test_verify_without_checksums_raises(tmp_path, st_file):
    path = st_file({"a": torch.arange(10)})
    with pytest.raises(tensorferry.errors.InvalidFileError, match="no tensorferry checksums"):
        tft.load_file(path, verify=True)
    with pytest.raises(tensorferry.errors.InvalidFileError, match="no tensorferry checksums"):
        tfn.load_file(path, verify=True)
    assert torch.equal(tft.load_file(path)["a"], torch.arange(10))


def test_numpy_checksums_and_sharded(tmp_path):
    arrays = {"x": random_array((3001, 5), np.float32, 1), "y": random_array((17,), np.int16, 2)}
    path = str(tmp_path / "n.safetensors")
    tfn.save_file(arrays, path, saver=_tiny_saver(), checksums=True)
    ref = safetensors.numpy.load_file(path)
    got = tfn.load_file(path, verify=True)
    for k, v in arrays.items():
        assert ref[k].tobytes() == v.tobytes() and got[k].tobytes() == v.tobytes()
    d = tmp_path / "ck"
    tft.save_sharded(_state(), str(d), max_shard_size=40_000, saver=_tiny_saver(), checksums=True)
    assert len(list(d.glob("model-*.safetensors"))) > 1
    assert_same_dict(tft.load_file(str(d), verify=True), _state(), order=False)
