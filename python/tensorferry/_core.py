"""Framework-independent machinery: the Loader and Saver, checkpoint and slice planning,
raw files, durable writes and progress. ``torch.py`` and ``numpy.py`` plug in an adapter that
allocates arrays and tells where their memory is.
"""
from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Iterable, Sequence

from . import _native
from .errors import InvalidArgumentError, OutOfMemoryError

ProgressCallback = Callable[[int, int], None]
_DEBUG = os.environ.get("TENSORFERRY_LOG", "") in ("debug", "trace")


def _debug(msg: str) -> None:
    if _DEBUG:
        print(f"[tensorferry DEBUG {time.monotonic():.6f}] {msg}", file=sys.stderr)


class Adapter:
    """What a framework provides: allocation and the address of an array's memory."""

    name = "?"

    def device(self, device: Any) -> Any:  # normalised device
        raise NotImplementedError

    def empty(self, shape: Sequence[int], dtype: str, device: Any) -> Any:
        raise NotImplementedError

    def target(self, array: Any) -> tuple[str, int, int, int]:
        """``(kind, device index, address, nbytes)`` of a contiguous array."""
        raise NotImplementedError

    def stream(self, device: Any) -> int | None:
        return None

    def from_bytes(self, data: bytes | memoryview, dtype: str, shape: Sequence[int], device: Any) -> Any:
        raise NotImplementedError

    def to_host_bytes(self, array: Any) -> memoryview:
        raise NotImplementedError

    def describe(self, array: Any) -> tuple[str, list[int]]:
        """``(safetensors dtype name, shape)`` of an array."""
        raise NotImplementedError

    def source(self, array: Any) -> tuple[str, int, int, int, Any]:
        """``(kind, device index, address, nbytes, owner)`` of an array's bytes in row-major
        order, to be written from; ``owner`` (a contiguous copy where one was needed)
        must stay alive until the write ends."""
        raise NotImplementedError

    def sync(self, devices: Iterable[int]) -> None:
        """Waits for work queued on these CUDA devices' current streams (before their
        memory is read by the native side)."""

    def finish(self, array: Any, dtype: str, shape: Sequence[int]) -> Any:
        return array


class Loader:
    """Options for loads (engine, threads, staging) and the staging pool they share.

    Module-level functions use a default loader built from the ``TENSORFERRY_*``
    environment variables; make your own to change options::

        loader = tensorferry.Loader(engine="uring", threads=8, staging_size=16 << 20)
        tensors = tensorferry.torch.load_file("model.safetensors", device="cuda", loader=loader)

    ``engine`` is ``auto`` (per file: buffered pread when the page cache holds it,
    io_uring + O_DIRECT when not), ``pread``, ``direct``, ``uring`` or ``gds``.

    ``storage_options``: object store options (``object_store`` config keys such as
    ``"aws_endpoint"``, ``"aws_access_key_id"``, ``"aws_secret_access_key"``,
    ``"aws_region"``, ``"aws_allow_http"``, or their short forms ``"endpoint"``, ...) for
    every URL this loader opens; they override the ``AWS_*`` / ``GOOGLE_*`` / ``AZURE_*``
    environment. Only their names are ever shown (``repr``, ``options``).
    """

    def __init__(self, engine: str | None = None, threads: int | None = None,
                 staging_size: int | None = None, slots: int | None = None,
                 uring_depth: int | None = None, *, storage_options: dict[str, str] | None = None) -> None:
        self._storage_options = _check_storage_options(storage_options)
        self._native = _native.NativeLoader(engine, threads, staging_size, slots, uring_depth,
                                            self._storage_options)
        self.last_report: dict | None = None

    @property
    def options(self) -> dict:
        return self._native.options()

    def read_into(self, files: Sequence[str], extents: Sequence[tuple], targets: Sequence[tuple],
                  stream: int | None = None, progress: bool = False,
                  on_progress: ProgressCallback | None = None, what: str = "",
                  verify: Sequence[str | None] | None = None) -> dict:
        """Low level: ``extents`` ``(file, offset, length, target, target_offset)`` of
        ``files`` into ``targets`` ``(kind, device, address, length)``. ``verify``: per
        extent, the name of the tensor it is all of, checked against the checksum its file
        records (None: not checked)."""
        cb = _progress_callback(progress, on_progress, what)
        try:
            report = self._native.read_into([os.fspath(f) for f in files], list(extents), list(targets), stream, cb,
                                            None if verify is None else list(verify))
        finally:
            if isinstance(cb, _Bar):
                cb.close()
        self.last_report = report
        return report

    def __repr__(self) -> str:
        return f"Loader({', '.join(f'{k}={v!r}' for k, v in self.options.items())})"


