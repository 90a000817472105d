"""Retries with profiles/local: a job that fails on a user error (actcache exits 2) is not run again."""

from __future__ import annotations

import glob
import os

import numpy as np
import PIL.Image
from tests.fixtures_vit import make_checkpoint
from tests.workflow_helpers import TWO_AT_A_TIME, snakemake, write_project


def image_folder(root: str, n: int, corrupt: int) -> str:
    """n small PNGs in one class folder; image `corrupt` is a PNG header followed by garbage."""
    rng = np.random.default_rng(0)
    os.makedirs(os.path.join(root, "cls"))
    for i in range(n):
        path = os.path.join(root, "cls", f"img{i:03d}.png")
        if i == corrupt:
            with open(path, "wb") as fd:
                fd.write(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)
        else:
            PIL.Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8), "RGB").save(path)
    return os.path.join(root, "cls", f"img{corrupt:03d}.png")


def test_dump_failing_on_a_corrupt_image_runs_once_despite_retries(tmp_path):
    ckpt = make_checkpoint(str(tmp_path / "tiny-clip"), "clip")
    bad = image_folder(str(tmp_path / "imgs"), n=4, corrupt=2)
    exp = {
        "name": "bad",
        "vit": {"family": "clip", "ckpt": ckpt, "layers": [-1]},
        "data": {"kind": "image_folder", "root": str(tmp_path / "imgs")},
        # one shard of 4 images, one dump job
        "cache": {"max_patches_per_shard": 4 * 17, "batch_size": 4, "n_workers": 0, "shards_per_job": 1},
    }
    cfg = write_project(str(tmp_path), {"bad": exp})
    proc = snakemake(cfg, "--retries", "1", *TWO_AT_A_TIME)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    logs = sorted(glob.glob(str(tmp_path / "logs" / "dump" / "*" / "000000-000001.*.attempt*.log")))
    assert len(logs) == 2, (logs, out[-3000:])  # Snakemake did retry the job ...
    first, second = (open(p).read() for p in logs)
    assert ".attempt1." in logs[0] and ".attempt2." in logs[1]
    assert bad in first and "actcache dump: error" in first  # ... whose first attempt named the image
    # ... but the retry ran no dump: it stopped at once, saying why
    assert "actcache dump" not in second and "not retried: an earlier attempt failed with a user error" in second
    assert "not retried" in out
    assert len(glob.glob(str(tmp_path / "logs" / "dump" / "*" / "*.user-error"))) == 1
