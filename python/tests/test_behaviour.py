"""Runtime behaviour: the GIL is released during loads, progress reporting, concurrent
use of one Loader, and Ctrl-C cancelling a load."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import safetensors.torch
import torch

import tensorferry
import tensorferry.numpy as tfn
import tensorferry.torch as tft
from conftest import assert_same_array, assert_same_dict, assert_same_tensor, random_tensor

BIG = 192 << 20


@pytest.fixture(scope="module")
def big_raw(tmp_path_factory) -> str:
    """A 192 MiB raw file with a recognisable pattern every 4 KiB (sparse in between)."""
    path = tmp_path_factory.mktemp("big") / "big.bin"
    with open(path, "wb") as f:
        f.truncate(BIG)
        for off in range(0, BIG, 1 << 20):
            f.seek(off)
            f.write(off.to_bytes(8, "little"))
    return str(path)


def _check_big(t: torch.Tensor) -> None:
    assert t.numel() == BIG
    idx = torch.arange(0, BIG, 1 << 20)
    heads = t.view(-1, 1 << 20)[:, :8].contiguous().view(torch.int64).reshape(-1)
    assert torch.equal(heads, idx)
    assert int(t.view(-1, 1 << 20)[:, 8:].count_nonzero()) == 0


# --- GIL --------------------------------------------------------------------------------


def test_gil_released_during_load(big_raw):
    """A Python thread keeps running while the main thread loads 192 MiB: over the loads it
    gets a good share of the progress it makes when the main thread merely sleeps. Were the
    GIL held during the read, it could only run in the few switch intervals when the main
    thread executes Python code (set to 1 ms here), a small fraction of the load's time."""
    count = [0]
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            count[0] = n

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    th = threading.Thread(target=spin, daemon=True)
    th.start()
    try:
        while count[0] == 0:
            time.sleep(0.001)
        # the spinner's speed alone (the main thread sleeps, GIL released)
        c0, t0 = count[0], time.perf_counter()
        time.sleep(0.1)
        rate = (count[0] - c0) / (time.perf_counter() - t0)
        loader = tensorferry.Loader(threads=1, engine="pread")
        advanced, window = 0, 0.0
        for _ in range(6):
            c0, t0 = count[0], time.perf_counter()
            t = tft.load_tensor(big_raw, None, dtype=torch.uint8, device="cpu", loader=loader)
            window += time.perf_counter() - t0
            advanced += count[0] - c0
            if window >= 0.3:
                break
    finally:
        stop.set()
        th.join()
        sys.setswitchinterval(old)
    _check_big(t)
    assert rate > 0
    share = advanced / (rate * window)
    print(f"GIL test: {advanced} iterations in {window:.3f}s of loading, {share:.0%} of the solo speed")
    assert advanced > 1000, f"the Python thread advanced only {advanced} times during {window:.3f}s of loading"
    assert share > 0.15, f"the Python thread ran {share:.0%} of its speed during loads (GIL held?)"


# --- progress ---------------------------------------------------------------------------


def test_on_progress_monotonic_and_final(tmp_path, big_raw):
    tensors = {f"t{i}": random_tensor((1000 + i, 7), torch.float32, seed=i) for i in range(5)}
    path = str(tmp_path / "p.safetensors")
    safetensors.torch.save_file(tensors, path)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    calls = []
    got = tft.load_file(path, on_progress=lambda d, t: calls.append((d, t)))
    assert_same_dict(got, tensors, order=False)
    assert calls, "on_progress never called"
    assert calls[-1] == (total, total)
    assert all(t == total for _, t in calls)
    assert all(a[0] <= b[0] for a, b in zip(calls, calls[1:]))
    assert all(0 <= d <= total for d, _ in calls)

    # a longer load (threads=1, 1.5 GiB from the page cache): still monotonic, ending at the total
    calls.clear()
    loader = tensorferry.Loader(threads=1, engine="pread")
    reps = 8
    out = torch.empty(BIG, dtype=torch.uint8)
    target = ("cpu", 0, out.data_ptr(), BIG)
    report = loader.read_into([big_raw], [(0, 0, BIG, 0, 0)] * reps, [target],
                              on_progress=lambda d, t: calls.append((d, t)))
    assert report["bytes"] == reps * BIG
    assert calls[-1] == (reps * BIG, reps * BIG)
    assert all(a[0] <= b[0] for a, b in zip(calls, calls[1:]))
    _check_big(out)


def test_on_progress_numpy_and_slices(tmp_path):
    arrays = {"a": np.arange(5000, dtype=np.int64), "b": np.ones((30, 30), np.float32)}
    path = str(tmp_path / "n.safetensors")
    safetensors.numpy.save_file(arrays, path)
    calls = []
    got = tfn.load_file(path, on_progress=lambda d, t: calls.append((d, t)))
    assert_same_array(got["a"], arrays["a"])
    assert calls[-1] == (5000 * 8 + 900 * 4,) * 2


def test_progress_true_writes_nothing_to_stdout(st_file, capfd):
    tensors = {"w": random_tensor((300, 300), torch.float32)}
    path = st_file(tensors)
    calls = []
    got = tft.load_file(path, progress=True, on_progress=lambda d, t: calls.append(d))
    got2 = tfn.load_file(path, progress=True)
    out, err = capfd.readouterr()
    assert out == ""
    assert_same_dict(got, tensors)
    assert_same_array(got2["w"], tensors["w"].numpy())
    assert calls and calls[-1] == 300 * 300 * 4  # the user callback still runs under progress=True


