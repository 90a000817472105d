"""The paths that run on an accelerator, on the device named by ACTCACHE_TEST_DEVICE (default cpu).

CI has no GPU: there these tests run on the CPU and check the same properties as on a GPU. On a
machine with one, ``ACTCACHE_TEST_DEVICE=cuda python -m pytest tests/test_device.py`` (run by
``scripts/gpu_session.sh``) checks the CUDA code: the dump (pinned host buffers, asynchronous
device-to-host copies, full float32), SAE training and the visuals pass. Naming a device that
torch cannot use fails the tests; it does not skip them.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from actcache.cache import ActivationCache
from actcache.config import load_experiment
from actcache.dump import dump_shards
from actcache.images import ImageFolder, open_dataset
from actcache.models import load_transform
from actcache.protocol import Metadata
from actcache.rundir import run_dir
from actcache.sae.config import expand_train_section
from actcache.sae.modeling import SAE, SAEConfig
from actcache.sae.train import train_group
from actcache.visuals import compute_stats
from actcache.writer import gather
from fixtures_vit import FAMILY, N_LAYERS, N_REGISTERS, make_checkpoint, reference_hidden_states
from test_dump import make_images, shard_files, temp_files, write_experiment
from test_sae_train import dictionary_cache

DEV = os.environ.get("ACTCACHE_TEST_DEVICE", "cpu")
LAYERS = [-1, 0]
N_IMGS = 22


@pytest.fixture(scope="module")
def device() -> str:
    dev = torch.device(DEV)  # a malformed name raises here
    if dev.type == "cuda":
        assert torch.cuda.is_available(), f"ACTCACHE_TEST_DEVICE={DEV}: torch {torch.__version__} sees no CUDA GPU"
    torch.empty(1, device=dev)  # the device can be used at all
    return DEV


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    make_images(str(root), n=N_IMGS)
    return str(root)


@pytest.mark.parametrize("kind", ["clip", "siglip", "dinov2_reg"])
def test_dump_on_the_device_equals_the_model_and_any_job_split(tmp_path, device, images, kind):
    ckpt = make_checkpoint(str(tmp_path / kind), kind)
    exp = load_experiment(write_experiment(tmp_path / "exp.yaml", ckpt, images, family=FAMILY[kind], layers=LAYERS))
    one = dump_shards(exp, None, str(tmp_path / "one"), device=device, n_workers=2, progress=False)
    for a, b in [(0, 2), (2, 3), (3, None)]:  # three jobs over three shard ranges
        three = dump_shards(exp, (a, b), str(tmp_path / "three"), device=device, n_workers=0, progress=False)
    gather(one)
    gather(three)
    md = Metadata.load(one)
    assert md.n_imgs == N_IMGS and md.n_shards >= 4
    assert shard_files(one) == shard_files(three)  # byte-identical: same batch size, same device
    assert not temp_files(one) and not temp_files(three)

    # transformers' own output_hidden_states, on the CPU, for the same preprocessed images
    ds = open_dataset(ImageFolder(images))
    tf = load_transform(FAMILY[kind], ckpt)
    pixels = torch.from_numpy(np.stack([tf(ds[i][0]) for i in range(N_IMGS)]))
    hidden = reference_hidden_states(ckpt, kind, pixels)
    has_cls = FAMILY[kind] != "siglip"
    n_reg = N_REGISTERS if kind == "dinov2_reg" else 0
    keep = ([0] if has_cls else []) + list(range(int(has_cls) + n_reg, hidden[0].shape[1]))  # no registers
    want = torch.stack([hidden[layer % N_LAYERS + 1][:, keep] for layer in LAYERS], dim=1).numpy()
    with ActivationCache.open(one) as cache:
        got = cache[0:N_IMGS]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_sae_training_on_the_device(tmp_path, device):
    path, _ = dictionary_cache(tmp_path / "cache", n_imgs=300, imgs_per_shard=64)
    train = {"batch_size": 256, "steps": 80, "width": 256, "k": 8, "log_every": 10, "ckpt_every": 40,
             "eval_frac": 0.1, "dead_tokens": 2000, "lr": 3e-3, "sweep": {"seed": [0, 1]}}  # fmt: skip
    runs = expand_train_section(train, "test.yaml")
    dirs = train_group(path, runs, tmp_path / "runs", device=device)
    assert dirs == [run_dir(tmp_path / "runs", os.path.basename(path), r) for r in runs]
    on_cpu = train_group(path, runs, tmp_path / "runs-cpu", device="cpu")  # the same runs, the same batches
    for d, c in zip(dirs, on_cpu, strict=True):
        lines = [json.loads(x) for x in open(os.path.join(d, "metrics.jsonl"))]
        assert [x["step"] for x in lines] == list(range(10, 90, 10))
        nmse = [x["nmse"] for x in lines]
        assert all(np.isfinite(nmse)) and max(nmse[1:]) < nmse[0] and nmse[-1] < 0.8 * nmse[0], nmse
        assert lines[-1]["l0"] == 8
        cpu_nmse = [json.loads(x)["nmse"] for x in open(os.path.join(c, "metrics.jsonl"))]
        np.testing.assert_allclose(nmse, cpu_nmse, rtol=0.05)  # same data order: the same curve within rounding
        ev = json.load(open(os.path.join(d, "eval.json")))
        assert np.isfinite(ev["nmse"]) and ev["nmse"] < 1.0
        # the saved weights load anywhere and encode the same on the CPU as on the device
        sae = SAE.load(d)
        x = torch.from_numpy(np.random.default_rng(0).standard_normal((64, sae.cfg.d_vit), dtype=np.float32))
        with torch.inference_mode():
            want = sae.encode(x)
            got = sae.to(device).encode(x.to(device)).cpu()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_visuals_pass_on_the_device_equals_the_cpu(tmp_path, device):
    path, _ = dictionary_cache(tmp_path / "cache", n_imgs=120, imgs_per_shard=32)
    sae = SAE(SAEConfig(d_vit=64, width=96, activation="topk", k=6, seed=3))
    with ActivationCache.open(path) as cache:
        ref = compute_stats(cache, [sae], "image", -2, False, k=8, batch_images=7, device="cpu")[0]
        got = compute_stats(cache, [sae], "image", -2, False, k=8, batch_images=7, device=device)[0]
    assert got.n_tokens == ref.n_tokens == 120 * 16 and got.n_imgs == ref.n_imgs == 120
    assert got.fire_count.sum() == ref.fire_count.sum() == 6 * 120 * 16  # TopK: k per token everywhere
    # A token whose 6th and 7th largest pre-activations tie within float rounding may pick another
    # latent on another device: allow a few such tokens, no more.
    assert np.abs(got.fire_count - ref.fire_count).sum() <= 0.002 * ref.fire_count.sum()
    np.testing.assert_allclose(got.act_sum, ref.act_sum, rtol=1e-3, atol=1e-3)
    same_top = np.mean([set(a[a >= 0]) == set(b[b >= 0]) for a, b in zip(got.top_img, ref.top_img, strict=True)])
    assert same_top >= 0.98, same_top
    np.testing.assert_allclose(np.sort(got.top_score, 1), np.sort(ref.top_score, 1), rtol=1e-3, atol=1e-3)