_default: Loader | None = None
_default_lock = threading.Lock()


def _check_storage_options(options: Any) -> dict[str, str] | None:
    """A private copy of ``storage_options`` (str -> str), or None. Values never appear
    in the errors raised here."""
    if options is None:
        return None
    if not isinstance(options, dict):
        raise InvalidArgumentError(f"storage_options must be a dict of str -> str, not {type(options).__name__}")
    for k, v in options.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InvalidArgumentError(f"storage_options must map str to str (bad entry for key {k!r})")
    return dict(options)


def storage_options_of(obj: Any) -> dict[str, str] | None:
    """The storage options of a Loader or Saver (None for None or none set)."""
    return getattr(obj, "_storage_options", None)


def loader_for(loader: Loader | None, storage_options: dict[str, str] | None) -> Loader | None:
    """``loader`` as given when ``storage_options`` is None; else a loader with the
    options of ``loader`` (or the defaults) and these storage options over its own."""
    if storage_options is None:
        return loader
    so = _check_storage_options(storage_options)
    if loader is None:
        return Loader(storage_options=so)
    o = loader.options
    return Loader(o["engine"], o["threads"], o["slot_size"], o["slots"], o["uring_depth"],
                  storage_options={**(loader._storage_options or {}), **so})


def saver_for(saver: Saver | None, storage_options: dict[str, str] | None) -> Saver | None:
    """As :func:`loader_for`, for savers."""
    if storage_options is None:
        return saver
    so = _check_storage_options(storage_options)
    if saver is None:
        return Saver(storage_options=so)
    o = saver.options
    return Saver(o["threads"], o["slot_size"], o["slots"], o["direct"], o["streams"],
                 storage_options={**(saver._storage_options or {}), **so})


