"""Drop-in for ``safetensors.numpy``: ``load_file``, ``load``, ``save_file``, ``save``.

bfloat16 and float8 need the ``ml_dtypes`` package (as NumPy has no such types); without
it such tensors raise :class:`tensorferry.errors.UnsupportedError`.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import _core
from ._core import Loader, ProgressCallback, Saver
from .errors import InvalidArgumentError, OutOfMemoryError, UnsupportedError

_BY_NAME: dict[str, Any] = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
    "F16": np.float16, "U32": np.uint32, "I32": np.int32, "F32": np.float32, "U64": np.uint64,
    "I64": np.int64, "F64": np.float64, "C64": np.complex64,
}
try:  # optional: bf16 / fp8 as ml_dtypes defines them
    import ml_dtypes as _ml

    for _name, _attr in (("BF16", "bfloat16"), ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
                         ("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2FNUZ", "float8_e5m2fnuz")):
        if hasattr(_ml, _attr):
            _BY_NAME[_name] = getattr(_ml, _attr)
except ImportError:
    pass
_BY_DTYPE = {np.dtype(v): k for k, v in _BY_NAME.items()}


def _np_dtype(name: str):
    try:
        return np.dtype(_BY_NAME[name])
    except KeyError:
        raise UnsupportedError(f"dtype {name} has no numpy equivalent (install ml_dtypes for bf16/fp8)") from None


class _Numpy(_core.Adapter):
    name = "np"

    def device(self, device: Any) -> str:
        if device not in ("cpu", None):
            raise InvalidArgumentError(f"numpy arrays live in host memory; device {device!r} is not supported")
        return "cpu"

    def empty(self, shape, dtype, device):
        try:
            return np.empty(tuple(shape), dtype=_np_dtype(dtype))
        except MemoryError as e:
            raise OutOfMemoryError(str(e)) from None

    def target(self, a: np.ndarray):
        if not a.flags.c_contiguous or not a.flags.writeable:
            raise InvalidArgumentError("array must be C-contiguous and writeable")
        return ("cpu", 0, a.ctypes.data, a.nbytes)

    def from_bytes(self, data, dtype, shape, device):
        return np.frombuffer(bytes(data), dtype=_np_dtype(dtype)).reshape(tuple(shape)).copy()

    def to_host_bytes(self, a: np.ndarray) -> memoryview:
        return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))

    def describe(self, a):
        if not isinstance(a, np.ndarray):
            raise InvalidArgumentError(f"expected a numpy.ndarray, got {type(a).__name__}")
        try:
            name = _BY_DTYPE[a.dtype]
        except KeyError:
            raise InvalidArgumentError(f"dtype {a.dtype} cannot be stored in safetensors") from None
        return name, list(a.shape)

    def source(self, a: np.ndarray):
        a = np.ascontiguousarray(a)
        return "cpu", 0, a.ctypes.data, a.nbytes, a


_AD = _Numpy()


def load_file(filename: Any, *, loader: Loader | None = None, progress: bool = False,
              on_progress: ProgressCallback | None = None, verify: bool = False,
              storage_options: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """Loads a safetensors file (or sharded checkpoint) into numpy arrays. ``verify``:
    check each array against the xxh3-64 its file records (saved with ``checksums=True``).
    ``storage_options``: object store options for this call (as for
    :func:`tensorferry.torch.load_file`)."""
    loader = _core.loader_for(loader, storage_options)
    layout = _core.Layout(filename, _core.storage_options_of(loader))
    return _core.load_layout(_AD, layout, layout.offset_keys(), "cpu", loader, progress, on_progress, verify)


def load(data: bytes) -> dict[str, np.ndarray]:
    """Deserializes safetensors bytes."""
    return _core.load_bytes(_AD, data, "cpu")


def save_file(tensors: dict[str, np.ndarray], filename: Any, metadata: dict[str, str] | None = None, *,
              saver: Saver | None = None, progress: bool = False,
              on_progress: ProgressCallback | None = None, checksums: bool = False,
              storage_options: dict[str, str] | None = None) -> None:
    """Saves arrays as a safetensors file (the reference layout), durably: it appears
    under ``filename`` only once whole and synced. ``checksums=True`` records an xxh3-64
    of each array's bytes in the metadata, for ``load_file(..., verify=True)``.
    ``storage_options``: object store options for this call, over those of ``saver``."""
    _core.save_tensors(_AD, tensors, filename, metadata, _core.saver_for(saver, storage_options), progress,
                       on_progress, checksums)


def save(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    """Serializes arrays to safetensors bytes."""
    return _core.save_bytes(_AD, tensors, metadata)


__all__ = ["load_file", "load", "save_file", "save"]
