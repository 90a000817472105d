"""Per-shard checksums, `verify --deep` catching changed bytes, `seal`, and the shard-file checks."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from tests.conftest import make_cache
from tests.saev_fixture import tree_state, write_saev_cache

from actcache import checksums
from actcache.deepscan import _scan_file
from actcache.errors import ConfigError, ProtocolError
from actcache.protocol import shard_name
from actcache.seal import seal
from actcache.validate import check_dir
from actcache.writer import gather

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args):
    return subprocess.run([sys.executable, "-m", "actcache.cli", *args], capture_output=True, text=True, timeout=120)


def _load_damage():
    spec = importlib.util.spec_from_file_location("damage", os.path.join(ROOT, "scripts", "damage.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


damage = _load_damage()
_flip, _zero, _duplicate = damage.flip_byte, damage.zero_shard, damage.duplicate_shard


@pytest.mark.parametrize("kind", sorted(damage.DAMAGES))
def test_verify_deep_fails_naming_the_shard_whose_bytes_changed(tmp_path, kind):
    path, md, _ = make_cache(tmp_path)
    assert check_dir(path).ok and check_dir(path, deep=True).checksums == "checksums of all 3 shard(s) match"
    victim = shard_name(1)
    damage.DAMAGES[kind](path, victim)
    assert check_dir(path).ok  # sizes, names and the hash still agree
    rep = check_dir(path, deep=True)
    assert damage.caught_by_verify(path, victim)
    assert any(victim in p and "checksum mismatch" in p for p in rep.problems), rep.problems


def test_cli_verify_deep_reports_a_flipped_byte_with_exit_1(small_cache):
    path, _, _ = small_cache
    _flip(path, shard_name(2), offset=7)
    proc = run("verify", "--deep", path)
    assert proc.returncode == 1 and "checksum mismatch" in proc.stdout and shard_name(2) in proc.stdout


def test_cache_without_checksums_says_so_and_seal_adds_them(small_cache):
    path, _, _ = small_cache
    shutil.rmtree(checksums.record_dir(path))
    rep = check_dir(path, deep=True)
    assert rep.ok and rep.checksums.startswith("no checksums")
    proc = run("seal", path)
    assert proc.returncode == 0 and "3 shard(s) given checksums" in proc.stdout, proc.stdout + proc.stderr
    assert "match" in check_dir(path, deep=True).checksums
    assert run("seal", path).stdout.count("0 shard(s) given checksums") == 1  # nothing left to seal
    _zero(path, shard_name(0))
    rep = check_dir(path, deep=True)
    assert any("checksum mismatch" in p for p in rep.problems) and any("every value is zero" in p for p in rep.problems)


def test_seal_refuses_an_invalid_cache_and_writes_nothing(small_cache):
    path, _, _ = small_cache
    shutil.rmtree(checksums.record_dir(path))
    _duplicate(path, shard_name(1))  # same bytes as shard 0: caught without any record
    rep, new = seal(path)
    assert not rep.ok and new == [] and not os.path.exists(checksums.record_dir(path))
    assert any("same bytes as acts000000.bin" in p for p in rep.problems)
    assert run("seal", path).returncode == 1


def test_saev_cache_is_sealed_only_into_a_directory_the_user_names(tmp_path):
    path, _, _ = write_saev_cache(tmp_path, n=7)
    before = tree_state(path)
    with pytest.raises(ConfigError, match="never writes into a cache it did not create"):
        seal(path)
    with pytest.raises(ConfigError, match="outside"):
        seal(path, to=os.path.join(path, "sums"))
    out = str(tmp_path / "saev-sums")
    rep, new = seal(path, to=out)
    assert rep.ok and new == [shard_name(0), shard_name(1), shard_name(2)]
    assert tree_state(path) == before  # not one byte written into the saev cache
    assert "match" in check_dir(path, deep=True, checksums_dir=out).checksums
    assert check_dir(path, deep=True).checksums.startswith("no checksums")
    _flip(path, shard_name(1), offset=4)
    proc = run("verify", "--deep", path, "--checksums", out)
    assert proc.returncode == 1 and "checksum mismatch" in proc.stdout and shard_name(1) in proc.stdout


def test_a_record_of_another_cache_is_not_trusted(tmp_path):
    one, _, _ = make_cache(tmp_path / "a", seed=1)
    two, _, _ = make_cache(tmp_path / "b", seed=2, n_imgs=11)
    rep = check_dir(one, deep=True, checksums_dir=checksums.record_dir(two))
    assert not rep.ok and any("not of this one" in p for p in rep.problems)
    with open(checksums.record_path(checksums.record_dir(one), shard_name(0)), "w") as fd:
        fd.write('{"algorithm": "xxh3_64-blocks", "block_bytes": 1099511627776}')
    rep = check_dir(one, deep=True)
    assert any("not a checksum record" in p for p in rep.problems)


def test_plain_verify_reports_a_shard_linked_twice_a_link_out_and_an_unreadable_shard(tmp_path):
    path, _, _ = make_cache(tmp_path / "c")
    s0, s1, s2 = (os.path.join(path, shard_name(i)) for i in range(3))
    os.unlink(s1)
    os.symlink(shard_name(0), s1)  # the same file under two names
    outside = tmp_path / "elsewhere.bin"
    shutil.move(s2, outside)
    os.symlink(outside, s2)
    problems = check_dir(path).problems
    assert any(s1 in p and "the same file as acts000000.bin" in p for p in problems), problems
    assert any(s2 in p and "leading out of the cache directory" in p for p in problems), problems
    os.unlink(s2)
    os.mkdir(s2)  # a name that cannot be read as a file
    assert any(s2 in p and "not a regular file" in p for p in check_dir(path).problems)


def test_nan_report_names_the_image_layer_token_and_dim(tmp_path):
    path, md, _ = make_cache(tmp_path)  # 4 images per shard, layers (3, 7), 5 tokens, d 8
    img, layer_idx, token, dim = 6, 1, 2, 5
    offset = (((img - 4) * 2 + layer_idx) * 5 + token) * 8 + dim
    arr = np.fromfile(os.path.join(path, shard_name(1)), np.float32)
    arr[offset] = np.nan
    arr.tofile(os.path.join(path, shard_name(1)))
    rep = check_dir(path, deep=True)
    assert any("the first at image 6, layer 7, token 2, dim 5" in p for p in rep.problems), rep.problems


def test_gather_refuses_metadata_that_no_longer_matches_the_directory_name(small_cache):
    path, _, _ = small_cache
    os.unlink(os.path.join(path, "shards.json"))
    meta = os.path.join(path, "metadata.json")
    with open(meta) as fd:
        text = fd.read()
    with open(meta, "w") as fd:
        fd.write(text.replace('"test/ckpt"', '"test/other"'))
    with pytest.raises(ProtocolError, match="hashes to"):
        gather(path)
    assert not os.path.exists(os.path.join(path, "shards.json"))


def test_the_writer_stream_digest_equals_the_parallel_block_scan(tmp_path):
    data = np.random.default_rng(0).standard_normal(10_000, dtype=np.float32)
    f = tmp_path / "f.bin"
    data.tofile(f)
    h = checksums.StreamHasher(block_bytes=4096)
    for piece in np.array_split(data.view(np.uint8), [5, 4096, 4100, 30_000]):
        h.update(piece)
    for n_threads in (1, 3):
        assert _scan_file(str(f), valid=36_000, n_threads=n_threads, block=4096).digest != h.digest()
        assert _scan_file(str(f), valid=40_000, n_threads=n_threads, block=4096).digest == h.digest()


def test_plain_verify_fails_on_a_shard_without_read_permission(small_cache):
    path, _, _ = small_cache
    os.chmod(os.path.join(path, shard_name(1)), 0)
    # root reads any file: drop the capabilities that let it (as an ordinary user is without them)
    as_user = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
    proc = subprocess.run([*as_user, sys.executable, "-m", "actcache.cli", "verify", path],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 1 and "cannot be read (Permission denied)" in proc.stdout, proc.stdout + proc.stderr
    assert shard_name(1) in proc.stdout