def default_loader() -> Loader:
    """The loader module-level functions use (created on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Loader()
        return _default


class Saver:
    """Options for saves (writer threads, staging, O_DIRECT, CUDA streams) and the staging
    pool they share. Module-level functions use a default saver built from the
    ``TENSORFERRY_*`` environment variables; make your own to change options::

        saver = tensorferry.Saver(threads=8, staging_size=16 << 20, direct="on")
        tensorferry.torch.save_file(state_dict, "model.safetensors", saver=saver)

    ``direct`` is ``"auto"`` (O_DIRECT for files of 64 MiB or more where the file system
    accepts it), ``"on"``, ``"off"`` or a bool. CUDA tensors are copied to pinned staging
    memory on a few streams and written from there; memory use is bounded by
    ``staging_size * slots`` whatever the size of the checkpoint. ``storage_options``:
    object store options for every URL this saver writes, as for :class:`Loader`.
    """

    def __init__(self, threads: int | None = None, staging_size: int | None = None,
                 slots: int | None = None, direct: str | bool | None = None,
                 streams: int | None = None, *, storage_options: dict[str, str] | None = None) -> None:
        if isinstance(direct, bool):
            direct = "on" if direct else "off"
        self._storage_options = _check_storage_options(storage_options)
        self._native = _native.NativeSaver(threads, staging_size, slots, direct, streams, self._storage_options)
        self.last_report: dict | None = None

    @property
    def options(self) -> dict:
        return self._native.options()

    def save_file(self, path: str, tensors: Sequence[tuple], metadata: dict | None = None,
                  progress: bool = False, on_progress: ProgressCallback | None = None,
                  checksums: bool = False) -> dict:
        """Low level: ``tensors`` ``[(name, dtype, shape, kind, device, address, nbytes)]``
        as one safetensors file, durably."""
        cb = _progress_callback(progress, on_progress, f"saving {os.path.basename(path)}")
        try:
            report = self._native.save_safetensors(path, list(tensors), metadata, cb, bool(checksums))
        finally:
            if isinstance(cb, _Bar):
                cb.close()
        self.last_report = report
        return report

    def save_sharded(self, directory: str, tensors: Sequence[tuple], max_shard_size: int,
                     metadata: dict | None = None, index_metadata: dict | None = None,
                     progress: bool = False, on_progress: ProgressCallback | None = None,
                     checksums: bool = False) -> dict:
        """Low level: ``tensors`` (as for :meth:`save_file`) as a sharded checkpoint;
        ``metadata`` in every shard's header, ``index_metadata`` in the index (or in the
        header of a checkpoint that fits one file)."""
        cb = _progress_callback(progress, on_progress, f"saving {os.path.basename(directory)}")
        try:
            report = self._native.save_sharded(directory, list(tensors), int(max_shard_size), metadata,
                                               index_metadata, cb, bool(checksums))
        finally:
            if isinstance(cb, _Bar):
                cb.close()
        self.last_report = report
        return report

    def write_at(self, path: str, offset: int, source: tuple) -> int:
        """Low level: ``source`` ``(kind, device, address, nbytes)`` into ``path`` at
        ``offset`` (created if missing, not truncated, not synced)."""
        return self._native.write_at(path, int(offset), tuple(source))

    def __repr__(self) -> str:
        return f"Saver({', '.join(f'{k}={v!r}' for k, v in self.options.items())})"


_default_saver: Saver | None = None


def default_saver() -> Saver:
    """The saver module-level functions use (created on first use)."""
    global _default_saver
    with _default_lock:
        if _default_saver is None:
            _default_saver = Saver()
        return _default_saver


class _Bar:
    """A minimal progress bar on stderr, shown once a load lasts over a second."""

    def __init__(self, what: str, user: ProgressCallback | None) -> None:
        self.what, self.user, self.start, self.shown = what or "loading", user, time.monotonic(), False

    def __call__(self, done: int, total: int) -> None:
        if self.user is not None:
            self.user(done, total)
        if not self.shown and time.monotonic() - self.start < 1.0:
            return
        self.shown = True
        frac = done / total if total else 1.0
        rate = done / max(time.monotonic() - self.start, 1e-9) / 1e9
        bar = "=" * int(frac * 30)
        sys.stderr.write(f"\r{self.what} [{bar:<30}] {done / 1e9:.2f}/{total / 1e9:.2f} GB {rate:.2f} GB/s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _progress_callback(progress: bool, on_progress: ProgressCallback | None, what: str):
    if progress:
        return _Bar(what, on_progress)
    return on_progress


def _path(p: Any) -> str:
    if isinstance(p, (bytes, bytearray)):
        raise InvalidArgumentError("a path is expected here; to load serialized bytes use load(data)")
    return os.fspath(p)


# --- checkpoints -------------------------------------------------------------------


class Layout:
    """A checkpoint's layout from the native side (files, tensors sorted by name)."""

    def __init__(self, path: Any, storage_options: dict[str, str] | None = None) -> None:
        info = _native.open_checkpoint(_path(path), storage_options)
        self.path = info["path"]
        self.files: list[str] = info["files"]
        self.metadata_: dict | None = info["metadata"]
        self.sharded: bool = info["sharded"]
        # name -> (dtype, shape, file, file_offset, length, begin, end)
        self.tensors: dict[str, tuple] = {t[0]: t[1:] for t in info["tensors"]}

    def keys(self) -> list[str]:
        return list(self.tensors)  # already sorted by name

    def offset_keys(self) -> list[str]:
        return sorted(self.tensors, key=lambda n: (self.tensors[n][2], self.tensors[n][3]))

    def entry(self, name: str) -> tuple:
        try:
            return self.tensors[name]
        except KeyError:
            from .errors import TensorNotFoundError
            raise TensorNotFoundError(f"{self.path}: no tensor named {name!r}") from None