def test_last_report(st_file):
    path = st_file({"a": torch.zeros(1000), "b": torch.ones(10, dtype=torch.int8)})
    loader = tensorferry.Loader(engine="pread")
    tft.load_file(path, loader=loader)
    r = loader.last_report
    assert r["bytes"] == 4000 + 10
    assert r["seconds"] >= 0 and r["gbps"] >= 0
    assert len(r["files"]) == 1 and r["files"][0]["path"].endswith(os.path.basename(path))
    assert r["files"][0]["engine"] == "pread"
    assert loader.options["engine"] == "pread"
    assert "pread" in repr(loader)


# --- concurrency ------------------------------------------------------------------------


def test_many_threads_one_loader(tmp_path):
    files = []
    for i in range(6):
        tensors = {f"x{j}": random_tensor((50 + i * 7 + j, 9), torch.float32, seed=i * 10 + j) for j in range(4)}
        tensors["i"] = random_tensor((1000 + i,), torch.int64, seed=99 + i)
        path = str(tmp_path / f"c{i}.safetensors")
        safetensors.torch.save_file(tensors, path)
        files.append((path, tensors))
    loader = tensorferry.Loader(staging_size=64 << 10, slots=4)

    def work(k: int) -> int:
        path, tensors = files[k % len(files)]
        if k % 3 == 0:
            got = tft.load_file(path, loader=loader)
            assert_same_dict(got, tensors, order=False)
        elif k % 3 == 1:
            with tensorferry.safe_open(path, "pt", loader=loader) as f:
                assert_same_tensor(f.get_tensor("i"), tensors["i"])
                assert_same_tensor(f.get_slice("x1")[3:20], tensors["x1"][3:20])
        else:
            got = tfn.load_file(path, loader=loader)
            assert_same_array(got["x2"], tensors["x2"].numpy())
        return k

    with ThreadPoolExecutor(max_workers=8) as pool:
        assert sorted(pool.map(work, range(48))) == list(range(48))


def test_default_loader_is_shared_and_thread_safe(st_file):
    path = st_file({"a": random_tensor((100,), torch.int32)})
    with ThreadPoolExecutor(max_workers=4) as pool:
        loaders = list(pool.map(lambda _: tensorferry.default_loader(), range(16)))
        results = list(pool.map(lambda _: tft.load_file(path)["a"], range(16)))
    assert all(x is loaders[0] for x in loaders)
    for r in results:
        assert torch.equal(r, results[0])


# --- Ctrl-C -----------------------------------------------------------------------------

_INTERRUPT_SCRIPT = textwrap.dedent(r"""
    import json, os, signal, sys, threading, time
    import torch
    import tensorferry, tensorferry.torch as tft

    big, small, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    loader = tensorferry.Loader(threads=1, engine="pread")
    out = torch.empty(size, dtype=torch.uint8)
    target = ("cpu", 0, out.data_ptr(), size)
    calls = []
    started = abandon = None

    def on_progress(done, total):
        calls.append((done, total))
        if done < total:
            started.set()

    def ctrl_c(started, abandon):
        started.wait()
        if not abandon.is_set():
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # a real Ctrl-C

    result = {"interrupted": False}
    reps = 16
    for attempt in range(5):  # make the load longer until the signal lands during it
        calls.clear()
        started, abandon = threading.Event(), threading.Event()
        th = threading.Thread(target=ctrl_c, args=(started, abandon), daemon=True)
        th.start()
        try:
            loader.read_into([big], [(0, 0, size, 0, 0)] * reps, [target], on_progress=on_progress)
        except KeyboardInterrupt:
            result["interrupted"] = True
            result["total"] = reps * size
            result["last_done"] = calls[-1][0] if calls else None
            result["final_reported"] = bool(calls) and calls[-1][0] == reps * size
            break
        # finished before any intermediate progress: call the signal off, load more
        abandon.set()
        started.set()
        th.join()
        reps *= 4
    # a later load works, through the same loader and a fresh one
    full = tft.load_tensor(big, None, dtype=torch.uint8, device="cpu", loader=loader)
    heads = full.view(-1, 1 << 20)[:, :8].contiguous().view(torch.int64).reshape(-1)
    result["later_load_ok"] = bool(torch.equal(heads, torch.arange(0, size, 1 << 20)))
    result["small"] = tft.load_file(small)["a"].tolist()
    print(json.dumps(result))
""")


def test_ctrl_c_cancels_a_load_and_later_loads_work(tmp_path, big_raw):
    small = str(tmp_path / "small.safetensors")
    safetensors.torch.save_file({"a": torch.arange(5, dtype=torch.int32)}, small)
    script = tmp_path / "interrupt.py"
    script.write_text(_INTERRUPT_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), big_raw, small, str(BIG)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PanicException" not in proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["interrupted"], result
    assert not result["final_reported"], result  # cancelled: the load never completed
    assert result["last_done"] < result["total"]
    assert result["later_load_ok"]
    assert result["small"] == [0, 1, 2, 3, 4]


def test_exception_in_callback_cancels_and_loader_still_works(big_raw):
    loader = tensorferry.Loader(threads=1, engine="pread")
    out = torch.empty(BIG, dtype=torch.uint8)
    target = ("cpu", 0, out.data_ptr(), BIG)
    seen = []

    class Stop(Exception):
        pass

    def cb(done, total):
        seen.append(done)
        raise Stop

    with pytest.raises(Stop):
        loader.read_into([big_raw], [(0, 0, BIG, 0, 0)] * 4, [target], on_progress=cb)
    assert len(seen) == 1
    t = tft.load_tensor(big_raw, None, dtype=torch.uint8, device="cpu", loader=loader)
    _check_big(t)
