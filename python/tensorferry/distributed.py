"""Distributed and tensor-parallel loading over ``torch.distributed``.

With a process group, the ranks of the group share the reading: each tensor is read from
storage by one rank only (its *owner*; whole tensors, balanced by bytes), then reaches the
other ranks with ``torch.distributed.broadcast``::

    import torch.distributed as dist
    from tensorferry.distributed import load_file, last_report

    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5))
    torch.cuda.set_device(local_rank)
    tensors = load_file("model.safetensors", device="cuda", process_group=dist.group.WORLD)
    print(last_report())   # bytes_read, bytes_received, bytes_sent, seconds, tensors_owned

Tensor-parallel slices: ``shard={"*.q_proj.weight": (0, tp_rank, tp_world)}`` (fnmatch
patterns, the first that matches wins) or a callable ``name -> (dim, rank, world) | None``.
A sharded tensor is cut into ``world`` near-equal contiguous parts along ``dim`` (as
``torch.tensor_split``); each process reads only its part from storage and keeps it
(no broadcast). Works with or without a process group.

Broadcasts are batched: tensors are packed into a reusable staging buffer (``staging_bytes``,
256 MiB by default, never larger than needed) per owner and broadcast one buffer at a time;
tensors of at least a quarter of it that already live on the backend's device (CPU for gloo,
CUDA for NCCL) are broadcast in place. Extra memory is bounded by that buffer.

Failures: once every rank has read its share, the ranks all-reduce a status flag. If any
rank failed, every rank raises :class:`~tensorferry.errors.TensorferryError`: the failing
rank its own error, the others :class:`DistributedError` ("rank N failed: ..."). A rank
that dies (killed, ``os._exit``) cannot report: the others raise when the collective
fails, at the latest after the **process group's timeout**
(``init_process_group(timeout=...)`` / ``new_group(timeout=...)``); choose it to bound
how long survivors wait. With NCCL, set ``TORCH_NCCL_BLOCKING_WAIT=1`` for the timeout to
surface as an exception (otherwise NCCL's watchdog ends the process after the timeout), and
call ``torch.cuda.set_device`` on every rank (error messages travel with
``all_gather_object``).
"""
from __future__ import annotations

import fnmatch
import hashlib
import heapq
import os
import time
from typing import Any, Callable, Mapping, Sequence, Union

import torch
import torch.distributed as dist

from . import _bits, _core
from ._core import Loader, ProgressCallback, default_loader
from .errors import InvalidArgumentError, InvalidFileError, TensorferryError
from .torch import _AD

DEFAULT_STAGING_BYTES = 256 << 20

ShardSpec = Union[Mapping[str, Union[Sequence[int], None]], Callable[[str], Union[Sequence[int], None]], None]


class DistributedError(TensorferryError, RuntimeError):
    """Another rank of the group failed, died, or the group's collectives failed."""


_last_report: dict | None = None


def last_report() -> dict | None:
    """What the last load in this process did on this rank: ``bytes_read`` (from storage),
    ``bytes_received`` / ``bytes_sent`` (broadcast payload over the group), ``seconds``,
    ``tensors_owned`` (tensors this rank read for the group), and ``rank``, ``world``,
    ``broadcasts`` (calls), ``tensors_sharded``. None before the first successful load."""
    return None if _last_report is None else dict(_last_report)


# --- checkpoints ----------------------------------------------------------------------


class _MultiLayout(_core.Layout):
    """Several checkpoints (files, indexes or directories) seen as one."""

    def __init__(self, paths: Sequence[Any], storage_options: dict[str, str] | None = None) -> None:  # noqa: D107
        if not paths:
            raise InvalidArgumentError("load_checkpoint: an empty list of files")
        self.files, tensors, self.metadata_, self.sharded = [], {}, None, True
        for p in paths:
            lay = _core.Layout(p, storage_options)
            base = len(self.files)
            self.files.extend(lay.files)
            for name, e in lay.tensors.items():
                if name in tensors:
                    raise InvalidFileError(f"tensor {name!r} is in more than one of the files given ({lay.path})")
                tensors[name] = (e[0], e[1], e[2] + base, *e[3:])
            if self.metadata_ is None:
                self.metadata_ = lay.metadata_
        self.path = os.fspath(paths[0])
        self.tensors = dict(sorted(tensors.items()))


