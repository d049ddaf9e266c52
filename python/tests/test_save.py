"""The native saver: byte-identical files through tiny staging (O_DIRECT on and off), CUDA
tensors saved from the device, sharded checkpoints in Hugging Face's layout, raw
positioned writes, and durability: a saving process killed at random points leaves the
previous file or nothing (never a partial file), and a full disk (a 2 MB tmpfs) gives a
clear error with the old file intact."""
from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

import tensorferry
import tensorferry.numpy as tfn
import tensorferry.torch as tft
from conftest import assert_same_array, assert_same_dict, assert_same_tensor, random_array, random_tensor


def _temps(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if ".tf-tmp-" in n)


def _tiny(direct: str) -> tensorferry.Saver:
    """Staging of three 4 KiB slots: tensors straddle slots and 4 KiB boundaries."""
    return tensorferry.Saver(threads=2, staging_size=4096, slots=3, direct=direct)


def _direct_refused(directory) -> str | None:
    probe = os.path.join(directory, ".direct-probe")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError as e:
        return f"O_DIRECT refused: {e}"
    try:
        import mmap
        buf = mmap.mmap(-1, 4096)
        os.pwrite(fd, buf, 0)
    except OSError as e:
        return f"O_DIRECT write refused: {e}"
    finally:
        os.close(fd)
        os.unlink(probe)
    return None


# --- byte identity, both directions ------------------------------------------------------


@pytest.mark.parametrize("direct", ["on", "off"])
def test_save_file_through_tiny_staging_is_byte_identical(tmp_path, all_dtypes_tensors, direct):
    saver = _tiny(direct)
    big = {"big.f32": random_tensor((3001, 3), torch.float32, seed=7), "odd.u8": random_tensor((10_007,), torch.uint8)}
    tensors = {**all_dtypes_tensors, **big}
    path = tmp_path / "m.safetensors"
    tft.save_file(tensors, str(path), metadata={"format": "pt"}, saver=saver)
    assert path.read_bytes() == safetensors.torch.save(tensors, metadata={"format": "pt"})
    assert_same_dict(safetensors.torch.load_file(str(path)), tensors, order=False)
    assert _temps(tmp_path) == []
    report = saver.last_report
    assert report["bytes"] == path.stat().st_size
    if direct == "on":
        why = _direct_refused(tmp_path)
        if why:
            pytest.skip(f"file contents checked; O_DIRECT not checked: {why}")
        assert report["files"][0]["direct"] is True
    else:
        assert report["files"][0]["direct"] is False


def test_save_from_device_matches_reference(tmp_path, device, all_dtypes_tensors):
    on_device = {k: v.to(device) for k, v in all_dtypes_tensors.items()}
    on_device["big"] = random_tensor((5000, 3), torch.bfloat16, seed=3).to(device)
    path = str(tmp_path / "dev.safetensors")
    for direct in ("on", "off"):
        tft.save_file(on_device, path, metadata={"k": "v"}, saver=_tiny(direct))
        want = safetensors.torch.save({k: v.cpu() for k, v in on_device.items()}, metadata={"k": "v"})
        assert open(path, "rb").read() == want, direct
    # And back through both libraries.
    assert_same_dict(safetensors.torch.load_file(path), {k: v.cpu() for k, v in on_device.items()}, order=False)
    assert_same_dict(tft.load_file(path, device=device), on_device, device, order=False)


def test_reference_file_resaved_by_tensorferry_is_identical(tmp_path, st_file, all_dtypes_tensors):
    # (One metadata key: the reference writes several in its hash map's order, which
    # changes from run to run.)
    ref = st_file(all_dtypes_tensors, metadata={"format": "pt"})
    got = tft.load_file(ref)
    out = str(tmp_path / "again.safetensors")
    tft.save_file(got, out, metadata={"format": "pt"})
    assert open(out, "rb").read() == open(ref, "rb").read()


