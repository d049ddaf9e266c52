"""Drop-in for ``safetensors.torch``: ``load_file``, ``load``, ``save_file``, ``save``,
``save_sharded`` (Hugging Face's sharded layout), plus the raw-file API (``load_tensor``, ``load_tensors``, ``load_tensor_timed``).

Every tensor returned is allocated by PyTorch's own allocator on the target device and
owns its memory (no staging buffer is aliased, no ``clone()`` is needed). CUDA tensors
are complete when a call returns: the copies are synchronised, so they are ready on
every stream, and they start only after work already queued on the current stream.
"""
from __future__ import annotations

import os
import time
from typing import Any, Sequence

import torch

from . import _core, _native
from ._core import Loader, ProgressCallback, Saver, default_loader
from .errors import InvalidArgumentError, OutOfMemoryError, UnsupportedError

_BY_NAME: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32, "F32": torch.float32,
    "F64": torch.float64, "I64": torch.int64, "C64": torch.complex64,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"),
                     ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
                     ("F8_E8M0", "float8_e8m0fnu"), ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
                     ("F8_E5M2FNUZ", "float8_e5m2fnuz")):
    if hasattr(torch, _attr):
        _BY_NAME[_name] = getattr(torch, _attr)
_BY_DTYPE = {v: k for k, v in _BY_NAME.items()}


def _torch_dtype(name: str) -> torch.dtype:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise UnsupportedError(f"dtype {name} has no torch equivalent in torch {torch.__version__}") from None


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, str):
        return _native_name(dtype)
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise InvalidArgumentError(f"dtype {dtype} cannot be stored in safetensors") from None


def _native_name(s: str) -> str:
    s2 = s.replace("torch.", "")
    if hasattr(torch, s2) and isinstance(getattr(torch, s2), torch.dtype):
        return _dtype_name(getattr(torch, s2))
    return s.upper()


def _device(device: Any) -> torch.device:
    try:
        # an int is a CUDA ordinal, as in torch
        d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidArgumentError(f"device {device!r}: {e}") from None
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise UnsupportedError(f"device {device!r}: torch sees no CUDA device")
        if d.index is None:
            d = torch.device("cuda", torch.cuda.current_device())
    elif d.type != "cpu":
        raise InvalidArgumentError(f"device {device!r}: tensorferry loads to cpu or cuda")
    return d


_TORCH_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