def _open(source: Any, loader: Loader | None = None) -> _core.Layout:
    so = _core.storage_options_of(loader)
    if isinstance(source, (list, tuple)):
        return _MultiLayout(source, so)
    return _core.Layout(source, so)


# --- tensor-parallel slices ------------------------------------------------------------


def _shard_fn(shard: ShardSpec) -> Callable[[str], Any]:
    if shard is None:
        return lambda name: None
    if isinstance(shard, Mapping):
        items = list(shard.items())
        return lambda name: next((spec for pat, spec in items if fnmatch.fnmatchcase(name, pat)), None)
    if callable(shard):
        return shard
    raise InvalidArgumentError(f"shard must be a mapping of name patterns or a callable, not {type(shard).__name__}")


def shard_range(size: int, rank: int, world: int) -> tuple[int, int]:
    """``[start, stop)`` of part ``rank`` of ``world`` near-equal contiguous parts of
    ``size`` elements (the first ``size % world`` parts one longer, as ``torch.tensor_split``)."""
    q, r = divmod(size, world)
    start = rank * q + min(rank, r)
    return start, start + q + (1 if rank < r else 0)


def _shard_box(name: str, spec: Any, shape: Sequence[int]) -> list[tuple[int, int]]:
    try:
        dim, rank, world = (int(x) for x in spec)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"shard of {name!r}: expected (dim, rank, world), got {spec!r}") from None
    nd = len(shape)
    if nd == 0:
        raise InvalidArgumentError(f"shard of {name!r}: a 0-d tensor cannot be split")
    if not -nd <= dim < nd:
        raise InvalidArgumentError(f"shard of {name!r}: dim {dim} out of range for {nd} dimensions")
    if world < 1 or not 0 <= rank < world:
        raise InvalidArgumentError(f"shard of {name!r}: rank {rank} of world {world}")
    dim %= nd
    start, stop = shard_range(shape[dim], rank, world)
    box, _residual = _core.normalize_index((slice(None),) * dim + (slice(start, stop),), shape)
    return box


def _split(layout: _core.Layout, shard: ShardSpec) -> tuple[list[str], dict[str, list]]:
    """Names loaded whole (file order) and sharded names with the box this process reads."""
    fn = _shard_fn(shard)
    whole, slices = [], {}
    for name in layout.offset_keys():
        spec = fn(name)
        if spec is None:
            whole.append(name)
        else:
            slices[name] = _shard_box(name, spec, layout.tensors[name][1])
    return whole, slices


# --- reading ---------------------------------------------------------------------------


def _read(layout: _core.Layout, whole: Sequence[str], slices: Mapping[str, list], dev: torch.device,
          loader: Loader | None, progress: bool, on_progress: ProgressCallback | None) -> tuple[dict, int]:
    """Reads whole tensors and the boxes of sharded ones in one submission."""
    out, extents, targets, nread = {}, [], [], 0
    for name in whole:
        dtype, shape, file, offset, length, _, _ = layout.entry(name)
        arr = out[name] = _AD.empty(shape, dtype, dev)
        if length:
            extents.append((file, offset, length, len(targets), 0))
            targets.append(_AD.target(arr))
            nread += length
    for name, box in slices.items():
        dtype, shape, file, offset, _length, _, _ = layout.entry(name)
        bits = _bits(dtype)
        if bits % 8 and box != [(0, n) for n in shape]:
            raise InvalidArgumentError(f"sharding sub-byte dtype {dtype} ({name!r}) is not supported")
        arr = out[name] = _AD.empty([b - a for a, b in box], dtype, dev)
        runs = _core.box_extents(box, shape, bits, offset)
        if runs:
            ti = len(targets)
            targets.append(_AD.target(arr))
            for off, ln, dst in runs:
                extents.append((file, off, ln, ti, dst))
                nread += ln
    if extents:
        (loader or default_loader()).read_into(layout.files, extents, targets, _AD.stream(dev), progress,
                                               on_progress, os.path.basename(layout.path))
    return out, nread


