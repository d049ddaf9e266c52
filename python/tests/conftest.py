"""Shared fixtures: checkpoints written by the REFERENCE implementation (safetensors), the
`device` parametrisation (cpu, and cuda where present) and small helpers."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

import tensorferry

# --- dtypes ---------------------------------------------------------------------------

_TORCH_CANDIDATES = ["bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                     "float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
                     "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "complex64"]


def _reference_roundtrips(dtype) -> bool:
    try:
        t = torch.zeros(2, dtype=dtype)
        return safetensors.torch.load(safetensors.torch.save({"t": t}))["t"].dtype == dtype
    except Exception:  # noqa: BLE001 - this safetensors / torch lacks the dtype
        return False


# Every torch dtype that the installed torch has and the installed safetensors writes and
# reads back, so that the matrix follows the versions installed.
TORCH_DTYPES: list[torch.dtype] = [getattr(torch, n) for n in _TORCH_CANDIDATES
                                   if hasattr(torch, n) and _reference_roundtrips(getattr(torch, n))]

NUMPY_DTYPES: list[np.dtype] = [np.dtype(n) for n in (
    "bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
    "float16", "float32", "float64", "complex64")]

# Shapes: scalar, empty, empty with a zero inner dim, one element, odd byte counts, 3-D.
SHAPES: list[tuple[int, ...]] = [(), (0,), (3, 0), (1,), (7,), (3, 5), (2, 3, 5)]


def random_tensor(shape, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A tensor of `dtype` with random bit patterns (NaN payloads and all, so that any
    conversion on the way shows up in a bitwise comparison); bools are 0/1."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for d in shape:
        numel *= d
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=g, dtype=torch.uint8).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(tuple(shape))


def random_array(shape, dtype, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    return rng.integers(0, 256, size=n * dtype.itemsize, dtype=np.uint8).view(dtype).reshape(shape)


def tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous().reshape(-1)
    if t.numel() == 0:
        return b""
    return t.view(torch.uint8).numpy().tobytes()


def assert_same_tensor(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """Same dtype, shape and bits (the device of `a` is not compared)."""
    assert isinstance(a, torch.Tensor), what
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert tuple(a.shape) == tuple(b.shape), f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert tensor_bytes(a) == tensor_bytes(b), f"{what}: values differ"


def assert_same_dict(got: dict, want: dict, device: str | None = None, *, order: bool = True) -> None:
    """Same keys (in the same order unless `order` is False) and same tensors."""
    if order:
        assert list(got) == list(want), "key order differs"
    else:
        assert sorted(got) == sorted(want), "keys differ"
    for k in want:
        assert_same_tensor(got[k], want[k], k)
        if device is not None:
            assert got[k].device.type == torch.device(device).type, k


def read_header(path) -> dict:
    """The JSON header of a safetensors file, parsed here independently of both libraries."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


def file_order(path) -> list[str]:
    """Tensor names in the order of their data in the file; names break ties (between
    empty tensors, which share an offset)."""
    h = read_header(path)
    h.pop("__metadata__", None)
    return sorted(h, key=lambda k: (h[k]["data_offsets"][0], k))


def assert_reference_order(got: dict, want: dict, path) -> None:
    """`got` is in file order, as `want` (safetensors) is. safetensors orders empty tensors
    (equal offsets) arbitrarily, so those are compared by position only among the rest."""
    assert list(got) == file_order(path)
    h = read_header(path)
    nonempty = {k for k, v in h.items() if k != "__metadata__" and v["data_offsets"][0] != v["data_offsets"][1]}
    assert [k for k in got if k in nonempty] == [k for k in want if k in nonempty]
    assert sorted(got) == sorted(want)


def assert_same_array(a: np.ndarray, b: np.ndarray, what: str = "") -> None:
    assert isinstance(a, np.ndarray), f"{what}: {type(a)}"
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), f"{what}: values differ"


# --- fixtures -------------------------------------------------------------------------


def _cuda_skip_reason() -> str | None:
    if torch.cuda.is_available():
        return None
    reason = "torch.cuda.is_available() is False"
    if not torch.backends.cuda.is_built():
        reason += " (torch built without CUDA)"
    native = tensorferry.doctor().get("cuda")
    if native:
        reason += f"; tensorferry: {native}"
    return reason


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    """Runs a test body on the host and, where a CUDA device exists, on the GPU."""
    if request.param == "cuda":
        reason = _cuda_skip_reason()
        if reason is not None:
            pytest.skip(f"no CUDA device: {reason}")
    return request.param


@pytest.fixture
def st_file(tmp_path):
    """Factory: writes `tensors` with safetensors.torch.save_file, returns the path."""
    counter = iter(range(1 << 30))

    def make(tensors: dict, metadata: dict | None = None, name: str | None = None) -> str:
        path = str(tmp_path / (name or f"ref{next(counter)}.safetensors"))
        safetensors.torch.save_file(tensors, path, metadata=metadata)
        return path

    return make


@pytest.fixture
def np_st_file(tmp_path):
    """Factory: writes `arrays` with safetensors.numpy.save_file, returns the path."""
    counter = iter(range(1 << 30))

    def make(arrays: dict, metadata: dict | None = None, name: str | None = None) -> str:
        path = str(tmp_path / (name or f"refnp{next(counter)}.safetensors"))
        safetensors.numpy.save_file(arrays, path, metadata=metadata)
        return path

    return make


@pytest.fixture
def all_dtypes_tensors() -> dict[str, torch.Tensor]:
    """One tensor per supported dtype and shape edge case."""
    out = {}
    for i, dt in enumerate(TORCH_DTYPES):
        for j, shape in enumerate(SHAPES):
            name = f"{str(dt).replace('torch.', '')}.{'x'.join(map(str, shape)) or 'scalar'}"
            out[name] = random_tensor(shape, dt, seed=i * 100 + j)
    return out


@pytest.fixture
def all_dtypes_file(st_file, all_dtypes_tensors) -> str:
    return st_file(all_dtypes_tensors, metadata={"format": "pt", "note": "all dtypes"})


def write_sharded(directory, tensors: dict, split: int = 2, metadata: dict | None = None) -> str:
    """Writes `tensors` as `split` shards plus model.safetensors.index.json, as HF
    transformers does; returns the index path."""
    names = list(tensors)
    per = (len(names) + split - 1) // split
    weight_map, total = {}, 0
    for s in range(split):
        shard = f"model-{s + 1:05d}-of-{split:05d}.safetensors"
        part = {n: tensors[n] for n in names[s * per:(s + 1) * per]}
        safetensors.torch.save_file(part, os.path.join(directory, shard), metadata={"format": "pt"})
        for n, t in part.items():
            weight_map[n] = shard
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total, **(metadata or {})}, "weight_map": weight_map}
    path = os.path.join(directory, "model.safetensors.index.json")
    with open(path, "w") as f:
        json.dump(index, f, indent=2)
    return path


@pytest.fixture
def sharded(tmp_path):
    """A 2-shard checkpoint in its own directory: (index path, directory, tensors)."""
    d = tmp_path / "sharded"
    d.mkdir()
    tensors = {f"layer.{i}.weight": random_tensor((i + 1, 3), torch.float32, seed=i) for i in range(5)}
    tensors["embed"] = random_tensor((4, 4), torch.bfloat16, seed=9)
    tensors["flag"] = random_tensor((), torch.int64, seed=10)
    index = write_sharded(str(d), tensors)
    return index, str(d), tensors


@pytest.fixture
def small_loader() -> tensorferry.Loader:
    """A loader with tiny staging, so that loads go through many slot turns."""
    return tensorferry.Loader(staging_size=8192, slots=3)
