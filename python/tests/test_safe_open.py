"""tensorferry.safe_open against safetensors.safe_open: keys, tensors, slices, and that a
slice reads only the bytes it needs."""
from __future__ import annotations

import numpy as np
import pytest
import safetensors
import torch

import tensorferry
from conftest import assert_same_array, assert_same_tensor, random_tensor

ROWS, COLS = 37, 24


@pytest.fixture
def ckpt(st_file):
    tensors = {
        "w": random_tensor((ROWS, COLS), torch.float32, seed=1),
        "cube": random_tensor((5, 6, 7), torch.int16, seed=2),
        "bytes": random_tensor((13, 3), torch.uint8, seed=3),
        "bf": random_tensor((9, 4), torch.bfloat16, seed=4),
        "scalar": random_tensor((), torch.float64, seed=5),
        "empty": random_tensor((0, 4), torch.float32, seed=6),
        "vec": random_tensor((50,), torch.int64, seed=7),
    }
    return st_file(tensors, metadata={"format": "pt"}), tensors


def test_keys_sorted_and_offset_keys_in_file_order(ckpt):
    path, tensors = ckpt
    with tensorferry.safe_open(path, framework="pt") as f, safetensors.safe_open(path, "pt") as ref:
        assert f.keys() == sorted(tensors) == ref.keys()
        assert sorted(f.offset_keys()) == sorted(tensors)
        # identical to the reference except for the arbitrary order of empty tensors
        assert [k for k in f.offset_keys() if k != "empty"] == [k for k in ref.offset_keys() if k != "empty"]
        assert f.offset_keys() != f.keys()  # the fixture makes the two orders differ


def test_get_tensor(ckpt, device):
    path, tensors = ckpt
    with tensorferry.safe_open(path, framework="pt", device=device) as f:
        for name, t in tensors.items():
            got = f.get_tensor(name)
            assert got.device.type == device
            assert_same_tensor(got, t, name)


def test_get_tensors_subset_and_all(ckpt):
    path, tensors = ckpt
    with tensorferry.safe_open(path, "pt") as f, safetensors.safe_open(path, "pt") as ref:
        some = f.get_tensors(["vec", "w"])
        assert list(some) == ["vec", "w"]
        assert_same_tensor(some["vec"], tensors["vec"])
        every = f.get_tensors()
        assert sorted(every) == sorted(tensors)
        assert list(every) == f.offset_keys()
        for k in tensors:
            assert_same_tensor(every[k], ref.get_tensor(k), k)


def test_slice_shape_and_dtype(ckpt):
    path, tensors = ckpt
    with tensorferry.safe_open(path, "pt") as f, safetensors.safe_open(path, "pt") as ref:
        for name in tensors:
            s, r = f.get_slice(name), ref.get_slice(name)
            assert s.get_shape() == r.get_shape() == list(tensors[name].shape), name
            assert s.get_dtype() == r.get_dtype(), name
        assert len(f.get_slice("w")) == ROWS


INDEXES_2D = [
    (slice(3, 11), "rows"),
    ((slice(None), slice(5, 17)), "cols"),
    ((slice(2, 9), slice(1, 4)), "box"),
    (4, "int"),
    (-1, "neg-int"),
    ((Ellipsis, 7), "ellipsis-col"),
    ((Ellipsis, -2), "ellipsis-neg-col"),
    (slice(None, None, 2), "step"),
    ((slice(1, None, 3), slice(None, None, 5)), "steps-2d"),
    (slice(-5, None), "neg-start"),
    (slice(-8, -2), "neg-both"),
    ((slice(None), slice(-3, None)), "neg-cols"),
    ((2, slice(4, 9)), "int-and-slice"),
    ((slice(4, 9), 2), "slice-and-int"),
    (slice(5, 5), "empty-range"),
    (slice(30, 100), "past-end"),
    ((), "empty-tuple"),
    (Ellipsis, "ellipsis"),
    ((5, 6), "element"),
]


@pytest.mark.parametrize("index", [i for i, _ in INDEXES_2D], ids=[n for _, n in INDEXES_2D])
def test_slice_2d_matches_full_tensor_and_reference(ckpt, index, device):
    path, tensors = ckpt
    full = tensors["w"]
    with tensorferry.safe_open(path, "pt", device=device) as f:
        got = f.get_slice("w")[index]
    assert got.device.type == device
    assert got.is_contiguous()
    assert_same_tensor(got, full[index].contiguous(), str(index))
    with safetensors.safe_open(path, "pt") as ref:
        try:
            want = ref.get_slice("w")[index]
        except Exception:  # noqa: BLE001 - an index the reference does not take
            return
        assert_same_tensor(got, want, str(index))


@pytest.mark.parametrize("index", [
    (slice(1, 4), slice(2, 5), slice(3, 6)), (2,), (Ellipsis, 3), (1, Ellipsis, 2), (slice(None), 2),
    (slice(None, None, 2), slice(None), slice(1, None, 3)), (-1, -1, -1), (slice(1, 3), Ellipsis),
], ids=lambda i: str(i).replace(" ", ""))
def test_slice_3d(ckpt, index):
    path, tensors = ckpt
    with tensorferry.safe_open(path, "pt") as f:
        got = f.get_slice("cube")[index]
    assert_same_tensor(got, tensors["cube"][index].contiguous(), str(index))