class _Torch(_core.Adapter):
    name = "pt"

    def device(self, device: Any) -> torch.device:
        return _device(device)

    def empty(self, shape, dtype, device):
        try:
            return torch.empty(tuple(shape), dtype=_torch_dtype(dtype), device=device)
        except _TORCH_OOM as e:
            raise OutOfMemoryError(str(e).split("\n")[0]) from None
        except RuntimeError as e:  # the CPU allocator's OOM is a plain RuntimeError
            if "can't allocate memory" not in str(e):
                raise
            raise OutOfMemoryError(str(e).split("\n")[0]) from None

    def target(self, t: torch.Tensor):
        if not t.is_contiguous():
            raise InvalidArgumentError("tensor must be contiguous")
        kind = "cuda" if t.is_cuda else "cpu"
        if kind == "cpu" and t.device.type != "cpu":
            raise InvalidArgumentError(f"tensors on {t.device} are not supported")
        return (kind, t.device.index or 0, t.data_ptr(), t.numel() * t.element_size())

    def stream(self, device):
        if device.type == "cuda":
            return torch.cuda.current_stream(device).cuda_stream
        return None

    def from_bytes(self, data, dtype, shape, device):
        dt = _torch_dtype(dtype)
        if len(data) == 0:
            return torch.empty(tuple(shape), dtype=dt, device=device)
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dt).reshape(tuple(shape))
        return t.to(device) if device.type != "cpu" else t

    def to_host_bytes(self, t: torch.Tensor) -> memoryview:
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        flat = t.reshape(-1)
        if flat.numel() == 0:
            return memoryview(b"")
        return memoryview(flat.view(torch.uint8).numpy())

    def describe(self, t: torch.Tensor):
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(f"expected a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise InvalidArgumentError(f"sparse tensors ({t.layout}) cannot be saved; call .to_dense() first")
        if not t.is_contiguous():
            raise InvalidArgumentError(
                "a tensor is not contiguous; call .contiguous() on it first (as safetensors requires)")
        return _dtype_name(t.dtype), list(t.shape)

    def source(self, t: torch.Tensor):
        t = t.detach()
        if t.device.type not in ("cpu", "cuda"):
            t = t.cpu()
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        if not t.is_contiguous():
            t = t.contiguous()
        kind = "cuda" if t.is_cuda else "cpu"
        return kind, t.device.index or 0, t.data_ptr(), t.numel() * t.element_size(), t

    def sync(self, devices):
        for d in devices:
            torch.cuda.current_stream(d).synchronize()


_AD = _Torch()


def _check_shared(tensors: dict[str, torch.Tensor]) -> None:
    """Refuses tensors that share memory, as safetensors does."""
    if not isinstance(tensors, dict):
        return  # serialize() says what is wrong
    spans = []
    for name, t in tensors.items():
        # non-tensors and sparse tensors (no data pointer) are refused by describe()
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.numel() == 0:
            continue
        start = t.data_ptr()
        spans.append((t.device, start, start + t.numel() * t.element_size(), name))
    spans.sort(key=lambda s: (str(s[0]), s[1]))
    for a, b in zip(spans, spans[1:]):
        if a[0] == b[0] and b[1] < a[2]:
            raise InvalidArgumentError(
                f"tensors {a[3]!r} and {b[3]!r} share memory; safetensors files cannot hold shared "
                "tensors: save copies (e.g. {k: v.clone() ...}) or drop the duplicates")


def load_file(filename: Any, device: Any = "cpu", *, loader: Loader | None = None, progress: bool = False,
              on_progress: ProgressCallback | None = None, process_group: Any = None,
              shard: Any = None, verify: bool = False,
              storage_options: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Loads a safetensors file, a sharded checkpoint's index, or a directory holding one,
    in one submission. Same keys, in the same order (the order of the data in the file),
    dtypes, shapes and values as ``safetensors.torch.load_file``. ``device``: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, an
    int or a ``torch.device``. ``process_group`` / ``shard``: see
    :func:`tensorferry.distributed.load_file`. ``verify``: check every tensor against the
    xxh3-64 its file records (saved with ``checksums=True``) as its bytes pass through
    staging; a mismatch, or a file without checksums, raises
    :class:`tensorferry.errors.InvalidFileError` naming the file (and tensor). ``storage_options``: object store options (``object_store`` config keys, e.g.
    ``{"aws_endpoint": ..., "aws_access_key_id": ..., "aws_secret_access_key": ...}``)
    for this call, over the environment and over the options of ``loader``."""
    loader = _core.loader_for(loader, storage_options)
    if process_group is not None or shard is not None:
        if verify:
            raise UnsupportedError("verify=True is not supported with process_group / shard loads")
        from . import distributed
        return distributed.load_file(filename, device, process_group=process_group, shard=shard, loader=loader,
                                     progress=progress, on_progress=on_progress)
    layout = _core.Layout(filename, _core.storage_options_of(loader))
    return _core.load_layout(_AD, layout, layout.offset_keys(), device, loader, progress, on_progress, verify)


def load(data: bytes, device: Any = "cpu") -> dict[str, torch.Tensor]:
    """Deserializes safetensors bytes (as ``safetensors.torch.load``)."""
    return _core.load_bytes(_AD, data, device)


def save_file(tensors: dict[str, torch.Tensor], filename: Any, metadata: dict[str, str] | None = None, *,
              saver: Saver | None = None, progress: bool = False,
              on_progress: ProgressCallback | None = None, checksums: bool = False,
              storage_options: dict[str, str] | None = None) -> None:
    """Saves tensors (on any device) as a safetensors file, byte for byte what
    ``safetensors.torch.save_file`` writes. CUDA tensors are saved from the device
    (through pinned staging, no ``.cpu()`` copy of the whole state dict); host memory use
    is bounded by the saver's staging. The file appears under ``filename`` only once
    whole and synced; on error (a full disk, Ctrl-C) the previous file stays intact.
    ``checksums=True`` also records an xxh3-64 of each tensor's bytes in the header's
    metadata (key ``"tensorferry.xxh3_64"``), for ``load_file(..., verify=True)``; the
    file stays readable by safetensors. ``storage_options``: object store options for
    this call (as for :func:`load_file`), over the options of ``saver``."""
    _check_shared(tensors)
    _core.save_tensors(_AD, tensors, filename, metadata, _core.saver_for(saver, storage_options), progress,
                       on_progress, checksums)


def save_sharded(state_dict: dict[str, torch.Tensor], directory: Any, max_shard_size: int | str = "5GB",
                 metadata: dict[str, str] | None = None, *, saver: Saver | None = None,
                 progress: bool = False, on_progress: ProgressCallback | None = None,
                 checksums: bool = False, storage_options: dict[str, str] | None = None) -> None:
    """Saves a state dict as a sharded checkpoint in ``directory``, as Hugging Face's
    ``save_torch_state_dict`` does: shards ``model-00001-of-0000N.safetensors`` filled
    greedily in the dict's order up to ``max_shard_size`` bytes of tensor data (an int, or
    ``"5GB"``-style; a larger tensor gets a shard of its own), and
    ``model.safetensors.index.json`` (``{"metadata": {"total_size": ..., **metadata},
    "weight_map": ...}``); every shard's header has ``{"format": "pt"}``. A checkpoint
    that fits one shard is a single ``model.safetensors`` with ``{"format": "pt",
    **metadata}`` in its header, and no index. Files of an earlier save in the directory
    (``model*.safetensors``, the index) that this one did not rewrite are removed. Load it
    back with ``load_file(directory)``. ``storage_options``: as for :func:`save_file`."""
    _check_shared(state_dict)
    _core.save_sharded_tensors(_AD, state_dict, directory, max_shard_size, {"format": "pt"}, metadata,
                               _core.saver_for(saver, storage_options), progress, on_progress, checksums)


def save(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """Serializes tensors to safetensors bytes (as ``safetensors.torch.save``)."""
    _check_shared(tensors)
    return _core.save_bytes(_AD, tensors, metadata)


def load_tensors(specs: Sequence[Any], dtype: Any = torch.float32, device: Any = "cuda", *,
                 loader: Loader | None = None, progress: bool = False,
                 on_progress: ProgressCallback | None = None) -> list[torch.Tensor]:
    """Loads raw flat files in one submission. Each spec is a path (whole file),
    ``(path, num_elements)`` or ``(path, num_elements, offset)``; returns 1-D tensors."""
    name = _dtype_name(dtype)
    dev = _device(device)
    loader = loader or default_loader()
    files: list[str] = []
    out, extents, targets = [], [], []
    for i, (path, n, off) in enumerate(_core.raw_specs(specs)):
        offset, length = _native.raw_range(path, name, n, off, _core.storage_options_of(loader))
        if path not in files:
            files.append(path)
        t = torch.empty(length // _torch_dtype(name).itemsize, dtype=_torch_dtype(name), device=dev)
        out.append(t)
        targets.append(_AD.target(t))
        extents.append((files.index(path), offset, length, i, 0))
    loader.read_into(files, extents, targets, _AD.stream(dev), progress, on_progress, "raw")
    return out


def load_tensor(path: Any, num_elements: int | None = None, dtype: Any = torch.float32, device: Any = "cuda",
                offset: int = 0, *, loader: Loader | None = None) -> torch.Tensor:
    """Loads ``num_elements`` elements of ``dtype`` at byte ``offset`` of a raw file (the
    rest of the file when ``num_elements`` is None) into a new 1-D tensor."""
    return load_tensors([(os.fspath(path), num_elements, offset)], dtype, device, loader=loader)[0]


def load_tensor_timed(path: Any, num_elements: int | None = None, dtype: Any = torch.float32,
                      device: Any = "cuda", offset: int = 0, *,
                      loader: Loader | None = None) -> tuple[torch.Tensor, float]:
    """``load_tensor`` and the seconds it took (tensor ready when timed)."""
    t0 = time.perf_counter()
    t = load_tensor(path, num_elements, dtype, device, offset, loader=loader)
    return t, time.perf_counter() - t0


__all__ = ["load_file", "load", "save_file", "save", "save_sharded", "load_tensor", "load_tensors",
           "load_tensor_timed"]
