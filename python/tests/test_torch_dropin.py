"""tensorferry.torch against safetensors.torch: same keys, dtypes, shapes and bits."""
from __future__ import annotations

import os

import pytest
import safetensors
import safetensors.torch
import torch

import tensorferry
import tensorferry.torch as tft
from conftest import (SHAPES, TORCH_DTYPES, assert_reference_order, assert_same_dict, assert_same_tensor,
                      file_order, random_tensor, tensor_bytes, write_sharded)


def _dtype_id(dt) -> str:
    return str(dt).replace("torch.", "")


# --- load_file ------------------------------------------------------------------------


def test_load_file_every_dtype_and_shape(all_dtypes_file, device):
    want = safetensors.torch.load_file(all_dtypes_file)
    got = tft.load_file(all_dtypes_file, device=device)
    assert_reference_order(got, want, all_dtypes_file)
    assert_same_dict(got, want, device, order=False)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)) or "scalar")
def test_load_file_single_tensor(st_file, dtype, shape):
    path = st_file({"t": random_tensor(shape, dtype, seed=len(shape))})
    want = safetensors.torch.load_file(path)
    got = tft.load_file(path)
    assert_same_dict(got, want, "cpu")


def test_dtype_matrix_covers_the_brief():
    names = {_dtype_id(d) for d in TORCH_DTYPES}
    for n in ("bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
              "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2", "complex64"):
        assert n in names


def test_key_order_matches_reference(st_file):
    # Names whose sorted order differs from insertion order and from file (data) order.
    tensors = {"b": torch.ones(3, dtype=torch.uint8), "a.10": torch.zeros(2, dtype=torch.float64),
               "a.9": torch.arange(4, dtype=torch.int16), "C": torch.ones(1)}
    path = st_file(tensors)
    want = safetensors.torch.load_file(path)
    got = tft.load_file(path)
    assert list(got) == list(want) == ["a.10", "C", "a.9", "b"]  # file order
    assert_same_dict(got, want)
    with tensorferry.safe_open(path, "pt") as f:
        assert list(f.get_tensors()) == list(want)


@pytest.mark.parametrize("dev", ["cpu", torch.device("cpu")], ids=["str", "torch.device"])
def test_device_argument_forms(st_file, dev):
    path = st_file({"w": random_tensor((4, 4), torch.float32)})
    got = tft.load_file(path, device=dev)
    assert got["w"].device == torch.device("cpu")
    assert_same_dict(got, safetensors.torch.load_file(path))


def test_pathlike_filename(st_file, tmp_path):
    import pathlib
    path = st_file({"w": random_tensor((4,), torch.float32)})
    assert_same_dict(tft.load_file(pathlib.Path(path)), safetensors.torch.load_file(path))


def test_metadata(st_file):
    meta = {"format": "pt", "name": "ünïcode ✓", "empty": ""}
    path = st_file({"w": torch.zeros(2)}, metadata=meta)
    with safetensors.safe_open(path, "pt") as ref:
        want = ref.metadata()
    with tensorferry.safe_open(path, "pt") as f:
        assert f.metadata() == want == meta


def test_metadata_absent(st_file):
    path = st_file({"w": torch.zeros(2)})
    with safetensors.safe_open(path, "pt") as ref, tensorferry.safe_open(path, "pt") as f:
        assert f.metadata() == ref.metadata()


# --- sharded checkpoints --------------------------------------------------------------


def _reference_sharded(index_path: str) -> dict:
    import json
    with open(index_path) as f:
        weight_map = json.load(f)["weight_map"]
    out = {}
    for shard in sorted(set(weight_map.values())):
        out.update(safetensors.torch.load_file(os.path.join(os.path.dirname(index_path), shard)))
    return out  # shard by shard, each in file order


def test_sharded_via_index(sharded, device):
    index, _d, tensors = sharded
    got = tft.load_file(index, device=device)
    want = _reference_sharded(index)
    assert set(want) == set(tensors)
    assert sorted(got) == sorted(tensors)
    assert_same_dict(got, want, device)


def test_sharded_via_directory(sharded, device):
    index, d, _tensors = sharded
    got = tft.load_file(d, device=device)
    assert_same_dict(got, _reference_sharded(index), device)


