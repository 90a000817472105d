"""16-bit caches (cache.dtype, protocol 2.0): rounding, metadata and hash, v1 readers refusing
them, the breaking warning, dump, verify --deep, inspect, convert, and kills during both."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import typing
import warnings

import beartype
import numpy as np
import pytest
import torch

from actcache.cache import ActivationCache
from actcache.cli import main
from actcache.config import CacheConfig, experiment_from_dict, load_experiment
from actcache.dtypes import to_float32, to_stored
from actcache.errors import ConfigError, ProtocolError, VersionError
from actcache.protocol import PROTOCOL_VERSION, Metadata, ProtocolWarning, read_json
from actcache.saev import SaevMetadata
from actcache.validate import check_dir
from actcache.writer import gather, synthetic_fill, synthetic_metadata, write_cache
from fixtures_vit import make_checkpoint
from test_dump import ROOT, hash_dirs, make_images, temp_files, write_experiment
from test_dump_kill import start_dump, wait_for

EDGES = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 65504, 65520, 65519.996, 1e-8, 6e-8, 3.0e-5, 3.39e38, 3.4e38]
EDGES += [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-8), 2**-126, 2**-133, 2**-149]


def shard_files(path) -> dict[str, bytes]:
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".bin"):
            with open(os.path.join(path, name), "rb") as fd:
                out[name] = fd.read()
    return out


def _random_f32(n: int) -> np.ndarray:
    rng = np.random.default_rng(7)
    scaled = rng.standard_normal(n).astype(np.float32) * np.exp2(rng.integers(-140, 120, n)).astype(np.float32)
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)  # NaN payloads too
    return np.concatenate([np.array(EDGES, np.float32), scaled, bits])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_to_16_bit_rounds_as_torch_and_back_is_exact(dtype):
    x = _random_f32(200_000)
    with np.errstate(all="ignore"):
        ours = to_stored(x, dtype).view(np.uint16)
    theirs = torch.from_numpy(x).to(getattr(torch, dtype)).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(ours[~nan], theirs[~nan])  # round to nearest even, overflow to Inf, Inf kept
    back = to_float32(ours, dtype)
    assert np.isnan(back[nan]).all() and np.array_equal(np.signbit(back[nan]), np.signbit(x[nan]))
    ref = torch.from_numpy(theirs.view(np.int16)).view(getattr(torch, dtype)).float().numpy()
    assert np.array_equal(back[~nan].view(np.uint32), ref[~nan].view(np.uint32))  # widening is exact


def test_float32_stays_v1_and_16_bit_is_2_0_with_its_own_hash():
    v1 = synthetic_metadata(100)
    assert v1.protocol == PROTOCOL_VERSION and v1.to_dict()["dtype"] == "float32"
    for dtype in ("float16", "bfloat16"):
        md = synthetic_metadata(100, dtype=dtype)
        assert (md.protocol, md.to_dict()["dtype"], md.to_dict()["protocol"]) == ("2.0.0", dtype, "2.0.0")
        assert md.shard_shape == v1.shard_shape and md.n_shards == v1.n_shards  # sizing in vectors
        assert md.shard_nbytes * 2 == v1.shard_nbytes and md.hash != v1.hash
        assert Metadata.from_dict(md.to_dict()) == md
    with pytest.raises(VersionError, match="float16.*protocol 2.0.0"):
        Metadata.from_dict(dict(v1.to_dict(), dtype="float16"))
    assert CacheConfig().dtype == "float32"
    with pytest.raises(ConfigError, match="exp.yaml: key 'cache.dtype' must be one of float32, float16, bfloat16"):
        experiment_from_dict(
            {"vit": {"family": "clip", "ckpt": "x/y", "layers": [-2]}, "data": {"kind": "synthetic", "n_imgs": 4},
             "cache": {"dtype": "float64"}}, source="exp.yaml",
        )  # fmt: skip


@beartype.beartype
@dataclasses.dataclass(frozen=True)
class SeedV1Metadata:
    """saev's protocol-1 reader, as the protocol sheet gives it (beartype checks every field)."""

    vit_family: typing.Literal["clip", "siglip", "dinov2"]
    vit_ckpt: str
    layers: tuple[int, ...]
    n_patches_per_img: int
    cls_token: bool
    d_vit: int
    n_imgs: int
    max_patches_per_shard: int
    data: dict[str, object]
    dtype: typing.Literal["float32"] = "float32"
    protocol: typing.Literal["1.0.0"] = "1.0.0"


def _seed_load(doc: dict) -> SeedV1Metadata:
    return SeedV1Metadata(**dict(doc, layers=tuple(doc["layers"])))


