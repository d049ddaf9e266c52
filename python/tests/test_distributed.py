"""tensorferry.distributed: loads shared by the ranks of a process group (gloo on CPU,
processes spawned here), tensor-parallel slices, failure handling and the report.

Each spawned group runs several scenarios in a row; every rank compares its tensors with
a plain load itself and writes what it found to a result file that the tests read. A
group that does not finish in time fails the test (the processes are killed)."""
from __future__ import annotations

import datetime
import os
import pickle
import time
import traceback

import pytest
import safetensors.torch
import torch

import tensorferry
import tensorferry.distributed as tfd
import tensorferry.torch as tft
from conftest import TORCH_DTYPES, random_tensor, tensor_bytes, write_sharded

GROUP_TIMEOUT = 20  # seconds: the process group's timeout in the normal scenarios
KILL_TIMEOUT = 2  # ... and where a rank dies or hangs
JOIN_TIMEOUT = 60  # what one spawned group may take before the test fails as hung
STAGING = 16 << 10  # small, so that broadcasts are packed, split and reused


# --- checkpoints (written by safetensors) ----------------------------------------------


def _mixed() -> dict[str, torch.Tensor]:
    """Every dtype, edge shapes, tensors larger than STAGING and many small ones."""
    out = {}
    for i, dt in enumerate(TORCH_DTYPES):
        for j, shape in enumerate([(), (0,), (3, 0), (7,), (5, 3), (2, 3, 5)]):
            out[f"{str(dt)[6:]}.{j}"] = random_tensor(shape, dt, seed=i * 10 + j)
    out["big.f32"] = random_tensor((97, 211), torch.float32, seed=1)  # ~80 KiB
    out["big.bf16"] = random_tensor((61, 333), torch.bfloat16, seed=2)
    for k in range(40):
        out[f"small.{k}"] = random_tensor((k + 1, 3), torch.float16, seed=100 + k)
    return out