@pytest.mark.parametrize("direct", ["on", "off"])
def test_numpy_save_file_through_tiny_staging(tmp_path, direct):
    arrays = {f"{np.dtype(d).name}.{i}": random_array(shape, d, seed=i)
              for i, (d, shape) in enumerate([("float32", (999, 5)), ("int8", (7,)), ("float64", ()),
                                              ("uint16", (0,)), ("bool", (13,)), ("complex64", (3, 3))])}
    arrays["strided"] = np.arange(4000, dtype=np.int32)[::2]  # not contiguous: packed
    path = str(tmp_path / "np.safetensors")
    tfn.save_file(arrays, path, metadata={"format": "np"}, saver=_tiny(direct))
    packed = {k: np.ascontiguousarray(v).reshape(v.shape) for k, v in arrays.items()}
    assert open(path, "rb").read() == safetensors.numpy.save(packed, metadata={"format": "np"})
    back = safetensors.numpy.load_file(path)
    for k, v in packed.items():
        assert_same_array(back[k], v, k)


def test_save_progress_and_report(tmp_path):
    seen = []
    saver = tensorferry.Saver(staging_size=4096, slots=2)
    t = {"a": random_tensor((300_000,), torch.float32)}
    tft.save_file(t, str(tmp_path / "p.safetensors"), saver=saver, on_progress=lambda d, n: seen.append((d, n)))
    size = os.path.getsize(tmp_path / "p.safetensors")
    assert seen and seen[-1] == (size, size)
    assert saver.last_report["bytes"] == size
    assert set(saver.options) == {"threads", "slot_size", "slots", "direct", "streams", "storage_options"}


# --- sharded checkpoints ------------------------------------------------------------------


def _hf_split(sizes: dict[str, int], limit: int) -> list[list[str]]:
    """huggingface_hub's split_state_dict_into_shards_factory, for the comparison."""
    shards, cur, cur_size = [], [], 0
    for k, n in sizes.items():
        if n > limit:
            shards.append([k])
            continue
        if cur_size + n > limit:
            shards.append(cur)
            cur, cur_size = [], 0
        cur.append(k)
        cur_size += n
    if cur:
        shards.append(cur)
    return shards