def test_v1_readers_refuse_a_2_0_cache_by_its_version(tmp_path):
    md = synthetic_metadata(6, dtype="bfloat16")
    doc = read_json(md.dump(tmp_path))
    assert _seed_load(synthetic_metadata(6).to_dict()).protocol == "1.0.0"  # the seed reader reads v1
    with pytest.raises(beartype.roar.BeartypeException):
        _seed_load(doc)
    with pytest.raises(beartype.roar.BeartypeException, match="protocol"):  # the version alone suffices
        _seed_load(dict(doc, dtype="float32"))
    with pytest.raises(VersionError, match=r"protocol 2\.0\.0, but this reader reads protocol 1\.0\.0"):
        Metadata.from_dict(doc, readable=(PROTOCOL_VERSION,))  # actcache's reader before 2.0
    with pytest.raises(ProtocolError, match="saev 2.1 metadata.json has exactly the keys"):
        SaevMetadata.from_dict(doc)


def test_opening_a_2_0_cache_warns_once_and_reads_float32_or_stored(tmp_path):
    md = synthetic_metadata(9, dtype="float16", max_patches_per_shard=17 * 4)
    path = write_cache(tmp_path, md, synthetic_fill(md))
    want = to_float32(to_stored(synthetic_fill(md)(0, 9), "float16"), "float16")
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        a = ActivationCache.open(path)
        b = ActivationCache.open(path, out_dtype="stored")
    assert [str(w.message).count("readers of protocol 1.x") for w in got if w.category is ProtocolWarning] == [1]
    assert a[3].dtype == np.float32 and np.array_equal(a[3], want[3]) and np.array_equal(a[2:7], want[2:7])
    assert b[3].dtype == np.float16 and np.array_equal(b[[1, 8], -2, 0], want[[1, 8], 0, 0].astype(np.float16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ActivationCache.open(write_cache(tmp_path / "v1", synthetic_metadata(4), synthetic_fill(synthetic_metadata(4))))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_verify_deep_counts_non_finite_16_bit_values(tmp_path, dtype):
    md = synthetic_metadata(5, dtype=dtype, d_vit=8)
    acts = np.ones((5, 1, 17, 8), np.float32)
    acts[1, 0, 2, 3], acts[4, 0, 16, 7], acts[2, 0, 0, 0] = np.nan, -np.inf, 1e30  # 1e30: Inf in float16 only
    path = write_cache(tmp_path, md, lambda s, e: acts[s:e])
    rep = check_dir(path, deep=True)
    assert rep.n_nonfinite == (3 if dtype == "float16" else 2) and not rep.ok


def test_convert_writes_a_verified_new_hash_dir_and_inspect_names_the_readers(tmp_path, capsys):
    md = synthetic_metadata(30, max_patches_per_shard=17 * 7)
    src = write_cache(tmp_path / "src", md, synthetic_fill(md))
    assert main(["convert", src, "--dtype", "bfloat16", "--to", str(tmp_path / "bf")]) == 0
    dest = capsys.readouterr().out.strip()
    bf = Metadata.load(dest)
    assert os.path.basename(dest) == bf.hash and (bf.dtype, bf.protocol) == ("bfloat16", "2.0.0")
    assert np.array_equal(
        ActivationCache.open(dest)[:], to_float32(to_stored(ActivationCache.open(src)[:], "bfloat16"), "bfloat16")
    )
    assert sum(os.path.getsize(os.path.join(dest, n)) for n in shard_files(dest)) * 2 == sum(
        os.path.getsize(os.path.join(src, n)) for n in shard_files(src)
    )
    assert main(["inspect", "--json", dest]) == 0
    fmt = json.loads(capsys.readouterr().out)["format"]
    assert "protocol 2.0.0 (bfloat16" in fmt["what"] and "protocol-1 readers refuse it by version" in fmt["readers"]
    assert "no saev release reads 16-bit" in fmt["readers"] and "--to-format saev" in fmt["readers"]
    assert main(["inspect", src]) == 0
    assert "every protocol-1 reader" in capsys.readouterr().out
    assert main(["convert", dest, "--dtype", "bfloat16", "--to", str(tmp_path / "x")]) == 2
    assert "already stores bfloat16" in capsys.readouterr().err and not os.path.exists(tmp_path / "x")
    # back to v1: the values stay rounded under the original float32 cache's hash, so only when asked
    assert main(["convert", dest, "--dtype", "float32", "--to", str(tmp_path / "back")]) == 2
    err = capsys.readouterr().err
    assert "rounded to bfloat16" in err and "--allow-rounded" in err and not os.path.exists(tmp_path / "back")
    assert main(["convert", dest, "--dtype", "float32", "--to", str(tmp_path / "back"), "--allow-rounded"]) == 0
    back = capsys.readouterr().out.strip()
    assert Metadata.load(back).protocol == "1.0.0" and os.path.basename(back) == os.path.basename(src)


def _convert_cmd(src, to) -> list[str]:
    return [sys.executable, "-m", "actcache.cli", "convert", src, "--dtype", "float16", "--to", to]


def test_kill_during_convert_leaves_no_complete_shard_and_a_rerun_is_byte_identical(tmp_path):
    md = synthetic_metadata(4000, d_vit=64, max_patches_per_shard=17 * 200)  # 20 shards of 0.9 MiB
    src = write_cache(tmp_path / "src", md, lambda s, e: np.full((e - s, 1, 17, 64), s + 1, np.float32))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    ref = subprocess.run(_convert_cmd(src, str(tmp_path / "ref")), capture_output=True, text=True, env=env, cwd=ROOT)
    ref_dir = ref.stdout.strip()
    to = str(tmp_path / "killed")
    proc = subprocess.Popen(_convert_cmd(src, to), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT)

    def mid_shard():
        dirs = hash_dirs(to)
        return bool(dirs and temp_files(dirs[0]))

    assert wait_for(proc, mid_shard, timeout=60)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (dest,) = hash_dirs(to)
    assert not os.path.exists(os.path.join(dest, "shards.json"))
    ref_files = shard_files(ref_dir)
    for name, data in shard_files(dest).items():  # what survived is complete and right
        assert data == ref_files[name]
    assert len(shard_files(dest)) < md.n_shards
    rerun = subprocess.run(_convert_cmd(src, to), capture_output=True, text=True, env=env, cwd=ROOT)
    assert rerun.returncode == 0, rerun.stderr
    assert shard_files(dest) == ref_files and not temp_files(dest)
    assert open(os.path.join(dest, "shards.json")).read() == open(os.path.join(ref_dir, "shards.json")).read()


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    """A float32 and a bfloat16 dump of the same images by the same tiny ViT."""
    from actcache.dump import dump_shards

    root = tmp_path_factory.mktemp("half-dump")
    ckpt = make_checkpoint(str(root / "ckpt"), "clip")
    make_images(str(root / "imgs"), n=16, seed=2)
    exps, refs = {}, {}
    for dt in ("float32", "bfloat16"):
        path = write_experiment(root / f"{dt}.yaml", ckpt, root / "imgs", batch_size=2, n_workers=0)
        with open(path) as fd:
            doc = fd.read().replace("cache:\n", f"cache:\n  dtype: {dt}\n")
        with open(path, "w") as fd:
            fd.write(doc)
        exps[dt] = path
        refs[dt] = dump_shards(load_experiment(path), None, str(root / f"ref-{dt}"), progress=False)
    return exps, refs


def test_a_16_bit_dump_casts_on_the_device_as_torch_rounds(dumped):
    exps, refs = dumped
    md = Metadata.load(refs["bfloat16"])
    assert (md.dtype, md.protocol) == ("bfloat16", "2.0.0") and md.hash != Metadata.load(refs["float32"]).hash
    f32 = np.concatenate([np.frombuffer(b, np.float32) for b in shard_files(refs["float32"]).values()])
    bf = np.concatenate([np.frombuffer(b, np.uint16) for b in shard_files(refs["bfloat16"]).values()])
    assert bf.nbytes * 2 == f32.nbytes and np.array_equal(bf, to_stored(f32, "bfloat16"))


def test_kill_during_a_16_bit_dump_then_rerun_is_byte_identical(tmp_path, dumped):
    exps, refs = dumped
    ref_files = shard_files(refs["bfloat16"])
    dump_to = str(tmp_path / "killed")
    log = str(tmp_path / "dump.log")
    proc = start_dump(exps["bfloat16"], dump_to, log)

    def mid_shard():
        dirs = hash_dirs(dump_to)
        return bool(dirs and temp_files(dirs[0]))

    assert wait_for(proc, mid_shard, timeout=120), open(log).read()[-3000:]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    (dest,) = hash_dirs(dump_to)
    for name, data in shard_files(dest).items():  # what survived is complete and right
        assert data == ref_files[name]
    rerun = start_dump(exps["bfloat16"], dump_to, log)
    assert rerun.wait(timeout=120) == 0, open(log).read()[-3000:]
    assert shard_files(dest) == ref_files and not temp_files(dest)
    gather(dest)
    assert check_dir(dest, deep=True).ok


def test_train_evaluate_and_visuals_on_a_bfloat16_cache(tmp_path):
    from actcache.sae.on_cache import train_on_cache

    md = synthetic_metadata(20, layers=(3, 7), n_patches_per_img=4, d_vit=8, max_patches_per_shard=5 * 6 * 2)
    path = write_cache(tmp_path / "c", dataclasses.replace(md, dtype="bfloat16", protocol=None), synthetic_fill(md))
    train = {"layer": 7, "batch_size": 16, "steps": 6, "log_every": 2, "eval_frac": 0.2, "scale_norm": True,
             "buffer_bytes": 20000, "saes": [{"activation": "topk", "width": 12, "k": 3}]}  # fmt: skip
    (tmp_path / "t.json").write_text(json.dumps({"train": train}))
    (run_dir,) = train_on_cache(path, str(tmp_path / "t.json"), runs_to=str(tmp_path / "r"))
    ev = read_json(os.path.join(run_dir, "eval.json"))
    assert ev["n_heldout_images"] == 4 and 0 <= ev["nmse"] < 10  # eval_frac 0.2 of 20 images
    assert main(["visuals", run_dir, "--latents", "3", "--no-images"]) == 0
    assert os.path.isfile(os.path.join(run_dir, "visuals", "index.html"))