def _equal(n: int = 64, size: int = 4096) -> dict[str, torch.Tensor]:
    return {f"w.{k:03d}": random_tensor((size // 4,), torch.float32, seed=200 + k) for k in range(n)}


def _tp() -> dict[str, torch.Tensor]:
    return {
        "q.weight": random_tensor((10, 7), torch.float32, seed=300),  # 10 rows: uneven over 4
        "o.weight": random_tensor((6, 13), torch.bfloat16, seed=301),
        "up.weight": random_tensor((9, 5, 3), torch.int16, seed=302),
        "tiny": random_tensor((3, 2), torch.float32, seed=303),  # fewer rows than ranks
        "norm": random_tensor((13,), torch.float32, seed=304),  # not sharded: broadcast
    }


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("ckpts")
    paths = {}
    for name, tensors in (("mixed", _mixed()), ("equal", _equal()), ("tp", _tp()),
                          ("other", {f"x.{k}": random_tensor((k * 50 + 1,), torch.int32, seed=k) for k in range(9)})):
        paths[name] = str(d / f"{name}.safetensors")
        safetensors.torch.save_file(tensors, paths[name])
    (d / "sharded").mkdir()
    paths["index"] = write_sharded(str(d / "sharded"), _mixed(), split=3)
    return paths


# --- spawning --------------------------------------------------------------------------


def _worker(rank: int, world: int, init_file: str, result_file: str, scenarios: list[str], params: dict) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    global _GROUP
    # A generous timeout for the rendezvous (the ranks start at different times); the
    # scenarios use a group with the timeout under test.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=max(GROUP_TIMEOUT, params["timeout"])))
    if params["timeout"] < GROUP_TIMEOUT:
        _GROUP = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=params["timeout"]))
    results = {}
    for name in scenarios:
        try:
            results[name] = ("ok", SCENARIOS[name](rank, world, params))
        except BaseException as e:  # noqa: BLE001 - sent to the test
            results[name] = ("fail", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        with open(result_file + ".tmp", "wb") as f:
            pickle.dump(results, f)
        os.replace(result_file + ".tmp", result_file)
    os._exit(0)  # no teardown: a dead peer must not make this one hang


def _spawn(tmp_path, world: int, scenarios: list[str], params: dict) -> tuple[list[int | None], list[dict]]:
    """Runs `scenarios` on `world` spawned ranks; returns their exit codes and results."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    tmp_path.mkdir(parents=True, exist_ok=True)
    init_file = str(tmp_path / f"rendezvous-{time.monotonic_ns()}")
    results = [str(tmp_path / f"result-{r}-{time.monotonic_ns()}.pkl") for r in range(world)]
    procs = [ctx.Process(target=_worker, args=(r, world, init_file, results[r], scenarios, params), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + JOIN_TIMEOUT
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if hung:
        pytest.fail(f"ranks {hung} still running after {JOIN_TIMEOUT} s (hung)")
    out = []
    for f in results:
        try:
            with open(f, "rb") as fh:
                out.append(pickle.load(fh))
        except FileNotFoundError:
            out.append({})
    return [p.exitcode for p in procs], out


def _check(results: list[dict], scenario: str, ranks=None) -> list:
    """The values the ranks returned for `scenario`; fails with the first rank's error."""
    values = []
    for r, res in enumerate(results):
        if ranks is not None and r not in ranks:
            continue
        assert scenario in res, f"rank {r} did not report {scenario!r}"
        status, value = res[scenario]
        assert status == "ok", f"rank {r}, {scenario}:\n{value}"
        values.append(value)
    return values


# --- scenarios (run inside the ranks) --------------------------------------------------


def _same(got: dict, want: dict, order: list[str] | None = None) -> None:
    assert sorted(got) == sorted(want), "keys differ"
    if order is not None:
        assert list(got) == order, "key order differs from tensorferry.torch.load_file"
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and tuple(g.shape) == tuple(w.shape), k
        assert tensor_bytes(g) == tensor_bytes(w), f"{k}: values differ"


_GROUP = None  # the group scenarios load with (set in _worker; default: the world)


def _world():
    import torch.distributed as dist
    return _GROUP if _GROUP is not None else dist.group.WORLD


def sc_full(rank, world, p):
    """Bit-exact against a plain load, with default and with tiny staging, through the
    packed path only (no in-place broadcasts) too."""
    path = p["mixed"]
    want = safetensors.torch.load_file(path)
    order = list(tft.load_file(path))
    reports = []
    for staging in (tfd.DEFAULT_STAGING_BYTES, STAGING, 1000):
        got = tfd.load_file(path, process_group=_world(), staging_bytes=staging)
        _same(got, want, order)
        reports.append(tfd.last_report())
    plan = tfd._plan
    tfd._plan = lambda owned, cap, direct_ok: plan(owned, cap, False)  # as with CUDA tensors over gloo
    try:
        got = tfd.load_file(path, process_group=_world(), staging_bytes=STAGING)
    finally:
        tfd._plan = plan
    _same(got, want, order)
    rep = tfd.last_report()
    assert rep["broadcasts"] >= sum(t.numel() * t.element_size() for t in want.values()) // STAGING
    # the torch drop-in delegates
    _same(tft.load_file(path, process_group=_world()), want, order)
    return reports


def sc_sharded_checkpoint(rank, world, p):
    """An index, its directory, and a list of its files."""
    want = safetensors.torch.load_file(p["mixed"])
    d = os.path.dirname(p["index"])
    files = sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".safetensors"))
    for src in (p["index"], d, files):
        got = tfd.load_checkpoint(src, process_group=_world(), staging_bytes=STAGING)
        _same(got, want)
    return tfd.last_report()


def sc_balance(rank, world, p):
    """Equal tensors: every rank reads exactly its share; the rest arrives over the group."""
    want = safetensors.torch.load_file(p["equal"])
    got = tfd.load_file(p["equal"], process_group=_world(), staging_bytes=STAGING)
    _same(got, want)
    rep = tfd.last_report()
    total = sum(t.numel() * t.element_size() for t in want.values())
    assert rep["bytes_read"] == total // world, rep
    assert rep["bytes_sent"] == rep["bytes_read"], rep
    assert rep["bytes_received"] == total - rep["bytes_read"], rep
    assert rep["tensors_owned"] == len(want) // world, rep
    # mixed sizes: within one tensor of the even share
    tfd.load_file(p["mixed"], process_group=_world())
    rep2 = tfd.last_report()
    sizes = [t.numel() * t.element_size() for t in safetensors.torch.load_file(p["mixed"]).values()]
    assert abs(rep2["bytes_read"] - sum(sizes) / world) <= max(sizes), rep2
    return rep, rep2


def _tp_specs(rank: int, world: int) -> list:
    return [
        {"q.*": (0, rank, world), "o.weight": (1, rank, world), "up.*": (-1, rank, world), "tiny": (0, rank, world)},
        lambda name: None if name == "norm" else (1 if name != "tiny" else 0, rank, world),
    ]