def test_sharded_safe_open_reads_across_shards(sharded):
    index, _d, tensors = sharded
    with tensorferry.safe_open(index, "pt") as f:
        assert f.keys() == sorted(tensors)
        assert f.metadata()["total_size"] == str(sum(t.numel() * t.element_size() for t in tensors.values()))
        for name, t in tensors.items():
            assert_same_tensor(f.get_tensor(name), t, name)


def test_single_file_directory(tmp_path):
    d = tmp_path / "one"
    d.mkdir()
    t = {"x": random_tensor((5, 3), torch.float16)}
    safetensors.torch.save_file(t, str(d / "model.safetensors"))
    assert_same_dict(tft.load_file(str(d)), t)
    assert tft.load_file(str(d / "model.safetensors")).keys() == t.keys()


def test_sharded_many_files(tmp_path):
    tensors = {f"t{i:02d}": random_tensor((i + 1,), torch.int32, seed=i) for i in range(12)}
    index = write_sharded(str(tmp_path), tensors, split=4)
    assert_same_dict(tft.load_file(index), tensors)  # shard by shard, in file order


# --- load(bytes) / save / save_file -----------------------------------------------------


def test_load_bytes_matches_reference(all_dtypes_file):
    with open(all_dtypes_file, "rb") as f:
        data = f.read()
    want = safetensors.torch.load(data)
    got = tft.load(data)
    # safetensors.torch.load orders keys arbitrarily (hash order); tensorferry gives the
    # file order, as load_file does.
    assert list(got) == file_order(all_dtypes_file) == list(tft.load_file(all_dtypes_file))
    assert_same_dict(got, want, order=False)
    for k, v in got.items():
        assert v.device.type == "cpu"


def test_load_bytes_accepts_bytearray(st_file):
    path = st_file({"a": random_tensor((3,), torch.int64)})
    data = open(path, "rb").read()
    assert_same_dict(tft.load(bytearray(data)), safetensors.torch.load(data))


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}], ids=["no-meta", "meta"])
def test_save_bytes_identical_to_reference(all_dtypes_tensors, metadata):
    want = safetensors.torch.save(all_dtypes_tensors, metadata=metadata)
    got = tft.save(all_dtypes_tensors, metadata=metadata)
    assert isinstance(got, bytes)
    assert got == want


@pytest.mark.parametrize("tensors", [
    {}, {"only": torch.zeros(0)}, {"s": torch.tensor(3.5)},
    {"z": torch.ones(3, dtype=torch.uint8), "a": torch.ones(2, dtype=torch.float64), "m": torch.ones(5, dtype=torch.int16)},
], ids=["empty-dict", "empty-tensor", "scalar", "mixed-alignment"])
def test_save_bytes_identical_small_cases(tensors):
    for meta in (None, {"k": "v"}):
        assert tft.save(tensors, metadata=meta) == safetensors.torch.save(tensors, metadata=meta)


@pytest.mark.parametrize("metadata", [None, {}, {"ké\"y": "vä\tl\u2028"}], ids=["none", "empty", "escapes"])
def test_names_and_metadata_needing_json_escapes(tmp_path, metadata):
    tensors = {"ünï\"q\\/\n": torch.ones(3), "a" * 300: torch.zeros(1, dtype=torch.int8), "": torch.ones(2)}
    assert tft.save(tensors, metadata=metadata) == safetensors.torch.save(tensors, metadata=metadata)
    path = str(tmp_path / "names.safetensors")
    safetensors.torch.save_file(tensors, path, metadata=metadata)
    assert_same_dict(tft.load_file(path), safetensors.torch.load_file(path))
    with tensorferry.safe_open(path, "pt") as f, safetensors.safe_open(path, "pt") as ref:
        assert f.keys() == ref.keys()
        assert f.metadata() == ref.metadata()


