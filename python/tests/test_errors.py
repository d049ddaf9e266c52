"""Failures raise the documented Python exceptions, naming the file, and never a Rust
panic (pyo3's PanicException derives from BaseException only: `pytest.raises(Exception)`
does not catch it, so a panic fails these tests)."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import safetensors.torch
import torch

import tensorferry
import tensorferry.numpy as tfn
import tensorferry.torch as tft
from conftest import _cuda_skip_reason, assert_same_dict, random_tensor

# Every way to open a checkpoint; each must fail the same way.
OPENERS = {
    "torch.load_file": lambda p: tft.load_file(p),
    "numpy.load_file": lambda p: tfn.load_file(p),
    "safe_open": lambda p: tensorferry.safe_open(p, framework="pt"),
    "safe_open-np": lambda p: tensorferry.safe_open(p, framework="np"),
}


@pytest.fixture(params=list(OPENERS))
def opener(request):
    return OPENERS[request.param]


@pytest.fixture
def good_bytes() -> bytes:
    return safetensors.torch.save({"a": random_tensor((100,), torch.float32), "b": torch.ones(3, dtype=torch.int8)})


def _header_file(tmp_path, header: bytes, data: bytes = b"", name="bad.safetensors", length=None) -> str:
    p = tmp_path / name
    p.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)
    return str(p)


def test_error_hierarchy():
    assert issubclass(tensorferry.NotFoundError, FileNotFoundError)
    assert issubclass(tensorferry.InvalidFileError, ValueError)
    assert issubclass(tensorferry.TensorNotFoundError, KeyError)
    for cls in (tensorferry.NotFoundError, tensorferry.InvalidFileError, tensorferry.TensorNotFoundError,
                tensorferry.ReadError, tensorferry.InvalidArgumentError, tensorferry.UnsupportedError,
                tensorferry.CudaError, tensorferry.OutOfMemoryError, tensorferry.CancelledError,
                tensorferry.PermissionDeniedError):
        assert issubclass(cls, tensorferry.TensorferryError)
        assert issubclass(cls, Exception)


def test_missing_file(tmp_path, opener):
    p = str(tmp_path / "missing.safetensors")
    with pytest.raises(FileNotFoundError) as ei:
        opener(p)
    assert isinstance(ei.value, tensorferry.NotFoundError)
    assert p in str(ei.value)
    assert ei.value.filename == p
    assert ei.value.errno == 2


def test_missing_shard(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(tensorferry.NotFoundError, match="gone.safetensors"):
        tft.load_file(str(tmp_path))


@pytest.mark.parametrize("cut", [1, 10, 400])
def test_truncated_data(tmp_path, opener, good_bytes, cut):
    p = tmp_path / "trunc.safetensors"
    p.write_bytes(good_bytes[:-cut])
    with pytest.raises(tensorferry.InvalidFileError) as ei:
        opener(str(p))
    assert isinstance(ei.value, ValueError)
    assert str(p) in str(ei.value)


@pytest.mark.parametrize("keep", [0, 3, 8, 20])
def test_truncated_header(tmp_path, opener, good_bytes, keep):
    p = tmp_path / "short.safetensors"
    p.write_bytes(good_bytes[:keep])
    with pytest.raises(tensorferry.InvalidFileError) as ei:
        opener(str(p))
    assert str(p) in str(ei.value)


def test_garbage_file(tmp_path, opener):
    p = tmp_path / "garbage.safetensors"
    p.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(tensorferry.InvalidFileError) as ei:
        opener(str(p))
    assert str(p) in str(ei.value)


@pytest.mark.parametrize("length", [(100 << 20) + 1, 1 << 40, (1 << 64) - 1], ids=["100MB+1", "1TB", "u64max"])
def test_header_too_large(tmp_path, opener, length):
    p = _header_file(tmp_path, b"{}", length=length)
    with pytest.raises(tensorferry.InvalidFileError) as ei:
        opener(p)
    assert p in str(ei.value)
    assert isinstance(ei.value, ValueError)


@pytest.mark.parametrize("header", [
    b"not json at all",
    b"[1, 2]",
    b'{"a": 5}',
    b'{"a": {"dtype": "Q99", "shape": [1], "data_offsets": [0, 4]}}',
    b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}',
    b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}',
    b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "b": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}}',
    b'{"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}',
    b'{"a": {"dtype": "F32", "shape": [4294967296, 4294967296], "data_offsets": [0, 4]}}',
    b'{"__metadata__": {"k": 1}}',
], ids=["not-json", "array", "entry-not-object", "bad-dtype", "size-mismatch", "reversed-offsets", "overlap",
        "neg-shape", "shape-overflow", "metadata-not-str"])
def test_invalid_headers(tmp_path, opener, header):
    p = _header_file(tmp_path, header, data=b"\0" * 8)
    with pytest.raises(tensorferry.InvalidFileError) as ei:
        opener(p)
    assert p in str(ei.value)


def test_invalid_bytes_to_load():
    for data in (b"", b"\x01", struct.pack("<Q", 1 << 40) + b"{}", struct.pack("<Q", 5) + b"hello"):
        with pytest.raises(tensorferry.InvalidFileError):
            tft.load(data)
        with pytest.raises(tensorferry.InvalidFileError):
            tfn.load(data)
    with pytest.raises(ValueError):
        tft.load("not bytes")  # type: ignore[arg-type]


def test_bad_index_json(tmp_path):
    p = tmp_path / "model.safetensors.index.json"
    p.write_text("{nope")
    with pytest.raises(tensorferry.InvalidFileError) as ei:
        tft.load_file(str(p))
    assert str(p) in str(ei.value)


def test_unknown_tensor(st_file):
    path = st_file({"a": torch.zeros(2)})
    for fw in ("pt", "np"):
        with tensorferry.safe_open(path, fw) as f:
            with pytest.raises(KeyError) as ei:
                f.get_tensor("nope")
            assert isinstance(ei.value, tensorferry.TensorNotFoundError)
            assert "nope" in str(ei.value) and path in str(ei.value)
            with pytest.raises(tensorferry.TensorNotFoundError):
                f.get_slice("nope")
            with pytest.raises(tensorferry.TensorNotFoundError):
                f.get_tensors(["a", "nope"])


@pytest.mark.parametrize("dev", ["bogus", "cuda:x", "meta", -1, None, 3.5], ids=str)
def test_bad_device(st_file, dev):
    path = st_file({"a": torch.zeros(2)})
    with pytest.raises(ValueError):
        tft.load_file(path, device=dev)
    with pytest.raises(ValueError):
        tensorferry.safe_open(path, "pt", device=dev)


def test_cuda_device_without_cuda_is_a_clear_error(st_file):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    path = st_file({"a": torch.zeros(2)})
    for dev in ("cuda", "cuda:0", 0, torch.device("cuda", 0)):
        with pytest.raises(tensorferry.UnsupportedError):
            tft.load_file(path, device=dev)


@pytest.mark.parametrize("engine", ["x", "", "uring2", "PREADX"])
def test_bad_engine(engine):
    with pytest.raises(ValueError, match="engine"):
        tensorferry.Loader(engine=engine)
    with pytest.raises(ValueError, match="engine"):
        tensorferry.Handle(engine=engine)


def test_engine_names_are_case_insensitive():
    assert tensorferry.Loader(engine="PREAD").options["engine"] == "pread"


def test_directory_without_safetensors(tmp_path, opener):
    d = tmp_path / "empty"
    d.mkdir()
    (d / "README.md").write_text("hi")
    with pytest.raises(tensorferry.TensorferryError) as ei:
        opener(str(d))
    assert isinstance(ei.value, (ValueError, FileNotFoundError))
    assert str(d) in str(ei.value)


def test_path_must_not_be_bytes_data(good_bytes):
    with pytest.raises(ValueError, match="load"):
        tft.load_file(good_bytes)


def test_bad_save_arguments(tmp_path):
    with pytest.raises(ValueError):
        tft.save([torch.zeros(1)])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        tft.save({"a": 1})  # type: ignore[dict-item]
    with pytest.raises(ValueError):
        tft.save({1: torch.zeros(1)})  # type: ignore[dict-item]
    with pytest.raises(ValueError):
        tft.save({"a": torch.zeros(1)}, metadata={"k": 1})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="sparse"):
        tft.save({"a": torch.zeros(2, 2).to_sparse()})
    with pytest.raises(ValueError):
        tft.save({"a": torch.zeros(1, dtype=torch.complex128)})
    with pytest.raises(ValueError):
        tfn.save({"a": np.zeros(1, dtype=np.complex128)})
    with pytest.raises(OSError):
        tft.save_file({"a": torch.zeros(1)}, str(tmp_path / "no" / "such" / "dir.safetensors"))


def test_low_level_read_into_checks_extents(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(b"\0" * 64)
    t = torch.empty(16, dtype=torch.uint8)
    target = ("cpu", 0, t.data_ptr(), 16)
    loader = tensorferry.Loader()
    with pytest.raises(ValueError):
        loader.read_into([str(p)], [(1, 0, 16, 0, 0)], [target])  # no file 1
    with pytest.raises(ValueError):
        loader.read_into([str(p)], [(0, 0, 16, 1, 0)], [target])  # no target 1
    with pytest.raises(ValueError):
        loader.read_into([str(p)], [(0, 0, 16, 0, 8)], [target])  # past the target's end
    with pytest.raises(ValueError):
        loader.read_into([str(p)], [(0, 0, 16, 0, 0)], [("tpu", 0, t.data_ptr(), 16)])
    with pytest.raises(tensorferry.ReadError, match="f.bin"):
        loader.read_into([str(p)], [(0, 60, 16, 0, 0)], [target])  # past the file's end
    with pytest.raises(Exception):
        loader.read_into([str(p)], [(0, 2**64 - 1, 16, 0, 0)], [target])


def test_progress_callback_exception_propagates(st_file):
    path = st_file({"a": torch.zeros(100)})

    def boom(done, total):
        raise ZeroDivisionError("from callback")

    with pytest.raises(ZeroDivisionError, match="from callback"):
        tft.load_file(path, on_progress=boom)
    assert_loads_fine = tft.load_file(path)
    assert torch.equal(assert_loads_fine["a"], torch.zeros(100))


def test_out_of_memory_part_way_frees_what_was_allocated(st_file, monkeypatch):
    """The destination runs out of room at the third tensor: an OutOfMemoryError naming
    the file and tensor, and the two tensors allocated before it are freed at once (not
    kept alive by the traceback)."""
    import gc
    import weakref

    path = st_file({f"t{i}": random_tensor((1000,), torch.float32, seed=i) for i in range(5)})
    allocated = []
    real_empty = tft._AD.empty

    def empty(shape, dtype, device):
        if len(allocated) == 2:
            raise tensorferry.OutOfMemoryError("CUDA out of memory (simulated)")
        t = real_empty(shape, dtype, device)
        allocated.append(weakref.ref(t))
        return t

    monkeypatch.setattr(tft._AD, "empty", empty)
    gc.disable()  # only reference counting may free them
    try:
        with pytest.raises(tensorferry.OutOfMemoryError) as info:
            tft.load_file(path)
        assert path in str(info.value) and "'t2'" in str(info.value), info.value
        assert "simulated" in str(info.value)
        assert len(allocated) == 2 and all(r() is None for r in allocated), "allocated tensors kept alive"
    finally:
        gc.enable()
    monkeypatch.undo()
    assert_same_dict(tft.load_file(path), safetensors.torch.load_file(path))


@pytest.mark.gpu
def test_cuda_out_of_memory_part_way_gives_the_memory_back(st_file):
    """A real CUDA out of memory: the GPU is filled until only about two of four 256 MiB
    tensors fit; the load fails naming the file, torch's allocated memory is back where
    it was, and once there is room the same load works."""
    if (reason := _cuda_skip_reason()) is not None:
        pytest.skip(f"no CUDA device: {reason}")
    each = 256 << 20
    ref = {f"w{i}": random_tensor((each // 4,), torch.float32, seed=i) for i in range(4)}
    path = st_file(ref)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    free, _ = torch.cuda.mem_get_info()
    filler = torch.empty(free - int(2.5 * each), dtype=torch.uint8, device="cuda")
    with_filler = torch.cuda.memory_allocated()  # the filler, as the allocator rounded it
    try:
        with pytest.raises(tensorferry.OutOfMemoryError) as info:
            tft.load_file(path, device="cuda")
        assert path in str(info.value), info.value
        assert torch.cuda.memory_allocated() == with_filler
    finally:
        del filler
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() == before
    assert_same_dict(tft.load_file(path, device="cuda"), ref, device="cuda")


def test_a_load_that_fails_part_way_frees_its_tensors(tmp_path):
    """A read error after the tensors were allocated (a file cut short between opening
    and reading) leaves none of them alive."""
    import gc
    import weakref

    ref = {f"t{i}": random_tensor((50_000,), torch.float32, seed=i) for i in range(4)}
    path = str(tmp_path / "m.safetensors")
    safetensors.torch.save_file(ref, path)
    seen = []
    real_read_into = tensorferry.Loader.read_into

    def read_into(self, files, extents, targets, *args, **kw):
        import os
        os.truncate(files[0], os.path.getsize(files[0]) - 1000)  # the file shrinks under us
        seen.extend(targets)
        return real_read_into(self, files, extents, targets, *args, **kw)

    allocated = []
    real_empty = tft._AD.empty

    def empty(*a):
        t = real_empty(*a)
        allocated.append(weakref.ref(t))
        return t

    gc.disable()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(tensorferry.Loader, "read_into", read_into)
            mp.setattr(tft._AD, "empty", empty)
            with pytest.raises(tensorferry.TensorferryError) as info:
                tft.load_file(path)
        assert path in str(info.value), info.value
        assert len(allocated) == 4 and seen, "the load did not get as far as reading"
        assert all(r() is None for r in allocated), "a failed load kept its tensors alive"
    finally:
        gc.enable()


def test_adapters_turn_allocation_failures_into_out_of_memory_errors():
    """torch's CPU allocator and numpy fail with their own errors (RuntimeError,
    MemoryError); both become OutOfMemoryError, which load_file then names the file by."""
    import tensorferry.numpy as tfn_mod

    with pytest.raises(tensorferry.OutOfMemoryError, match="allocate"):
        tft._AD.empty((1 << 60,), "U8", torch.device("cpu"))
    with pytest.raises(tensorferry.OutOfMemoryError):
        tfn_mod._AD.empty((1 << 60,), "U8", None)