def sc_tp(rank, world, p, group=None, tp_rank=None, tp_world=None):
    """Each rank keeps its part of sharded tensors (= torch.tensor_split of the full one,
    = safe_open's get_slice) and reads only that; the others are broadcast."""
    group = group or _world()
    tp_rank = rank if tp_rank is None else tp_rank
    tp_world = world if tp_world is None else tp_world
    full = safetensors.torch.load_file(p["tp"])
    for spec in _tp_specs(tp_rank, tp_world):
        fn = tfd._shard_fn(spec)
        got = tfd.load_file(p["tp"], process_group=group, shard=spec, staging_bytes=STAGING)
        assert sorted(got) == sorted(full)
        rep = tfd.last_report()
        sharded_bytes = 0
        for name, t in full.items():
            s = fn(name)
            if s is None:
                want = t
            else:
                want = torch.tensor_split(t, s[2], s[0])[s[1]]
                sharded_bytes += want.numel() * want.element_size()
                with tensorferry.safe_open(p["tp"], "pt") as f:
                    dim = s[0] % t.dim()
                    a, b = tfd.shard_range(t.shape[dim], s[1], s[2])
                    ref = f.get_slice(name)[(slice(None),) * dim + (slice(a, b),)]
                assert tensor_bytes(ref) == tensor_bytes(want), name
            assert got[name].dtype == want.dtype and tuple(got[name].shape) == tuple(want.shape), name
            assert tensor_bytes(got[name]) == tensor_bytes(want), name
        # slices read: exactly the part's bytes; whole tensors: only what this rank owns
        assert sharded_bytes <= rep["bytes_read"] <= sharded_bytes + full["norm"].numel() * 4, rep
        assert rep["tensors_sharded"] == sum(1 for n in full if fn(n) is not None)
        # the torch drop-in delegates
        got2 = tft.load_file(p["tp"], process_group=group, shard=spec)
        for name in full:
            assert tensor_bytes(got2[name]) == tensor_bytes(got[name]), name
    return rep


def sc_bad_path(rank, world, p):
    """Rank 1 cannot open its file: it raises its own error, every other rank raises
    'rank 1 failed'; the group is still usable afterwards."""
    path = p["mixed"] if rank != 1 else p["mixed"] + ".missing"
    t0 = time.monotonic()
    try:
        tfd.load_file(path, process_group=_world())
    except tensorferry.TensorferryError as e:
        err = e
    else:
        raise AssertionError("no error")
    if rank == 1:
        assert isinstance(err, tensorferry.NotFoundError), repr(err)
    else:
        assert isinstance(err, tfd.DistributedError), repr(err)
        assert "rank 1 failed" in str(err) and "NotFoundError" in str(err), str(err)
    # afterwards, the same group loads fine
    _same(tfd.load_file(p["equal"], process_group=_world()), safetensors.torch.load_file(p["equal"]))
    return time.monotonic() - t0


def sc_mismatch(rank, world, p):
    """Ranks that open different checkpoints all raise rather than mix them up."""
    path = p["equal"] if rank == 0 else p["other"]
    try:
        tfd.load_file(path, process_group=_world())
    except tfd.DistributedError as e:
        assert "do not agree" in str(e)
    else:
        raise AssertionError("no error")