def test_save_sharded_hugging_face_layout(tmp_path, device):
    sd = {"model.embed_tokens.weight": random_tensor((64, 32), torch.bfloat16, seed=1)}
    for i in range(3):
        sd[f"model.layers.{i}.mlp.weight"] = random_tensor((40, 32), torch.bfloat16, seed=10 + i)
        sd[f"model.layers.{i}.norm.weight"] = random_tensor((32,), torch.float32, seed=20 + i)
    sd["lm_head.weight"] = random_tensor((200, 32), torch.bfloat16, seed=2)  # over the limit
    sd["model.norm.weight"] = random_tensor((32,), torch.float32, seed=3)
    on_device = {k: v.to(device) for k, v in sd.items()}
    d = tmp_path / "ck"
    tft.save_sharded(on_device, str(d), max_shard_size="5KB", metadata={"note": "hi"}, saver=_tiny("on"))
    sizes = {k: v.numel() * v.element_size() for k, v in sd.items()}
    shards = _hf_split(sizes, 5000)
    n = len(shards)
    assert n > 2
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    assert sorted(os.listdir(d)) == sorted(names + ["model.safetensors.index.json"])
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert index == {"metadata": {"total_size": sum(sizes.values()), "note": "hi"},
                     "weight_map": {k: names[i] for i, s in enumerate(shards) for k in s}}
    for name, keys in zip(names, shards):
        want = safetensors.torch.save({k: sd[k] for k in keys}, metadata={"format": "pt"})
        assert (d / name).read_bytes() == want, name
    # Loads back as a directory, an index, and shard by shard with the reference.
    assert_same_dict(tft.load_file(str(d)), sd, order=False)
    with tensorferry.safe_open(str(d), "pt") as f:
        assert f.metadata()["total_size"] == str(sum(sizes.values()))
        assert f.metadata()["note"] == "hi"
    ref = {}
    for name in names:
        ref.update(safetensors.torch.load_file(str(d / name)))
    assert_same_dict(ref, sd, order=False)

    # Everything in one file: model.safetensors, no index, metadata in its header; the
    # old shards and index are gone.
    tft.save_sharded(on_device, str(d), max_shard_size=1 << 30, metadata={"note": "one"})
    assert sorted(os.listdir(d)) == ["model.safetensors"]
    with safetensors.safe_open(str(d / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt", "note": "one"}
    assert_same_dict(safetensors.torch.load_file(str(d / "model.safetensors")), sd, order=False)


def test_save_sharded_sizes_and_refusals(tmp_path):
    sd = {f"t{i}": torch.zeros(250, dtype=torch.float32) for i in range(4)}  # 1000 bytes each
    for size, shards in [(2000, 2), ("2KB", 2), ("1KiB", 4), ("3.5kb", 2), (10_000, 1)]:
        d = tmp_path / f"s{shards}-{size}"
        tft.save_sharded(sd, str(d), max_shard_size=size)
        files = [n for n in os.listdir(d) if n.endswith(".safetensors")]
        assert len(files) == shards, size
    for bad in ("5XB", "", 0, -1, "GB", 1.5, True):
        with pytest.raises(ValueError):
            tft.save_sharded(sd, str(tmp_path / "bad"), max_shard_size=bad)
    with pytest.raises(ValueError, match="share memory"):
        base = torch.zeros(10)
        tft.save_sharded({"a": base, "b": base[2:]}, str(tmp_path / "shared"))
    with pytest.raises(ValueError, match="contiguous"):
        tft.save_sharded({"a": torch.zeros(3, 4).t()}, str(tmp_path / "nc"))
    assert not (tmp_path / "bad").exists() and not (tmp_path / "shared").exists()


# --- raw positioned writes ---------------------------------------------------------------


def test_handle_pwrite_from_device(tmp_path, device):
    path = str(tmp_path / "raw.bin")
    a = random_tensor((10_007,), torch.float32, seed=1).to(device)
    b = random_tensor((33,), torch.int8, seed=2).to(device)
    end = 5 + a.numel() * 4
    with tensorferry.Handle(staging_size=4096, slots=3) as h:
        assert h.async_pwrite(b, path, offset=end + 1).wait() == 33
        assert h.pwrite(a, path, offset=5) == a.numel() * 4
        back = torch.empty_like(a)
        h.pread(back, path, offset=5)
    assert_same_tensor(back, a)
    data = open(path, "rb").read()
    assert data[:5] == bytes(5) and data[end] == 0
    assert data[end + 1:] == b.cpu().numpy().tobytes()


def test_handle_pwrite_non_contiguous_and_numpy(tmp_path):
    path = str(tmp_path / "nc.bin")
    t = torch.arange(12, dtype=torch.int16).reshape(3, 4).t()
    a = np.arange(20, dtype=np.int32)[::2]
    with tensorferry.Handle() as h:
        h.pwrite(t, path)
        h.pwrite(a, path, offset=24)
    data = open(path, "rb").read()
    assert data[:24] == t.contiguous().numpy().tobytes()
    assert data[24:] == np.ascontiguousarray(a).tobytes()


# --- durability -----------------------------------------------------------------------------

_CHILD = textwrap.dedent("""
    import sys
    import torch
    import tensorferry, tensorferry.torch as tft
    path, direct = sys.argv[1], sys.argv[2]
    saver = tensorferry.Saver(staging_size=1 << 16, slots=4, direct=direct)
    versions = [{"w": torch.full((4 << 20,), float(v)), "b": torch.arange(1000, dtype=torch.int64) + v}
                for v in range(2)]
    print("ready", flush=True)
    i = 0
    while True:
        tft.save_file(versions[i % 2], path, metadata={"v": str(i % 2)}, saver=saver)
        i += 1
""")


@pytest.mark.parametrize("direct", ["on", "off"])
def test_killed_save_leaves_previous_file_or_nothing(tmp_path, direct):
    path = tmp_path / "m.safetensors"
    versions = [{"w": torch.full((4 << 20,), float(v)), "b": torch.arange(1000, dtype=torch.int64) + v}
                for v in range(2)]
    whole = {tft.save(t, metadata={"v": str(v)}) for v, t in enumerate(versions)}
    rng = random.Random(1234 if direct == "on" else 4321)
    outcomes = []
    for i in range(6):
        child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path), direct],
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "ready"
            # The first kill comes early, most likely during the very first save.
            time.sleep(rng.uniform(0.0, 0.02) if i == 0 else rng.uniform(0.0, 0.6))
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
        state = "whole" if path.exists() else "none"
        if path.exists():
            assert path.read_bytes() in whole, "a partial or mixed file under the final name"
        outcomes.append(f"{state}{'+temp' if _temps(tmp_path) else ''}")
    print(f"outcomes: {outcomes}")
    # A later save removes whatever temporaries the killed ones left.
    tft.save_file({"x": torch.ones(3)}, str(path))
    assert _temps(tmp_path) == []
    assert_same_dict(safetensors.torch.load_file(str(path)), {"x": torch.ones(3)})


