"""Training checkpoints of one SAE: weights, config, optimizer + objective state, loader position.

One directory per step under the run directory (actcache.rundir.checkpoint_dir) holds the SAE's
weights and config (SAE.save, loadable with SAE.load), ``state.pt`` (optimizer, objective and
trainer extras; torch.save, loaded with weights_only) and the position file
(``{"step": 1000, "loader": {"epoch": 0, "batch": 1000}, ...}``).

A checkpoint is written into a hidden temporary directory (every file fsynced) that is renamed
to its step's name only when complete, so a killed job never leaves a directory under a final
name that is half written. A trainer prunes older checkpoints only after every SAE of its group
has written the new one; resuming then picks the newest step that all of them have
(:func:`common_step`).
"""

from __future__ import annotations

import io
import json
import os
import shutil

import torch

from actcache.errors import TrainError
from actcache.fsutil import atomic_write_bytes, fsync_dir, is_temp, tmp_name
from actcache.rundir import CHECKPOINTS_DIR as CKPT_DIR
from actcache.rundir import CONFIG_FILE, POSITION_FILE, WEIGHTS_FILE, checkpoint_step
from actcache.rundir import checkpoint_dir as step_dir

STATE_FILE = "state.pt"


def save(run_dir: str, step: int, sae, optimizer, objective, position: dict, extra: dict | None = None) -> str:
    """Write checkpoint ``step`` of one SAE atomically; returns its directory. ``extra``: tensors and
    numbers the trainer needs back (e.g. a partial metric window)."""
    root = os.path.join(run_dir, CKPT_DIR)
    os.makedirs(root, exist_ok=True)
    final = step_dir(run_dir, step)
    tmp = tmp_name(final)
    os.makedirs(tmp)
    try:
        sae.save(tmp)
        buf = io.BytesIO()
        torch.save(
            {"optimizer": optimizer.state_dict(), "objective": objective.state_dict(), "extra": extra or {}}, buf
        )
        atomic_write_bytes(os.path.join(tmp, STATE_FILE), buf.getvalue())
        doc = {"step": int(step), **position}
        atomic_write_bytes(os.path.join(tmp, POSITION_FILE), (json.dumps(doc, indent=2) + "\n").encode())
        if os.path.isdir(final):  # re-saving the same step (e.g. the end after a periodic one)
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def steps(run_dir: str) -> list[int]:
    """Steps of the complete checkpoints of ``run_dir``, ascending."""
    root = os.path.join(run_dir, CKPT_DIR)
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        step = checkpoint_step(name)
        if step is not None and os.path.isfile(os.path.join(root, name, POSITION_FILE)):
            out.append(step)
    return sorted(out)


def common_step(run_dirs: list[str]) -> int | None:
    """The newest checkpoint step that every one of ``run_dirs`` has (None when there is none)."""
    sets = [set(steps(d)) for d in run_dirs]
    if not sets:
        return None
    both = set.intersection(*sets)
    return max(both) if both else None


def read_position(run_dir: str, step: int) -> dict:
    path = os.path.join(step_dir(run_dir, step), POSITION_FILE)
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def load(run_dir: str, step: int, sae, optimizer, objective) -> tuple[dict, dict]:
    """Restore weights (in place), optimizer and objective state from checkpoint ``step``;
    returns (its position.json, the ``extra`` saved with it)."""
    from safetensors.torch import load_file

    from actcache.sae.modeling import SAEConfig

    d = step_dir(run_dir, step)
    try:
        with open(os.path.join(d, CONFIG_FILE), encoding="utf-8") as fh:
            cfg = SAEConfig.from_json(fh.read())
        if cfg != sae.cfg:
            raise TrainError(f"{d}: checkpoint config {cfg} differs from the run's {sae.cfg}; move it away.")
        device = next(sae.parameters()).device
        tensors = load_file(os.path.join(d, WEIGHTS_FILE), device=str(device))
        sae.load_state_dict(tensors)
        state = torch.load(os.path.join(d, STATE_FILE), map_location=device, weights_only=True)
    except (OSError, RuntimeError, ValueError, KeyError) as err:
        raise TrainError(
            f"{d}: cannot load checkpoint ({err}); delete this directory to resume from an older one."
        ) from None
    optimizer.load_state_dict(state["optimizer"])
    objective.load_state_dict(state["objective"])
    return read_position(run_dir, step), state.get("extra", {})


def prune(run_dir: str, keep: int) -> None:
    """Delete every checkpoint older than step ``keep``."""
    for step in steps(run_dir):
        if step < keep:
            shutil.rmtree(step_dir(run_dir, step), ignore_errors=True)


def clean_temps(run_dir: str) -> None:
    """Remove temporary checkpoint directories left by a killed job (call before training)."""
    root = os.path.join(run_dir, CKPT_DIR)
    if os.path.isdir(root):
        for name in os.listdir(root):
            if is_temp(name):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def truncate_metrics(path: str, step: int) -> None:
    """Drop the lines of a metrics.jsonl logged after ``step`` (a resume recomputes them)."""
    if not os.path.exists(path):
        return
    keep = []
    with open(path, encoding="utf-8") as fh:
        for ln in fh:
            try:
                if ln.strip() and json.loads(ln).get("step", 0) <= step:
                    keep.append(ln)
            except json.JSONDecodeError:
                continue  # a line cut by a kill
    atomic_write_bytes(path, "".join(keep).encode())