def test_save_accepts_disjoint_views_of_one_storage():
    base = torch.arange(10, dtype=torch.float32)
    tensors = {"a": base[:5], "b": base[5:]}
    assert tft.save(tensors) == safetensors.torch.save(tensors)


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}], ids=["no-meta", "meta"])
def test_save_file_identical_and_readable_by_reference(tmp_path, all_dtypes_tensors, metadata):
    path = tmp_path / "tf.safetensors"
    tft.save_file(all_dtypes_tensors, str(path), metadata=metadata)
    assert path.read_bytes() == safetensors.torch.save(all_dtypes_tensors, metadata=metadata)
    back = safetensors.torch.load_file(str(path))
    assert_same_dict(back, all_dtypes_tensors, order=False)
    with safetensors.safe_open(str(path), "pt") as f:
        assert f.metadata() == metadata
    # no temporary file left next to it
    assert sorted(os.listdir(tmp_path)) == ["tf.safetensors"]


def test_save_file_overwrites(tmp_path):
    path = str(tmp_path / "m.safetensors")
    tft.save_file({"a": torch.zeros(1000)}, path)
    tft.save_file({"b": torch.ones(2)}, path)
    assert_same_dict(safetensors.torch.load_file(path), {"b": torch.ones(2)})


def test_save_then_load_roundtrip(tmp_path, device):
    tensors = {"w": random_tensor((8, 3), torch.bfloat16), "i": random_tensor((5,), torch.int8)}
    path = str(tmp_path / "rt.safetensors")
    tft.save_file(tensors, path)
    assert_same_dict(tft.load_file(path, device=device), tensors, device, order=False)


def test_save_refuses_non_contiguous(tmp_path):
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    with pytest.raises(ValueError, match="contiguous"):
        tft.save({"t": t})
    with pytest.raises(ValueError, match="contiguous"):
        tft.save_file({"t": t}, str(tmp_path / "x.safetensors"))
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.parametrize("make", [
    lambda b: {"a": b, "b": b},
    lambda b: {"a": b[:6], "b": b[4:]},
    lambda b: {"a": b, "b": b.view(2, 5)},
], ids=["same", "overlap", "reshaped"])
def test_save_refuses_shared_tensors(tmp_path, make):
    tensors = make(torch.arange(10, dtype=torch.float32))
    with pytest.raises(ValueError, match="share memory"):
        tft.save(tensors)
    with pytest.raises(ValueError, match="share memory"):
        tft.save_file(tensors, str(tmp_path / "x.safetensors"))
    assert not (tmp_path / "x.safetensors").exists()


# --- ownership ------------------------------------------------------------------------


def test_loaded_tensors_own_their_memory(st_file, device):
    tensors = {f"t{i}": random_tensor((17, 3), torch.float32, seed=i) for i in range(4)}
    tensors["b"] = random_tensor((5,), torch.uint8)
    path = st_file(tensors)
    got = tft.load_file(path, device=device)
    for name, t in got.items():
        nbytes = t.numel() * t.element_size()
        assert t.untyped_storage().nbytes() == nbytes, name
        assert t.storage_offset() == 0, name
    ptrs = {t.untyped_storage().data_ptr() for t in got.values()}
    assert len(ptrs) == len(got)
    before = {k: tensor_bytes(v) for k, v in got.items()}
    got["t0"].fill_(0)
    got["b"].fill_(255)
    for k in ("t1", "t2", "t3"):
        assert tensor_bytes(got[k]) == before[k]
    # loading again gives fresh tensors, unaffected by the writes above
    again = tft.load_file(path, device=device)
    assert_same_dict(again, tensors, order=False)


def test_load_bytes_tensors_own_their_memory(st_file):
    path = st_file({"a": random_tensor((9,), torch.int16), "b": random_tensor((9,), torch.int16, seed=1)})
    data = open(path, "rb").read()
    got = tft.load(data)
    for t in got.values():
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
        assert t.is_contiguous()
    keep = tensor_bytes(got["b"])
    got["a"].zero_()
    assert tensor_bytes(got["b"]) == keep
    got["a"].add_(1)  # writable


def test_safe_open_get_tensor_owns_memory(st_file):
    path = st_file({"a": random_tensor((9, 2), torch.float64), "b": random_tensor((4,), torch.float64)})
    with tensorferry.safe_open(path, "pt") as f:
        a = f.get_tensor("a")
        s = f.get_slice("a")[2:5]
    assert a.untyped_storage().nbytes() == a.numel() * a.element_size()
    assert s.untyped_storage().nbytes() == s.numel() * s.element_size()
