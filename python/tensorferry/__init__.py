"""tensorferry: move tensors between storage and GPU memory as fast as the hardware allows.

Change one import to switch from safetensors::

    from tensorferry.torch import load_file, save_file   # was: from safetensors.torch import ...
    from tensorferry import safe_open                     # was: from safetensors import safe_open

Raw flat files (as dstorage-gpu users know them): ``tensorferry.torch.load_tensor``,
``load_tensors``; DeepNVMe-style handles: :class:`Handle` with ``pread``/``pwrite`` and
their async forms. JAX and CuPy: ``safe_open(..., framework="cupy" | "jax")`` or
``cupy.from_dlpack(tensor)`` on any tensor this package returns.
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from . import _native
from ._core import Loader, Saver, default_loader, default_saver
from .errors import (CancelledError, CudaError, InvalidArgumentError, InvalidFileError, NotFoundError,
                     OutOfMemoryError, PermissionDeniedError, ReadError, TensorferryError,
                     TensorNotFoundError, UnsupportedError, WriteError)

__version__ = _native.__version__


def _adapter(framework: str):
    fw = framework.lower()
    if fw in ("pt", "torch", "pytorch", "cupy", "cp", "jax", "flax"):
        from .torch import _AD
        return _AD
    if fw in ("np", "numpy"):
        from .numpy import _AD
        return _AD
    raise InvalidArgumentError(f"framework {framework!r}: expected pt, np, cupy or jax")


def _convert(framework: str, t: Any) -> Any:
    fw = framework.lower()
    if fw in ("cupy", "cp"):
        import cupy
        return cupy.from_dlpack(t)
    if fw in ("jax", "flax"):
        import jax.dlpack
        if getattr(t, "is_cuda", False):
            # JAX may leave another device current; torch exports only from the tensor's.
            import torch
            with torch.cuda.device(t.device):
                return jax.dlpack.from_dlpack(t)
        return jax.dlpack.from_dlpack(t)
    return t


class safe_open:  # noqa: N801 - the name safetensors uses
    """Drop-in for ``safetensors.safe_open``: a checkpoint (file, index or directory) to
    read tensors from one by one, or slices of them (reading only the bytes needed).

    ``framework``: ``"pt"``, ``"np"``, or ``"cupy"`` / ``"jax"`` (through DLPack, needs
    torch). ``device``: as for :func:`tensorferry.torch.load_file`. ``verify=True``: each
    tensor that ``get_tensor`` / ``get_tensors`` loads is checked against the xxh3-64 its
    file records (saved with ``checksums=True``); verify applies to whole-tensor loads
    only, slices read through ``get_slice`` are not verified. ``storage_options``: object
    store options (``object_store`` config keys) for this checkpoint, over the environment
    and over the options of ``loader``.
    """

    def __init__(self, filename: Any, framework: str = "pt", device: Any = "cpu", *,
                 loader: Loader | None = None, verify: bool = False,
                 storage_options: dict[str, str] | None = None) -> None:
        from . import _core
        self._framework = framework
        self._ad = _adapter(framework)
        loader = _core.loader_for(loader, storage_options)
        self._layout = _core.Layout(filename, _core.storage_options_of(loader))
        self._device = self._ad.device(device)
        self._loader = loader
        self._verify = bool(verify)

    def __enter__(self) -> "safe_open":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def keys(self) -> list[str]:
        """Tensor names, sorted."""
        return self._layout.keys()

    def offset_keys(self) -> list[str]:
        """Tensor names in the order of their data in the file(s)."""
        return self._layout.offset_keys()

    def metadata(self) -> dict[str, str] | None:
        """The ``__metadata__`` map (for a sharded checkpoint, the index's metadata)."""
        return self._layout.metadata_

    def get_tensor(self, name: str) -> Any:
        """Loads one tensor."""
        from . import _core
        t = _core.load_layout(self._ad, self._layout, [name], self._device, self._loader,
                              verify=self._verify)[name]
        return _convert(self._framework, t)

    def get_tensors(self, names: list[str] | None = None) -> dict[str, Any]:
        """Loads several tensors (all, in file order as safetensors gives them, when
        ``names`` is None) in one submission."""
        from . import _core
        out = _core.load_layout(self._ad, self._layout, names if names is not None else self.offset_keys(),
                                self._device, self._loader, verify=self._verify)
        return {k: _convert(self._framework, v) for k, v in out.items()}

    def get_slice(self, name: str) -> "_Slice":
        """A lazy view of one tensor; index it (``[a:b]``, ``[:, c:d]``) to read a part.
        Slices are not verified, even with ``verify=True`` (checksums cover whole tensors)."""
        self._layout.entry(name)
        return _Slice(self, name)


class _Slice:
    """What ``safe_open.get_slice`` returns: shape and dtype, and indexing that reads
    only the rows (the bounding box of the index) it needs."""

    def __init__(self, owner: safe_open, name: str) -> None:
        self._o, self._name = owner, name
        self._dtype, self._shape, self._file, self._offset, self._len, _, _ = owner._layout.entry(name)

    def get_shape(self) -> list[int]:
        return list(self._shape)

    def get_dtype(self) -> str:
        return self._dtype

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d tensor")
        return self._shape[0]

    def __getitem__(self, index: Any) -> Any:
        from . import _core
        o = self._o
        box, residual = _core.normalize_index(index, self._shape)
        bits = _bits(self._dtype)
        if bits % 8 and box != [(0, n) for n in self._shape]:
            raise InvalidArgumentError(f"slicing sub-byte dtype {self._dtype} is not supported; load it whole")
        box_shape = [b - a for a, b in box]
        out = o._ad.empty(box_shape, self._dtype, o._device)
        runs = _core.box_extents(box, self._shape, bits, self._offset)
        if runs:
            loader = o._loader or default_loader()
            extents = [(self._file, off, ln, 0, dst) for off, ln, dst in runs]
            loader.read_into(o._layout.files, extents, [o._ad.target(out)], o._ad.stream(o._device))
        res = out[residual] if residual else out
        if hasattr(res, "is_contiguous") and not res.is_contiguous():
            res = res.contiguous()
        elif hasattr(res, "flags") and not res.flags.c_contiguous:
            import numpy as np
            res = np.ascontiguousarray(res)
        return _convert(o._framework, res)


def _bits(dtype: str) -> int:
    return {"BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8,
            "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16,
            "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64,
            "U64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}[dtype]


class Handle:
    """DeepNVMe-style handle for raw reads into and writes out of existing tensors
    (torch tensors on CPU or CUDA, or numpy arrays).

    ``pread``/``pwrite`` block; ``async_pread``/``async_pwrite`` return a future whose
    ``wait()`` returns the byte count (or raises); ``wait()`` waits for all of them.
    """

    def __init__(self, engine: str | None = None, threads: int | None = None,
                 staging_size: int | None = None, slots: int | None = None, workers: int = 4) -> None:
        self._loader = Loader(engine, threads, staging_size, slots)
        self._saver = Saver(threads, staging_size, slots)
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="tensorferry-handle")
        self._pending: list[_Future] = []

    @staticmethod
    def _ad(tensor: Any):
        mod = type(tensor).__module__
        return _adapter("np" if mod.startswith("numpy") else "pt")

    def pread(self, tensor: Any, path: Any, offset: int = 0) -> int:
        """Fills ``tensor`` (all its bytes) from ``path`` at byte ``offset``."""
        ad = self._ad(tensor)
        target = ad.target(tensor)
        n = target[3]
        if n:
            dev = getattr(tensor, "device", "cpu")
            self._loader.read_into([os.fspath(path)], [(0, int(offset), n, 0, 0)], [target],
                                   ad.stream(dev) if target[0] == "cuda" else None)
        return n

    def pwrite(self, tensor: Any, path: Any, offset: int = 0) -> int:
        """Writes ``tensor``'s bytes to ``path`` at byte ``offset`` (creating the file, never
        truncating it; not synced). CUDA tensors are written from the device through
        pinned staging, after the work queued on the current stream."""
        ad = self._ad(tensor)
        kind, dev, ptr, n, owner = ad.source(tensor)
        if kind == "cuda":
            ad.sync([dev])
        self._saver.write_at(os.fspath(path), int(offset), (kind, dev, ptr, n))
        del owner  # alive until the write is done
        return n

    def async_pread(self, tensor: Any, path: Any, offset: int = 0) -> "_Future":
        return self._submit(self.pread, tensor, path, offset)

    def async_pwrite(self, tensor: Any, path: Any, offset: int = 0) -> "_Future":
        return self._submit(self.pwrite, tensor, path, offset)

    def _submit(self, fn, *args) -> "_Future":
        f = _Future(self._pool.submit(fn, *args))
        self._pending.append(f)
        return f

    def wait(self) -> int:
        """Waits for every async operation; returns how many there were. Raises the first
        error after all have finished."""
        pending, self._pending = self._pending, []
        first = None
        for f in pending:
            try:
                f.wait()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                first = first or e
        if first is not None:
            raise first
        return len(pending)

    def close(self) -> None:
        self.wait()
        self._pool.shutdown()

    def __enter__(self) -> "Handle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Future:
    """An async operation; ``wait()`` returns its byte count or raises its error."""

    def __init__(self, f: Future) -> None:
        self._f = f

    def wait(self, timeout: float | None = None) -> int:
        return self._f.result(timeout)

    def done(self) -> bool:
        return self._f.done()


def doctor() -> dict:
    """What this machine offers: io_uring, CUDA devices, GDS state, cores."""
    return _native.doctor()


def drop_cache(path: Any) -> None:
    """Drops a file from the page cache (for cold-load benchmarks; no root needed)."""
    _native.drop_cache(os.fspath(path))


__all__ = [
    "safe_open", "Loader", "Saver", "Handle", "default_loader", "default_saver", "doctor", "drop_cache",
    "__version__", "TensorferryError", "NotFoundError", "PermissionDeniedError", "InvalidFileError",
    "TensorNotFoundError", "ReadError", "WriteError", "InvalidArgumentError", "UnsupportedError", "CudaError",
    "OutOfMemoryError", "CancelledError",
]


def __getattr__(name: str) -> Any:
    # The raw-file API at top level too (as dstorage-gpu has it); imports torch lazily.
    if name in ("load_tensor", "load_tensors", "load_tensor_timed"):
        from . import torch as _t
        return getattr(_t, name)
    raise AttributeError(f"module 'tensorferry' has no attribute {name!r}")