def _finish(layout: _core.Layout, out: dict) -> dict[str, torch.Tensor]:
    return {n: _AD.finish(out[n], layout.tensors[n][0], list(out[n].shape)) for n in layout.offset_keys() if n in out}


# --- the group -------------------------------------------------------------------------


def _assign(layout: _core.Layout, names: Sequence[str], world: int) -> dict[str, int]:
    """Owner (group rank) of each non-empty tensor: largest first onto the least-loaded
    rank (ties: the lower rank). The same on every rank."""
    sized = sorted(((layout.tensors[n][4], n) for n in names if layout.tensors[n][4] > 0), key=lambda x: (-x[0], x[1]))
    heap = [(0, r) for r in range(world)]
    owners = {}
    for nbytes, name in sized:
        load, r = heapq.heappop(heap)
        owners[name] = r
        heapq.heappush(heap, (load + nbytes, r))
    return owners


def _fingerprint(layout: _core.Layout, whole: Sequence[str], slices: Mapping[str, list]) -> int:
    """62 bits that differ when ranks disagree on what is broadcast."""
    t = layout.tensors
    desc = repr(([(n, t[n][0], list(t[n][1]), t[n][4]) for n in sorted(whole)], sorted(slices)))
    return int.from_bytes(hashlib.blake2b(desc.encode(), digest_size=8).digest(), "little") & ((1 << 62) - 1)