def load_layout(ad: Adapter, layout: Layout, names: Iterable[str], device: Any, loader: Loader | None,
                progress: bool = False, on_progress: ProgressCallback | None = None,
                verify: bool = False) -> dict[str, Any]:
    """Loads the named tensors of a checkpoint in one submission; with ``verify``, each
    is checked against the xxh3-64 its file records (files saved with ``checksums=True``)."""
    loader = loader or default_loader()
    dev = ad.device(device)
    t0 = time.perf_counter()
    out, extents, targets, arr = {}, [], [], None
    try:
        for i, name in enumerate(names):
            dtype, shape, file, offset, length, _, _ = layout.entry(name)
            try:
                arr = ad.empty(shape, dtype, dev)
            except OutOfMemoryError as e:
                raise OutOfMemoryError(f"{layout.files[file]}: no room on {dev} for tensor {name!r} ({length} bytes; "
                                       f"{len(out)} tensors allocated before it were freed): {e}") from None
            out[name] = arr
            targets.append(ad.target(arr))
            extents.append((file, offset, length, i, 0))
        _debug(f"allocated {len(out)} tensors on {dev} in {(time.perf_counter() - t0) * 1e3:.1f} ms")
        loader.read_into(layout.files, extents, targets, ad.stream(dev), progress, on_progress,
                         os.path.basename(layout.path), list(out) if verify else None)
    except BaseException:
        # A failed load frees its tensors now, not when the traceback (which holds this
        # frame) goes: the memory is back where it was when the exception reaches the caller.
        out.clear()
        arr = None  # noqa: F841 - drops the last reference
        raise
    return {n: ad.finish(a, layout.tensors[n][0], layout.tensors[n][1]) for n, a in out.items()}


