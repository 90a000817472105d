"""Data-parallel training: 2 CPU processes (torchrun, gloo) each read their own partition of the
cache and end with identical weights; only rank 0 writes the run directory."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from actcache.errors import TrainError
from actcache.rundir import run_dir
from actcache.sae.config import expand_train_section
from actcache.sae.ddp import DistContext, env_context
from actcache.sae.split import heldout_images
from test_sae_train import dictionary_cache

WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch
    torch.set_num_threads(1)
    import actcache.loaders.shuffled as shuffled
    from actcache.sae.config import RunConfig
    from actcache.sae.train import GroupTrainer

    seen = set()

    class Recording(shuffled.ShuffledLoader):
        def __iter__(self):
            for batch in super().__iter__():
                seen.update(batch["image_i"].tolist())
                yield batch

    shuffled.ShuffledLoader = Recording
    cache, runs_to, out, runs = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    t = GroupTrainer(cache, [RunConfig.from_dict(r) for r in runs], runs_to, device="cpu")
    t.run()
    rank = t.ctx.rank
    torch.save({k: s.state_dict() for k, s in t.trained.items()}, os.path.join(out, f"rank{rank}.pt"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({"rank": rank, "world_size": t.ctx.world_size, "images": sorted(seen),
                   "group_left": not torch.distributed.is_initialized()}, fh)
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_ddp_keeps_ranks_identical_on_disjoint_data(tmp_path):
    path, _ = dictionary_cache(tmp_path / "cache", n_imgs=200, imgs_per_shard=64)
    # 180 training images x 16 patches = 2880 examples: 11 batches of 128 per rank per epoch, so
    # 10 steps stay in epoch 0, where the two ranks' partitions are disjoint.
    train = {"batch_size": 256, "steps": 10, "width": 128, "log_every": 5, "ckpt_every": 5, "eval_frac": 0.1,
             "dead_tokens": 500, "lr": 3e-3,
             "saes": [{"activation": "topk", "k": 4}, {"activation": "batchtopk", "k": 4},
                      {"activation": "relu", "l1_coeff": 1e-3}, {"activation": "jumprelu", "l0_coeff": 1e-2},
                      {"activation": "matryoshka", "k": 4, "matryoshka_prefixes": [32, 128]}]}  # fmt: skip
    runs = expand_train_section(train, "t.yaml")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    env["TMPDIR"] = str(tmp_path)  # torchrun leaves its log directory (torchelastic_*) in TMPDIR
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(script), path, str(tmp_path / "runs"), str(out), json.dumps([r.to_dict() for r in runs])]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    info = [json.load(open(out / f"rank{r}.json")) for r in (0, 1)]
    assert [i["world_size"] for i in info] == [2, 2]
    assert [i["group_left"] for i in info] == [True, True]  # run() left the group it joined
    imgs0, imgs1 = set(info[0]["images"]), set(info[1]["images"])
    assert imgs0 and imgs1 and not imgs0 & imgs1  # each rank reads its own partition
    held = set(heldout_images(200, 0.1).tolist())
    assert len(held) == 20 and not (imgs0 | imgs1) & held  # the held-out images are never trained on
    assert len(imgs0 | imgs1) > 150

    states = [torch.load(out / f"rank{r}.pt") for r in (0, 1)]
    assert states[0].keys() == {r.sae_id for r in runs}
    for sid in states[0]:
        for name, t in states[0][sid].items():
            torch.testing.assert_close(states[1][sid][name], t, rtol=0, atol=0, equal_nan=True, msg=f"{sid} {name}")

    for r in runs:
        d = run_dir(tmp_path / "runs", os.path.basename(path), r)
        lines = [json.loads(x) for x in open(os.path.join(d, "metrics.jsonl"))]
        assert [x["step"] for x in lines] == [5, 10]  # written once (rank 0)
        assert json.load(open(os.path.join(d, "run.json")))["world_size"] == 2
        assert os.path.exists(os.path.join(d, "done.json"))
        saved = torch.load(os.path.join(d, "checkpoints", "step-00000010", "state.pt"), weights_only=True)
        assert saved["optimizer"]["state"]  # rank 0's optimizer state was checkpointed


FAILING_WORKER = textwrap.dedent(
    """
    import errno, json, os, sys
    import torch
    torch.set_num_threads(1)
    from actcache.sae import checkpoint
    from actcache.sae.config import RunConfig
    from actcache.sae.train import GroupTrainer

    if os.environ["RANK"] == "0":  # rank 0's disk is full when it writes the first checkpoint
        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, "No space left on device")
        checkpoint.save = full
    cache, runs_to, runs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    GroupTrainer(cache, [RunConfig.from_dict(r) for r in runs], runs_to, device="cpu").run()
    """
)


def test_a_write_error_on_rank_0_stops_every_rank_with_its_cause(tmp_path):
    """Only rank 0 writes the run directory. When that fails (here: a full disk at the first
    checkpoint), every rank stops at once: rank 0 with the error and the fix, the others with a
    TrainError naming rank 0's failure. Before, they waited at a barrier: with gloo that failed with
    "Connection closed by peer", which does not say why; with nccl it waits for the process group's
    timeout (under srun, which by default lets the other tasks run on). The ranks are started by
    hand here: no torchrun agent stops the others for them."""
    path, _ = dictionary_cache(tmp_path / "cache", n_imgs=200, imgs_per_shard=64)
    train = {"batch_size": 256, "steps": 10, "width": 64, "log_every": 5, "ckpt_every": 5, "eval_frac": 0.1,
             "dead_tokens": 500, "saes": [{"activation": "topk", "k": 4}]}  # fmt: skip
    runs = expand_train_section(train, "t.yaml")
    script = tmp_path / "worker.py"
    script.write_text(FAILING_WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", TMPDIR=str(tmp_path))
    args = [sys.executable, str(script), path, str(tmp_path / "runs"), json.dumps([r.to_dict() for r in runs])]
    procs = [
        subprocess.Popen(
            args,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    err0, err1 = outs[0][1], outs[1][1]
    assert procs[0].returncode != 0 and procs[1].returncode != 0
    assert "TrainError" in err0 and "No space left on device" in err0 and "the checkpoint of step 5" in err0, err0[
        -3000:
    ]
    assert "rank 0 failed while writing the checkpoint of step 5, so rank 1 stops too" in err1, err1[-3000:]
    d = run_dir(tmp_path / "runs", os.path.basename(path), runs[0])
    assert json.load(open(os.path.join(d, "run.json")))["world_size"] == 2  # what rank 0 wrote before stays


def test_rank_and_world_size_from_torchrun_or_slurm():
    assert env_context({}) == DistContext(0, 1, 0)
    assert env_context({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == DistContext(1, 4, 1)
    assert env_context({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1"}) == DistContext(3, 4, 1)
    # torchrun inside a Slurm allocation: torchrun's variables win
    ctx = env_context({"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert ctx == DistContext(0, 2, 0)
    with pytest.raises(TrainError, match="inconsistent rank 4 for world size 2"):
        env_context({"RANK": "4", "WORLD_SIZE": "2"})