def _comm_device(pg: Any, dev: torch.device | None) -> torch.device:
    """Where the tensors given to the group's collectives live."""
    backend = str(dist.get_backend(pg)).lower()
    if "nccl" in backend:
        if dev is not None and dev.type == "cuda":
            return dev
        if "cpu:" in backend and dev is not None:  # e.g. "cpu:gloo,cuda:nccl"
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _plan(owned: list[list[tuple[str, int]]], cap: int, direct_ok: bool) -> list[tuple]:
    """Broadcast calls, the same on every rank: ``("direct", owner, name, nbytes)`` for a
    tensor broadcast in place, ``("packed", owner, [(name, start, stop), ...], nbytes)``
    for byte ranges packed into the staging buffer (a tensor may span several)."""
    threshold = max(1, cap // 4)
    plan = []
    for r, items in enumerate(owned):
        chunk, fill = [], 0
        for name, nbytes in items:
            if direct_ok and nbytes >= threshold:
                plan.append(("direct", r, name, nbytes))
                continue
            s = 0
            while s < nbytes:
                take = min(nbytes - s, cap - fill)
                chunk.append((name, s, s + take))
                fill += take
                s += take
                if fill == cap:
                    plan.append(("packed", r, chunk, fill))
                    chunk, fill = [], 0
        if chunk:
            plan.append(("packed", r, chunk, fill))
    return plan


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _own_error(e: BaseException, grank: int) -> TensorferryError:
    if isinstance(e, TensorferryError):
        return e
    err = DistributedError(f"rank {grank} failed: {type(e).__name__}: {e}")
    err.__cause__ = e
    return err


def _load_group(source: Any, device: Any, pg: Any, shard: ShardSpec, loader: Loader | None, staging_bytes: int,
                progress: bool, on_progress: ProgressCallback | None, t0: float) -> dict[str, torch.Tensor]:
    global _last_report
    if not dist.is_available() or not dist.is_initialized():
        raise InvalidArgumentError("process_group given but torch.distributed is not initialised")
    me, world = dist.get_rank(pg), dist.get_world_size(pg)
    if me < 0:
        raise InvalidArgumentError("this process is not a member of process_group")
    if int(staging_bytes) < 1:
        raise InvalidArgumentError(f"staging_bytes must be positive, not {staging_bytes}")
    cap = int(staging_bytes)
    grank = dist.get_rank()
    global_of = [dist.get_global_rank(pg, r) for r in range(world)]

    # 1. Each rank reads its share (and its slices of sharded tensors).
    error: BaseException | None = None
    dev = layout = None
    out, owners, whole, slices, nread, fp = {}, {}, [], {}, 0, 0
    try:
        dev = _AD.device(device)
        layout = _open(source, loader)
        whole, slices = _split(layout, shard)
        owners = _assign(layout, whole, world)
        fp = _fingerprint(layout, whole, slices)
        mine = [n for n in whole if owners.get(n, me) == me]  # empty tensors: every rank makes its own
        out, nread = _read(layout, mine, slices, dev, loader, progress, on_progress)
    except Exception as e:  # noqa: BLE001 - reported to the group, then raised
        error = e

    if world == 1:
        # A group of one has nothing to share: skip the collectives, so it costs exactly
        # what a plain load costs.
        if error is not None:
            raise _own_error(error, grank)
        assert layout is not None
        _last_report = {
            "rank": me, "world": 1, "bytes_read": nread, "bytes_received": 0, "bytes_sent": 0,
            "seconds": time.perf_counter() - t0, "tensors_owned": len(mine), "tensors_sharded": len(slices),
            "broadcasts": 0,
        }
        return _finish(layout, out)

    # 2. Status: nobody broadcasts unless every rank has read its share.
    try:
        comm = _comm_device(pg, dev)
        flag = torch.tensor([1 if error else 0, fp, -fp], dtype=torch.int64, device=comm)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=pg)
        failed, fp_max, fp_min = flag.tolist()
        fp_min = -fp_min
    except Exception as e:  # noqa: BLE001
        if error is not None:
            raise _own_error(error, grank) from None
        raise DistributedError(f"rank {grank}: status exchange with the group failed (a rank died, or the "
                               f"process group's timeout passed): {type(e).__name__}: {e}") from e
    if failed:
        msgs: list = [None] * world
        try:
            dist.all_gather_object(msgs, None if error is None else f"{type(error).__name__}: {error}", group=pg)
        except Exception:  # noqa: BLE001 - the flag alone is enough to fail
            msgs = []
        if error is not None:
            raise _own_error(error, grank)
        told = [f"rank {global_of[r]} failed: {m}" for r, m in enumerate(msgs) if m]
        raise DistributedError("; ".join(told) or "another rank of the group failed")
    if fp_max != fp_min:
        raise DistributedError("the ranks of the group do not agree on the checkpoint (different files, "
                               "or different tensors sharded)")

    # 3. Every whole tensor reaches every rank from its owner.
    assert layout is not None and dev is not None
    for name in whole:
        if name not in out:
            dtype, shape = layout.tensors[name][:2]
            out[name] = _AD.empty(shape, dtype, dev)
    owned: list[list[tuple[str, int]]] = [[] for _ in range(world)]
    for name in whole:  # file order
        if name in owners:
            owned[owners[name]].append((name, layout.tensors[name][4]))
    plan = _plan(owned, cap, dev == comm)
    packed = [op[3] for op in plan if op[0] == "packed"]
    staging = torch.empty(max(packed), dtype=torch.uint8, device=comm) if packed else None
    same_dev = dev == comm
    sent = received = 0
    try:
        for kind, r, what, nbytes in plan:
            if kind == "direct":
                buf = _bytes(out[what])
            else:
                assert staging is not None
                buf = staging[:nbytes]
                if r == me:
                    parts = [_bytes(out[n])[s:e] for n, s, e in what]
                    if same_dev and len(parts) > 1:
                        torch.cat(parts, out=buf)
                    else:
                        o = 0
                        for p in parts:
                            buf[o:o + p.numel()].copy_(p)
                            o += p.numel()
            dist.broadcast(buf, src=global_of[r], group=pg)
            if r == me:
                sent += nbytes
                continue
            received += nbytes
            if kind == "packed":
                o = 0
                for n, s, e in what:
                    _bytes(out[n])[s:e].copy_(buf[o:o + e - s])
                    o += e - s
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()
    except Exception as e:  # noqa: BLE001
        raise DistributedError(f"rank {grank}: broadcast failed (a rank died, or the process group's timeout "
                               f"passed): {type(e).__name__}: {e}") from e
    del staging

    _last_report = {
        "rank": me, "world": world, "bytes_read": nread, "bytes_received": received, "bytes_sent": sent,
        "seconds": time.perf_counter() - t0, "tensors_owned": sum(1 for r in owners.values() if r == me),
        "tensors_sharded": len(slices), "broadcasts": len(plan),
    }
    return _finish(layout, out)


