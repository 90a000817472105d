"""actcache hash / inspect / verify / gather through the real console script."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
from tests.conftest import make_cache

from actcache.protocol import canonical_json, shard_name


def run(*args, check=None):
    proc = subprocess.run([sys.executable, "-m", "actcache.cli", *args], capture_output=True, text=True, timeout=120)
    if check is not None:
        assert proc.returncode == check, proc.stdout + proc.stderr
    return proc


def test_hash(small_cache):
    path, md, _ = small_cache
    doc = json.load(open(os.path.join(path, "metadata.json")))
    want = hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert canonical_json(doc) == json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    out = run("hash", os.path.join(path, "metadata.json"), check=0)
    assert out.stdout.strip() == want == os.path.basename(path)
    assert run("hash", path, check=0).stdout.strip() == want


def test_inspect_and_verify_ok(small_cache):
    path, md, _ = small_cache
    out = run("inspect", path, check=0).stdout
    assert md.hash in out and "OK" in out and shard_name(2) in out and "zero-padded" in out
    info = json.loads(run("inspect", path, "--json", check=0).stdout)
    assert info["ok"] and info["derived"]["n_shards"] == 3 and len(info["shards"]) == 3
    deep = run("verify", "--deep", path, check=0).stdout
    assert "0 NaN/Inf" in deep


def test_verify_deep_counts_nan_inf(small_cache):
    path, md, _ = small_cache
    mm = np.memmap(os.path.join(path, shard_name(1)), np.float32, "r+", shape=md.shard_shape)
    mm[0, 0, 0, :3] = [np.nan, np.inf, -np.inf]
    mm.flush()
    del mm
    run("verify", path, check=0)  # the shallow check does not read values
    proc = run("verify", "--deep", path, check=1)
    assert "3 NaN/Inf" in proc.stdout and shard_name(1) in proc.stdout
    info = json.loads(run("verify", "--deep", "--json", path, check=1).stdout)
    assert info["n_nonfinite"] == 3


def test_verify_reports_problems(small_cache):
    path, md, _ = small_cache
    with open(os.path.join(path, shard_name(0)), "r+b") as fd:
        fd.truncate(10)
    proc = run("verify", path, check=1)
    assert "INVALID" in proc.stdout and "truncated" in proc.stdout
    proc = run("verify", os.path.join(path, "nope"), check=1)
    assert "directory not found" in proc.stdout


def test_user_errors_have_no_traceback(tmp_path):
    bad = tmp_path / "metadata.json"
    bad.write_text("{not json")
    proc = run("hash", str(bad), check=2)
    assert "not valid JSON" in proc.stderr and "Traceback" not in proc.stderr


def test_gather_refuses_and_lists(tmp_path):
    path, md, _ = make_cache(tmp_path, n_imgs=10, imgs_per_shard=4)
    os.unlink(os.path.join(path, "shards.json"))
    os.unlink(os.path.join(path, shard_name(0)))
    with open(os.path.join(path, shard_name(2)), "r+b") as fd:
        fd.truncate(7)
    proc = run("gather", path, check=2)
    assert shard_name(0) in proc.stderr and "missing" in proc.stderr and shard_name(2) in proc.stderr
    assert not os.path.exists(os.path.join(path, "shards.json"))


def test_deep_scan_counts_every_chunk_but_not_the_padded_tail(tmp_path, monkeypatch):
    from actcache import deepscan

    monkeypatch.setattr(deepscan, "CHUNK", 4096)  # many chunks, checked by several threads
    x = np.zeros(10_000, np.float32)
    x[[0, 1023, 1024, 5000, 8191]] = [np.nan, np.inf, -np.inf, np.nan, np.inf]  # chunk edges included
    x[9000] = np.nan  # in the tail past `valid`: read, not counted
    f = tmp_path / "f.bin"
    x.tofile(f)
    for n_threads in (1, 2, 3):
        scan = deepscan._scan_file(str(f), valid=9000 * 4, n_threads=n_threads)
        assert (scan.size, scan.n_bad, scan.first_bad) == (40_000, 5, 0)
    assert deepscan._scan_file(str(f), valid=40_000).n_bad == 6
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    scan = deepscan._scan_file(str(empty), valid=0)
    assert (scan.size, scan.n_bad, scan.digest) == (0, 0, None)


def test_deep_scan_passes_large_finite_values_and_tiny_ones_without_a_warning(tmp_path):
    import warnings

    from actcache import deepscan

    x = np.full(4096, 3e20, np.float32)  # squares overflow float32: still finite values
    x[:100] = 1e-30  # squares underflow to zero: not an all-zero file
    f = tmp_path / "f.bin"
    x.tofile(f)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scan = deepscan._scan_file(str(f), valid=x.nbytes)
    assert (scan.n_bad, scan.all_zero) == (0, False)
    x[:] = 1e-30
    x.tofile(f)
    assert not deepscan._scan_file(str(f), valid=x.nbytes).all_zero


def test_version_prints_the_package_version():
    from actcache import __version__

    proc = run("--version", check=0)
    assert proc.stdout.strip() == f"actcache {__version__}"
