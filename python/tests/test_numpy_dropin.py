"""tensorferry.numpy against safetensors.numpy: same keys, dtypes, shapes and bits."""
from __future__ import annotations

import os

import numpy as np
import pytest
import safetensors
import safetensors.numpy

import tensorferry
import tensorferry.numpy as tfn
from conftest import NUMPY_DTYPES, SHAPES, assert_same_array, file_order, random_array, read_header


@pytest.fixture
def arrays() -> dict[str, np.ndarray]:
    out = {}
    for i, dt in enumerate(NUMPY_DTYPES):
        for j, shape in enumerate(SHAPES):
            out[f"{dt.name}.{'x'.join(map(str, shape)) or 'scalar'}"] = random_array(shape, dt, seed=i * 100 + j)
    return out


def _same(got: dict, want: dict, ordered: bool = True) -> None:
    if ordered:
        assert list(got) == list(want)
    else:
        assert sorted(got) == sorted(want)
    for k in want:
        assert_same_array(got[k], want[k], k)


def _nonempty_order(d: dict) -> list[str]:
    return [k for k, v in d.items() if v.size]


def test_load_file_every_dtype_and_shape(np_st_file, arrays):
    path = np_st_file(arrays, metadata={"format": "np"})
    want = safetensors.numpy.load_file(path)
    got = tfn.load_file(path)
    assert list(got) == file_order(path)
    assert _nonempty_order(got) == _nonempty_order(want)  # safetensors orders empty ones arbitrarily
    _same(got, want, ordered=False)
    for v in got.values():
        assert v.flags.c_contiguous and v.flags.writeable and v.flags.owndata or v.base is not None


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)) or "scalar")
def test_load_file_single_array(np_st_file, dtype, shape):
    path = np_st_file({"a": random_array(shape, dtype, seed=3)})
    _same(tfn.load_file(path), safetensors.numpy.load_file(path))


def test_reads_files_written_by_safetensors_torch(st_file):
    import torch
    from conftest import random_tensor
    path = st_file({"w": random_tensor((4, 5), torch.float32), "i": random_tensor((3,), torch.int64)})
    _same(tfn.load_file(path), safetensors.numpy.load_file(path))


def test_load_bytes(np_st_file, arrays):
    path = np_st_file(arrays)
    data = open(path, "rb").read()
    got = tfn.load(data)
    assert list(got) == file_order(path)
    _same(got, safetensors.numpy.load(data), ordered=False)
    for v in got.values():
        assert v.flags.writeable


@pytest.mark.parametrize("metadata", [None, {"format": "np"}], ids=["no-meta", "meta"])
def test_save_bytes_identical_to_reference(arrays, metadata):
    assert tfn.save(arrays, metadata=metadata) == safetensors.numpy.save(arrays, metadata=metadata)


@pytest.mark.parametrize("metadata", [None, {"format": "np"}], ids=["no-meta", "meta"])
def test_save_file_identical_and_readable_by_reference(tmp_path, arrays, metadata):
    path = tmp_path / "tf.safetensors"
    tfn.save_file(arrays, str(path), metadata=metadata)
    assert path.read_bytes() == safetensors.numpy.save(arrays, metadata=metadata)
    _same(safetensors.numpy.load_file(str(path)), arrays, ordered=False)
    with safetensors.safe_open(str(path), "np") as f:
        assert f.metadata() == metadata
    assert os.listdir(tmp_path) == ["tf.safetensors"]


def test_save_non_contiguous_array_is_packed():
    # A transposed (Fortran-order) array is written in C order, i.e. its values are kept.
    # (safetensors.numpy 0.8 writes the raw buffer here, which scrambles the values, so
    # the reference is the packed copy.)
    a = np.arange(12, dtype=np.int32).reshape(3, 4).T
    assert not a.flags.c_contiguous
    data = tfn.save({"a": a})
    assert data == safetensors.numpy.save({"a": np.ascontiguousarray(a)})
    assert_same_array(safetensors.numpy.load(data)["a"], np.ascontiguousarray(a))
    b = np.arange(20, dtype=np.int16)[::2]  # strided view
    assert_same_array(tfn.load(tfn.save({"b": b}))["b"], b.copy())


def test_save_refuses_unsupported_dtype():
    with pytest.raises(ValueError):
        tfn.save({"a": np.zeros(2, dtype=np.float128 if hasattr(np, "float128") else np.clongdouble)})
    with pytest.raises(ValueError):
        tfn.save({"a": np.array(["x"])})


def test_metadata_and_keys(np_st_file):
    path = np_st_file({"z": np.zeros(3, np.uint8), "a": np.ones(2, np.float64)}, metadata={"k": "v"})
    with tensorferry.safe_open(path, framework="np") as f, safetensors.safe_open(path, "np") as ref:
        assert f.metadata() == ref.metadata() == {"k": "v"}
        assert f.keys() == ref.keys() == ["a", "z"]
        for k in f.keys():
            assert_same_array(f.get_tensor(k), ref.get_tensor(k), k)


def test_loaded_arrays_are_independent(np_st_file):
    path = np_st_file({"a": random_array((10,), np.float32), "b": random_array((10,), np.float32, seed=1)})
    got = tfn.load_file(path)
    keep = got["b"].copy()
    got["a"][:] = 0
    assert_same_array(got["b"], keep)
    again = tfn.load_file(path)
    assert_same_array(again["a"], safetensors.numpy.load_file(path)["a"])


def test_bf16_without_numpy_type_is_an_error_not_garbage(st_file):
    import torch
    try:
        import ml_dtypes  # noqa: F401
        pytest.skip("ml_dtypes is installed: bf16 has a numpy type")
    except ImportError:
        pass
    path = st_file({"w": torch.ones(2, dtype=torch.bfloat16)})
    assert read_header(path)["w"]["dtype"] == "BF16"
    with pytest.raises(tensorferry.UnsupportedError, match="BF16"):
        tfn.load_file(path)


def test_numpy_refuses_cuda_device(np_st_file):
    path = np_st_file({"a": np.zeros(2, np.float32)})
    with pytest.raises(ValueError):
        tensorferry.safe_open(path, framework="np", device="cuda")