def test_error_keeps_previous_file_and_removes_temporary(tmp_path):
    path = str(tmp_path / "m.safetensors")
    tft.save_file({"a": torch.ones(10)}, path)
    before = open(path, "rb").read()
    with pytest.raises(ValueError):
        tft.save_file({"a": torch.ones(10), 3: torch.ones(1)}, path)  # type: ignore[dict-item]
    def cancel(done, total):
        if done < total:  # (not once the file is complete)
            raise KeyboardInterrupt

    # Slow on purpose (4 KiB writes), so that the callback runs before the end.
    slow = tensorferry.Saver(staging_size=4096, slots=2, threads=1, direct="on")
    with pytest.raises(KeyboardInterrupt):
        tft.save_file({"big": torch.zeros(40_000_000, dtype=torch.uint8)}, path, saver=slow, on_progress=cancel)
    assert open(path, "rb").read() == before
    assert _temps(tmp_path) == []


@pytest.fixture
def small_fs(tmp_path):
    """A 2 MB tmpfs (needs root; skipped with the reason otherwise)."""
    d = tmp_path / "small"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2M", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip() or r.returncode}")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], capture_output=True)


def test_disk_full_gives_a_clear_error_and_keeps_the_old_file(small_fs):
    path = small_fs / "m.safetensors"
    tft.save_file({"a": torch.ones(25_000)}, str(path))
    before = path.read_bytes()
    for direct in ("off", "on"):
        with pytest.raises(tensorferry.WriteError) as ei:
            tft.save_file({"a": torch.ones(750_000)}, str(path), saver=tensorferry.Saver(direct=direct))
        assert isinstance(ei.value, OSError)
        assert ei.value.errno == errno.ENOSPC
        assert str(path) in str(ei.value)
        assert "No space left" in str(ei.value)
        assert path.read_bytes() == before
        assert _temps(small_fs) == []
    with pytest.raises(OSError) as ei:
        tfn.save_file({"a": np.ones(750_000, np.float32)}, str(path))
    assert ei.value.errno == errno.ENOSPC
    # A raw write runs out of room part way: the same kind of error.
    with tensorferry.Handle() as h:
        with pytest.raises(tensorferry.WriteError) as ei:
            h.pwrite(torch.ones(750_000), str(small_fs / "raw.bin"))
    assert ei.value.errno == errno.ENOSPC and "raw.bin" in str(ei.value)
    assert path.read_bytes() == before