def sc_subgroups(rank, world, p):
    """World 4 as two groups of 2 loading different checkpoints (the broadcast source must
    be the owner's global rank), and tensor-parallel slices within each group."""
    import torch.distributed as dist
    timeout = datetime.timedelta(seconds=p["timeout"])
    groups = [dist.new_group([0, 1], timeout=timeout), dist.new_group([2, 3], timeout=timeout)]
    mine = groups[rank // 2]
    path = p["other"] if rank < 2 else p["mixed"]
    want = safetensors.torch.load_file(path)
    got = tfd.load_file(path, process_group=mine, staging_bytes=STAGING)
    _same(got, want, list(tft.load_file(path)))
    rep = tfd.last_report()
    assert rep["world"] == 2 and rep["rank"] == rank % 2
    sizes = [t.numel() * t.element_size() for t in want.values()]
    assert abs(rep["bytes_read"] - sum(sizes) / 2) <= max(sizes), rep
    sc_tp(rank, world, p, group=mine, tp_rank=rank % 2, tp_world=2)
    return rep


def sc_exit_in_read(rank, world, p):
    """Rank 1 dies while reading; the others must raise (not hang)."""
    loader = None
    if rank == 1:
        class Dying:
            def read_into(self, *a, **k):
                os._exit(3)
        loader = Dying()
    t0 = time.monotonic()
    try:
        tfd.load_file(p["mixed"], process_group=_world(), loader=loader)
    except tensorferry.TensorferryError as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    raise AssertionError("no error")


def sc_hang_in_read(rank, world, p):
    """Rank 1 hangs while reading (then dies): the others raise once the group's timeout
    has passed."""
    loader = None
    if rank == 1:
        class Hanging:
            def read_into(self, *a, **k):
                time.sleep(p["timeout"] + 2)
                os._exit(5)
        loader = Hanging()
    t0 = time.monotonic()
    try:
        tfd.load_file(p["mixed"], process_group=_world(), loader=loader)
    except tensorferry.TensorferryError as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    raise AssertionError("no error")


def sc_exit_in_broadcast(rank, world, p):
    """Rank 1 dies between two broadcasts; the others must raise (not hang)."""
    import torch.distributed as dist
    if rank == 1:
        calls = [0]
        real = dist.broadcast

        def dying(*a, **k):
            calls[0] += 1
            if calls[0] == 3:
                os._exit(4)
            return real(*a, **k)
        dist.broadcast = dying
    t0 = time.monotonic()
    try:
        tfd.load_file(p["mixed"], process_group=_world(), staging_bytes=1000)
    except tensorferry.TensorferryError as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    raise AssertionError("no error")


SCENARIOS = {
    "full": sc_full, "sharded_checkpoint": sc_sharded_checkpoint, "balance": sc_balance, "tp": sc_tp,
    "bad_path": sc_bad_path, "mismatch": sc_mismatch, "subgroups": sc_subgroups,
    "exit_in_read": sc_exit_in_read, "exit_in_broadcast": sc_exit_in_broadcast, "hang_in_read": sc_hang_in_read,
}


# --- the groups ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world2(ckpts, tmp_path_factory):
    codes, results = _spawn(tmp_path_factory.mktemp("w2"), 2,
                            ["full", "sharded_checkpoint", "balance", "tp", "bad_path", "mismatch"],
                            {**ckpts, "timeout": GROUP_TIMEOUT})
    assert codes == [0, 0], codes
    return results


@pytest.fixture(scope="module")
def world4(ckpts, tmp_path_factory):
    codes, results = _spawn(tmp_path_factory.mktemp("w4"), 4, ["full", "balance", "tp", "bad_path", "subgroups"],
                            {**ckpts, "timeout": GROUP_TIMEOUT})
    assert codes == [0, 0, 0, 0], codes
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_gets_the_plain_load(world, request):
    results = request.getfixturevalue(f"world{world}")
    reports = _check(results, "full")
    # the ranks read disjoint shares that add up to the checkpoint
    for i in range(3):
        reps = [r[i] for r in reports]
        assert sum(r["bytes_read"] for r in reps) == sum(r["bytes_sent"] for r in reps)
        total = sum(r["bytes_read"] for r in reps)
        assert all(r["bytes_read"] + r["bytes_received"] == total for r in reps), reps
        assert all(r["world"] == world and r["seconds"] > 0 for r in reps)
    # tiny staging: many packed broadcasts; default: a few
    assert reports[0][2]["broadcasts"] > reports[0][0]["broadcasts"]


def test_sharded_checkpoint_index_directory_and_files(world2):
    _check(world2, "sharded_checkpoint")


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_read_balanced(world, request):
    reps = _check(request.getfixturevalue(f"world{world}"), "balance")
    assert len({r[0]["bytes_read"] for r in reps}) == 1


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_slices(world, request):
    _check(request.getfixturevalue(f"world{world}"), "tp")


@pytest.mark.parametrize("world", [2, 4])
def test_a_failing_rank_fails_every_rank(world, request):
    times = _check(request.getfixturevalue(f"world{world}"), "bad_path")
    assert max(times) < GROUP_TIMEOUT


def test_ranks_disagreeing_on_the_checkpoint_raise(world2):
    _check(world2, "mismatch")


def test_subgroups(world4):
    _check(world4, "subgroups")


@pytest.mark.parametrize("scenario,code", [("exit_in_read", 3), ("exit_in_broadcast", 4), ("hang_in_read", 5)])
def test_a_dead_rank_makes_the_others_raise_not_hang(scenario, code, ckpts, tmp_path):
    codes, results = _spawn(tmp_path, 2, [scenario], {**ckpts, "timeout": KILL_TIMEOUT})
    assert codes == [0, code], codes
    (kind, msg, seconds), = _check(results, scenario, ranks=[0])
    assert kind == "DistributedError", msg
    assert seconds <= KILL_TIMEOUT + 3, seconds
    if scenario == "hang_in_read":  # nothing tells rank 0 but the group's timeout
        assert seconds >= KILL_TIMEOUT - 0.5, seconds


# --- without a group (in this process) -------------------------------------------------


def test_plain_load_and_report(ckpts):
    want = safetensors.torch.load_file(ckpts["mixed"])
    got = tfd.load_file(ckpts["mixed"])
    _same(got, want, list(tft.load_file(ckpts["mixed"])))
    rep = tfd.last_report()
    total = sum(t.numel() * t.element_size() for t in want.values())
    assert rep["bytes_read"] == total and rep["bytes_received"] == rep["bytes_sent"] == 0
    assert set(rep) >= {"bytes_read", "bytes_received", "bytes_sent", "seconds", "tensors_owned"}


@pytest.mark.parametrize("world", [1, 2, 3, 4, 11])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_shard_without_group_is_tensor_split(ckpts, world, dim):
    full = safetensors.torch.load_file(ckpts["tp"])
    for rank in range(world):
        got = tfd.load_file(ckpts["tp"], shard={"*.weight": (dim, rank, world)})
        read = 0
        for name, t in full.items():
            want = torch.tensor_split(t, world, dim)[rank] if name.endswith(".weight") else t
            read += want.numel() * want.element_size()
            assert tuple(got[name].shape) == tuple(want.shape), name
            assert tensor_bytes(got[name]) == tensor_bytes(want), name
        assert tfd.last_report()["bytes_read"] == read
        got2 = tft.load_file(ckpts["tp"], shard={"*.weight": (dim, rank, world)})
        assert all(tensor_bytes(got2[n]) == tensor_bytes(got[n]) for n in full)


def test_bad_shard_specs(ckpts):
    for spec in ({"q.weight": (2, 0, 2)}, {"q.weight": (0, 2, 2)}, {"q.weight": (0, 0, 0)}, {"q.weight": "x"},
                 42):
        with pytest.raises(tensorferry.InvalidArgumentError):
            tfd.load_file(ckpts["tp"], shard=spec)


def test_duplicate_names_across_files(ckpts):
    with pytest.raises(tensorferry.InvalidFileError):
        tfd.load_checkpoint([ckpts["tp"], ckpts["tp"]])


def test_assignment_is_deterministic_and_greedy():
    class L:
        tensors = {f"t{i}": ("U8", [n], 0, 0, n, 0, n) for i, n in enumerate([50, 40, 30, 30, 20, 10, 0])}
    owners = tfd._assign(L, list(L.tensors), 2)
    assert owners == {"t0": 0, "t1": 1, "t2": 1, "t3": 0, "t4": 1, "t5": 0}  # 90 / 90, empty t6 unowned
    assert tfd._assign(L, list(reversed(L.tensors)), 2) == owners


@pytest.mark.parametrize("direct", [True, False])
def test_plan_covers_every_byte_once(direct):
    owned = [[("a", 5), ("b", 100), ("c", 7)], [], [("d", 33), ("e", 1)]]
    plan = tfd._plan(owned, 16, direct)
    seen: dict[str, list] = {}
    for kind, r, what, n in plan:
        assert n <= 16 or kind == "direct"
        segs = [(what, 0, n)] if kind == "direct" else what
        assert sum(e - s for _, s, e in segs) == n
        for name, s, e in segs:
            assert any(name == x for x, _ in owned[r])
            seen.setdefault(name, []).append((s, e))
    for name, n in [x for o in owned for x in o]:
        spans = sorted(seen[name])
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_group_of_one_skips_collectives_and_matches_the_plain_load(ckpts, tmp_path, monkeypatch):
    """A group of one reads everything itself and calls no collective (so it costs what a
    plain load costs)."""
    import torch.distributed as dist

    path = ckpts["mixed"]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=20))
    try:
        calls = []
        for fn in ("all_reduce", "broadcast", "all_gather_object"):
            real = getattr(dist, fn)
            monkeypatch.setattr(dist, fn, lambda *a, _f=fn, _r=real, **k: (calls.append(_f), _r(*a, **k))[1])
        got = tfd.load_file(path, process_group=dist.group.WORLD)
        want = tft.load_file(path)
        assert list(got) == list(want)
        assert all(tensor_bytes(got[k]) == tensor_bytes(want[k]) for k in want)
        rep = tfd.last_report()
        assert calls == [] and rep["world"] == 1 and rep["broadcasts"] == 0
        assert rep["bytes_read"] == sum(t.numel() * t.element_size() for t in want.values())
    finally:
        dist.destroy_process_group()