@pytest.mark.parametrize("name", ["bytes", "bf", "vec"])
def test_slice_other_dtypes(ckpt, name):
    path, tensors = ckpt
    with tensorferry.safe_open(path, "pt") as f:
        s = f.get_slice(name)
        for index in (slice(1, 4), -2, slice(None, None, 3)):
            assert_same_tensor(s[index], tensors[name][index].contiguous(), f"{name}{index}")


def test_slice_scalar_and_empty(ckpt):
    path, tensors = ckpt
    with tensorferry.safe_open(path, "pt") as f:
        assert_same_tensor(f.get_slice("scalar")[...], tensors["scalar"])
        assert_same_tensor(f.get_slice("scalar")[()], tensors["scalar"])
        assert_same_tensor(f.get_slice("empty")[:], tensors["empty"])
        assert_same_tensor(f.get_slice("empty")[:, 1:3], tensors["empty"][:, 1:3])
        with pytest.raises(TypeError):
            len(f.get_slice("scalar"))


def test_slice_bad_indexes(ckpt):
    path, _ = ckpt
    with tensorferry.safe_open(path, "pt") as f:
        s = f.get_slice("w")
        with pytest.raises(IndexError):
            s[ROWS]
        with pytest.raises(IndexError):
            s[-ROWS - 1]
        with pytest.raises(ValueError):
            s[::-1]
        with pytest.raises(ValueError):
            s[1, 2, 3]
        with pytest.raises(ValueError):
            s[[1, 2]]
        with pytest.raises(KeyError):
            f.get_slice("nope")


# --- bytes read ----------------------------------------------------------------------------

ROW_BYTES = COLS * 4


@pytest.mark.parametrize("index,rows", [
    (slice(3, 11), 8), (slice(0, 1), 1), (5, 1), (-1, 1), (slice(-4, None), 4),
    (slice(2, 20, 4), 17),  # rows 2..18 inclusive: the bounding box
    (slice(None), ROWS),
], ids=["a:b", "first", "int", "neg", "tail", "step-box", "all"])
def test_dim0_slice_reads_only_selected_rows(ckpt, index, rows):
    path, tensors = ckpt
    loader = tensorferry.Loader(engine="pread")
    with tensorferry.safe_open(path, "pt", loader=loader) as f:
        got = f.get_slice("w")[index]
    assert loader.last_report is not None
    assert loader.last_report["bytes"] == rows * ROW_BYTES
    assert_same_tensor(got, tensors["w"][index].contiguous())


def test_column_slice_reads_only_the_box(ckpt):
    path, tensors = ckpt
    loader = tensorferry.Loader(engine="pread")
    with tensorferry.safe_open(path, "pt", loader=loader) as f:
        got = f.get_slice("w")[2:9, 5:17]
        assert loader.last_report["bytes"] == 7 * 12 * 4
        assert_same_tensor(got, tensors["w"][2:9, 5:17].contiguous())
        got = f.get_slice("cube")[1:3, 2, 1:4]
        assert loader.last_report["bytes"] == 2 * 1 * 3 * 2
        assert_same_tensor(got, tensors["cube"][1:3, 2, 1:4].contiguous())


def test_get_tensor_reads_that_tensor_only(ckpt):
    path, tensors = ckpt
    loader = tensorferry.Loader()
    with tensorferry.safe_open(path, "pt", loader=loader) as f:
        f.get_tensor("vec")
    assert loader.last_report["bytes"] == 50 * 8


# --- numpy --------------------------------------------------------------------------------


def test_framework_np(ckpt):
    path, tensors = ckpt
    with tensorferry.safe_open(path, framework="np") as f, safetensors.safe_open(path, "np") as ref:
        assert f.keys() == ref.keys()
        for name in ("w", "cube", "bytes", "scalar", "empty", "vec"):
            got = f.get_tensor(name)
            assert_same_array(got, ref.get_tensor(name), name)
            assert_same_array(got, tensors[name].numpy(), name)
        s = f.get_slice("w")
        assert s.get_shape() == [ROWS, COLS]
        for index in (slice(3, 11), (slice(None), slice(5, 17)), 4, -1, (Ellipsis, 7), slice(None, None, 2)):
            got = s[index]
            assert isinstance(got, np.ndarray)
            assert got.flags.c_contiguous
            assert_same_array(got, np.ascontiguousarray(tensors["w"].numpy()[index]), str(index))
            assert_same_array(got, ref.get_slice("w")[index], str(index))


def test_np_slice_reads_only_selected_rows(ckpt):
    path, tensors = ckpt
    loader = tensorferry.Loader()
    with tensorferry.safe_open(path, framework="numpy", loader=loader) as f:
        got = f.get_slice("vec")[10:20]
    assert loader.last_report["bytes"] == 10 * 8
    assert_same_array(got, tensors["vec"].numpy()[10:20])


def test_bad_framework(ckpt):
    path, _ = ckpt
    with pytest.raises(ValueError, match="framework"):
        tensorferry.safe_open(path, framework="tf")