def load_bytes(ad: Adapter, data: bytes, device: Any) -> dict[str, Any]:
    """Deserializes a safetensors byte string (no file I/O)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidArgumentError(f"load() takes bytes, not {type(data).__name__}")
    start, tensors, _meta = _native.parse_header(bytes(data))
    dev = ad.device(device)
    mv = memoryview(data)
    out = {}
    # File (data) order, as load_file gives them; names break ties between empty tensors.
    for name, dtype, shape, begin, end in sorted(tensors, key=lambda t: (t[3], t[0])):
        out[name] = ad.from_bytes(mv[start + begin:start + end], dtype, shape, dev)
    return out


# --- slices --------------------------------------------------------------------------


def normalize_index(index: Any, shape: Sequence[int]) -> tuple[list[tuple[int, int]], tuple]:
    """Splits a NumPy-style basic index into the bounding box to read, ``[(start, stop)]``
    per dimension, and the residual index to apply to that box in memory."""
    if not isinstance(index, tuple):
        index = (index,)
    if any(i is Ellipsis for i in index):
        pos = next(k for k, i in enumerate(index) if i is Ellipsis)
        fill = len(shape) - (len(index) - 1)
        index = index[:pos] + (slice(None),) * fill + index[pos + 1:]
    if len(index) > len(shape):
        raise InvalidArgumentError(f"too many indices ({len(index)}) for a tensor of {len(shape)} dimensions")
    index = index + (slice(None),) * (len(shape) - len(index))
    box, residual = [], []
    for k, (ix, n) in enumerate(zip(index, shape)):
        if isinstance(ix, slice):
            start, stop, step = ix.indices(n)
            if step <= 0:
                raise InvalidArgumentError("slices with a negative or zero step are not supported")
            stop = max(stop, start)
            count = len(range(start, stop, step))
            last = start + (count - 1) * step + 1 if count else start
            box.append((start, last))
            residual.append(slice(0, last - start, step))
        elif isinstance(ix, int) or hasattr(ix, "__index__"):
            i = int(ix)
            if i < -n or i >= n:
                raise IndexError(f"index {i} is out of bounds for dimension {k} with size {n}")
            i %= n
            box.append((i, i + 1))
            residual.append(0)
        else:
            raise InvalidArgumentError(f"unsupported index {ix!r}: use ints, slices and ...")
    return box, tuple(residual)


def box_extents(box: Sequence[tuple[int, int]], shape: Sequence[int], itemsize_bits: int,
                base: int) -> list[tuple[int, int, int]]:
    """Contiguous runs ``(file offset, length, dest offset)`` that read exactly the box,
    row-major. ``base`` is the tensor's first byte in its file."""
    nd = len(shape)
    if nd == 0:
        return [(base, itemsize_bits // 8, 0)]
    # The innermost dimensions read whole merge into one run.
    k = nd - 1
    while k > 0 and box[k] == (0, shape[k]):
        k -= 1
    inner = 1
    for d in shape[k + 1:]:
        inner *= d
    run_elems = (box[k][1] - box[k][0]) * inner
    if run_elems == 0 or any(b[1] <= b[0] for b in box):
        return []
    strides = [1] * nd
    for d in range(nd - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    runs, dest = [], 0
    outer = [range(b[0], b[1]) for b in box[:k]]

    def rec(d: int, elem: int) -> None:
        nonlocal dest
        if d == k:
            start = (elem + box[k][0] * strides[k]) * itemsize_bits // 8
            length = run_elems * itemsize_bits // 8
            runs.append((base + start, length, dest))
            dest += length
            return
        for i in outer[d]:
            rec(d + 1, elem + i * strides[d])

    rec(0, 0)
    return runs


# --- raw files -----------------------------------------------------------------------


def raw_specs(specs: Sequence[Any]) -> list[tuple[str, int | None, int]]:
    """Normalises raw specs: a path, ``(path, num_elements)`` or
    ``(path, num_elements, offset)``."""
    out = []
    for s in specs:
        if isinstance(s, (str, os.PathLike)):
            out.append((os.fspath(s), None, 0))
        elif isinstance(s, (tuple, list)) and 1 <= len(s) <= 3:
            path = os.fspath(s[0])
            n = None if len(s) < 2 or s[1] is None else int(s[1])
            off = int(s[2]) if len(s) == 3 else 0
            out.append((path, n, off))
        else:
            raise InvalidArgumentError(f"raw spec {s!r}: expected path, (path, num_elements) or (path, num_elements, offset)")
    return out


# --- durable writes ------------------------------------------------------------------


def cleanup_temps(directory: str, final_name: str) -> None:
    """Removes temporary files an interrupted save of ``final_name`` left behind."""
    prefix = f".{final_name}.tf-tmp-"
    try:
        for n in os.listdir(directory):
            if n.startswith(prefix):
                try:
                    os.unlink(os.path.join(directory, n))
                except OSError:
                    pass
    except OSError:
        pass


def durable_write(path: str, write: Callable[[Any], None]) -> None:
    """Writes a file so that it appears under ``path`` whole or not at all: a temporary
    name in the same directory, fsync, rename, fsync of the directory."""
    path = os.path.abspath(path)
    directory, name = os.path.split(path)
    cleanup_temps(directory, name)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.tf-tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _check_save_args(tensors: Any, metadata: dict | None) -> None:
    if not isinstance(tensors, dict):
        raise InvalidArgumentError(f"tensors must be a dict of name -> tensor, not {type(tensors).__name__}")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise InvalidArgumentError(f"metadata must be a dict of str -> str, not {type(metadata).__name__}")
        bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise InvalidArgumentError(f"metadata must map str to str (bad key {bad[0]!r})")


def save_sources(ad: Adapter, tensors: dict[str, Any], metadata: dict | None) -> tuple[list[tuple], list]:
    """Checks tensors and metadata (as :func:`serialize` does) and says where each
    tensor's bytes are: ``([(name, dtype, shape, kind, device, address, nbytes)], owners)``;
    the owners must stay alive until the native side has written them. CUDA devices'
    current streams are synchronised first, as ``.cpu()`` would."""
    _check_save_args(tensors, metadata)
    specs, owners, devices = [], [], set()
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise InvalidArgumentError(f"tensor names must be str, not {type(name).__name__}")
        dtype, shape = ad.describe(t)
        kind, dev, ptr, nbytes, owner = ad.source(t)
        owners.append(owner)
        if kind == "cuda":
            devices.add(dev)
        specs.append((name, dtype, [int(d) for d in shape], kind, dev, ptr, nbytes))
    if devices:
        ad.sync(sorted(devices))
    return specs, owners


def save_tensors(ad: Adapter, tensors: dict[str, Any], path: Any, metadata: dict | None,
                 saver: Saver | None = None, progress: bool = False,
                 on_progress: ProgressCallback | None = None, checksums: bool = False) -> dict:
    """Writes tensors as safetensors (reference layout), durably, with the native saver:
    host memory is written from where it lies, CUDA memory through pinned staging."""
    specs, owners = save_sources(ad, tensors, metadata)
    report = (saver or default_saver()).save_file(_path(path), specs, metadata, progress, on_progress, checksums)
    del owners  # alive until here
    return report


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_size(size: int | str) -> int:
    """A byte count: an int, or a string such as ``"5GB"`` (10^9, as Hugging Face's tools
    read it), ``"500MB"``, ``"2GiB"`` (2^30)."""
    if isinstance(size, bool):
        raise InvalidArgumentError(f"size {size!r}: expected an int or a string such as '5GB'")
    if isinstance(size, int):
        n = size
    elif isinstance(size, str):
        import re
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", size, re.IGNORECASE)
        if not m:
            raise InvalidArgumentError(f"size {size!r}: expected e.g. '5GB', '500MB', '2GiB' or a number of bytes")
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    else:
        raise InvalidArgumentError(f"size {size!r}: expected an int or a string such as '5GB'")
    if n <= 0:
        raise InvalidArgumentError(f"size {size!r} must be positive")
    return n


def save_sharded_tensors(ad: Adapter, tensors: dict[str, Any], directory: Any, max_shard_size: int | str,
                         metadata: dict | None, index_metadata: dict | None = None, saver: Saver | None = None,
                         progress: bool = False, on_progress: ProgressCallback | None = None,
                         checksums: bool = False) -> dict:
    """Writes tensors as a sharded checkpoint (Hugging Face layout), durably."""
    limit = parse_size(max_shard_size)
    _check_save_args(tensors, index_metadata)
    specs, owners = save_sources(ad, tensors, metadata)
    report = (saver or default_saver()).save_sharded(_path(directory), specs, limit, metadata, index_metadata,
                                                     progress, on_progress, checksums)
    del owners
    return report


def serialize(ad: Adapter, tensors: dict[str, Any], metadata: dict | None) -> tuple[bytes, list]:
    _check_save_args(tensors, metadata)
    described = [(name, *ad.describe(t)) for name, t in tensors.items()]
    for name, _d, _s in described:
        if not isinstance(name, str):
            raise InvalidArgumentError(f"tensor names must be str, not {type(name).__name__}")
    return _native.serialize_header(described, metadata)


def save_bytes(ad: Adapter, tensors: dict[str, Any], metadata: dict | None) -> bytes:
    header, order = serialize(ad, tensors, metadata)
    parts = [header] + [bytes(ad.to_host_bytes(tensors[n])) for n, _b, _e in order]
    return b"".join(parts)