# --- entry points ----------------------------------------------------------------------


def load_checkpoint(source: Any, device: Any = "cpu", *, process_group: Any = None, shard: ShardSpec = None,
                    loader: Loader | None = None, staging_bytes: int = DEFAULT_STAGING_BYTES,
                    progress: bool = False, on_progress: ProgressCallback | None = None) -> dict[str, torch.Tensor]:
    """Loads a checkpoint: a safetensors file, a sharded checkpoint's index, a directory
    holding one, or a list of files (one checkpoint; names must not repeat). Keys in file
    order, as :func:`tensorferry.torch.load_file`.

    ``process_group``: a ``torch.distributed`` group (``dist.group.WORLD`` or one from
    ``new_group``) whose ranks all call this with the same checkpoint; they split the
    reading and broadcast. None: a plain load by this process.
    ``shard``: tensor-parallel slices, ``{pattern: (dim, rank, world)}`` or a callable
    ``name -> (dim, rank, world) | None``; sharded tensors hold only this rank's part.
    ``staging_bytes``: the size of the buffer broadcasts are packed in (the bound on the
    extra memory a distributed load takes).
    """
    global _last_report
    t0 = time.perf_counter()
    _last_report = None
    if process_group is not None:
        return _load_group(source, device, process_group, shard, loader, staging_bytes, progress, on_progress, t0)
    dev = _AD.device(device)
    layout = _open(source, loader)
    whole, slices = _split(layout, shard)
    out, nread = _read(layout, whole, slices, dev, loader, progress, on_progress)
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()
    _last_report = {"rank": 0, "world": 1, "bytes_read": nread, "bytes_received": 0, "bytes_sent": 0,
                    "seconds": time.perf_counter() - t0, "tensors_owned": sum(1 for n in whole if layout.tensors[n][4]),
                    "tensors_sharded": len(slices), "broadcasts": 0}
    return _finish(layout, out)


def load_file(filename: Any, device: Any = "cpu", *, process_group: Any = None, shard: ShardSpec = None,
              loader: Loader | None = None, staging_bytes: int = DEFAULT_STAGING_BYTES, progress: bool = False,
              on_progress: ProgressCallback | None = None) -> dict[str, torch.Tensor]:
    """:func:`tensorferry.torch.load_file` shared by the ranks of ``process_group`` and/or
    cut into tensor-parallel slices by ``shard``; see :func:`load_checkpoint`."""
    return load_checkpoint(filename, device, process_group=process_group, shard=shard, loader=loader,
                           staging_bytes=staging_bytes, progress=progress, on_progress=on_progress)


__all__ = ["load_file", "load_checkpoint", "last_report", "shard_range", "DistributedError", "DEFAULT_STAGING_BYTES"]
