"""Training checkpoints of one SAE: weights, config, optimizer + objective state, loader position.

One directory per step under the run directory (actcache.rundir.checkpoint_dir) holds the SAE's
weights and config (SAE.save, loadable with SAE.load), the state file (optimizer, objective and
trainer extras; torch.save, loaded with weights_only), the position file
(``{"step": 1000, "loader": {"epoch": 0, "batch": 1000}, ...}``) and, written last, the manifest:
each of those files with its size and sha256.

A checkpoint is written into a hidden temporary directory (every file fsynced) that is renamed
to its step's name only when complete, so a killed job never leaves a directory under a final
name that is half written. A trainer keeps the newest ``keep_checkpoints`` of them, pruning
older ones only after every SAE of its group has written the new one.

Resuming verifies each checkpoint against its manifest (:func:`problem`), newest first: one
found damaged is skipped with a warning naming it, and set aside (renamed ``.invalid``) so that
training writes that step again; the run resumes from the newest valid one that every SAE of the
group has. When an SAE has checkpoints but none is valid, one TrainError names them all.
Checkpoints written before manifests existed (their position file does not mention one) are
verified by loading every file instead.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil

import torch

from actcache.errors import ActCacheError, TrainError, os_error_text
from actcache.fsutil import atomic_write_bytes, fsync_dir, is_temp, sha256_file, tmp_name
from actcache.rundir import CHECKPOINT_STATE_FILE as STATE_FILE
from actcache.rundir import CHECKPOINTS_DIR as CKPT_DIR
from actcache.rundir import CONFIG_FILE, MANIFEST_FILE, POSITION_FILE, SET_ASIDE_MARK, WEIGHTS_FILE, checkpoint_step
from actcache.rundir import checkpoint_dir as step_dir

log = logging.getLogger(__name__)
FILES = (CONFIG_FILE, WEIGHTS_FILE, STATE_FILE, POSITION_FILE)  # what a manifest lists
MANIFEST_VERSION = 1


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
        doc = {"step": int(step), **position, "manifest": MANIFEST_FILE}
        atomic_write_bytes(os.path.join(tmp, POSITION_FILE), (json.dumps(doc, indent=2) + "\n").encode())
        atomic_write_bytes(os.path.join(tmp, MANIFEST_FILE), _manifest(tmp, step))
        if os.path.isdir(final):  # re-saving the same step (e.g. the end after a periodic one)
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _sha256(path: str) -> str:
    return sha256_file(path)[0]


def _manifest(directory: str, step: int) -> bytes:
    files = {
        name: {
            "bytes": os.path.getsize(os.path.join(directory, name)),
            "sha256": _sha256(os.path.join(directory, name)),
        }
        for name in FILES
    }
    doc = {"version": MANIFEST_VERSION, "step": int(step), "files": files}
    return (json.dumps(doc, indent=2) + "\n").encode()


def steps(run_dir: str) -> list[int]:
    """Steps of the checkpoint directories of ``run_dir``, ascending (not verified: see valid_steps)."""
    root = os.path.join(run_dir, CKPT_DIR)
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        step = checkpoint_step(name)
        if step is not None and os.path.isdir(os.path.join(root, name)):
            out.append(step)
    return sorted(out)


def common_step(run_dirs: list[str]) -> int | None:
    """The newest checkpoint step that every one of ``run_dirs`` has (None when there is none)."""
    sets = [set(steps(d)) for d in run_dirs]
    if not sets:
        return None
    both = set.intersection(*sets)
    return max(both) if both else None


# ---- verification ---------------------------------------------------------------------------


def problem(run_dir: str, step: int) -> str | None:
    """What is wrong with checkpoint ``step`` (a missing, cut or changed file, a garbled
    manifest or position), or None when every file matches its manifest."""
    d = step_dir(run_dir, step)
    try:
        position = _read_json(os.path.join(d, POSITION_FILE))
    except (OSError, ValueError) as err:
        return f"{POSITION_FILE}: {_why(err)}"
    if not isinstance(position, dict) or not isinstance(position.get("loader"), dict):
        return f"{POSITION_FILE}: not a checkpoint position (no loader position)"
    if position.get("step") != step:
        return f"{POSITION_FILE}: step {position.get('step')!r}, not {step}"
    if "manifest" not in position:  # written before manifests: load every file instead
        return _load_problem(d)
    try:
        manifest = _read_json(os.path.join(d, MANIFEST_FILE))
        files = manifest["files"]
        if manifest.get("step") != step or not isinstance(files, dict) or set(files) != set(FILES):
            raise ValueError("not this checkpoint's manifest")
        for name in FILES:
            size, digest = int(files[name]["bytes"]), str(files[name]["sha256"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{MANIFEST_FILE}: {_why(err)}"
    for name in FILES:
        path = os.path.join(d, name)
        size, digest = int(files[name]["bytes"]), str(files[name]["sha256"])
        try:
            got = os.path.getsize(path)
            if got != size:
                return f"{name}: {got:,} bytes, the manifest says {size:,}"
            if _sha256(path) != digest:
                return f"{name}: its checksum differs from the manifest's (the file changed after it was written)"
        except OSError as err:
            return f"{name}: {_why(err)}"
    return None


def _read_json(path: str):
    """A checkpoint's JSON file within docfiles' bounds (a regular file); ValueError when damaged."""
    from actcache.docfiles import load_json_file

    try:
        return load_json_file(path, _Damaged, "checkpoint file")
    except _Damaged as err:
        raise ValueError(str(err)) from None


class _Damaged(ActCacheError):
    """A checkpoint's JSON file cannot be read (turned into ValueError: the checkpoint is damaged)."""


def _why(err: BaseException) -> str:
    if isinstance(err, OSError):
        return os_error_text(err)
    if isinstance(err, (UnicodeDecodeError, json.JSONDecodeError)):
        return f"not valid JSON ({err})"
    return f"{type(err).__name__}: {err}" if not isinstance(err, ValueError) else str(err)


def _load_problem(d: str) -> str | None:
    """A checkpoint without a manifest: whether each file loads."""
    from safetensors import safe_open

    from actcache.sae.spec import SAEConfig

    try:
        with open(os.path.join(d, CONFIG_FILE), encoding="utf-8") as fh:
            SAEConfig.from_json(fh.read())
        with safe_open(os.path.join(d, WEIGHTS_FILE), framework="pt") as fh:
            for name in fh.keys():
                fh.get_tensor(name)
        torch.load(os.path.join(d, STATE_FILE), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any failure to load is the checkpoint's problem
        return f"cannot be loaded ({type(err).__name__}: {' '.join(str(err).split())})"
    return None


def valid_steps(run_dir: str, set_aside: bool = False) -> list[int]:
    """Steps of the checkpoints of ``run_dir`` that pass :func:`problem`, ascending. Each damaged
    one is logged as a warning naming it and, with ``set_aside`` (the process that writes the
    run), renamed ``step-NNNNNNNN.invalid`` so that training writes that step again. A run with
    checkpoints of which none is valid is a TrainError naming each and what is wrong with it."""
    found = steps(run_dir)
    good, bad = [], []
    for step in reversed(found):
        why = problem(run_dir, step)
        if why is None:
            good.append(step)
            continue
        d = step_dir(run_dir, step)
        bad.append(f"{d} ({why})")
        moved = _set_aside(d) if set_aside else None
        log.warning("checkpoint %s is damaged: %s; %s", d, why, f"moved to {moved}" if moved else "skipped")
    if found and not good:
        raise TrainError(
            f"no valid checkpoint to resume {run_dir} from: {'; '.join(bad)}. Restore one from a backup, or "
            f"delete {os.path.join(run_dir, CKPT_DIR)} to train this SAE again from the start."
        )
    return sorted(good)


def _set_aside(d: str) -> str | None:
    for k in range(1000):
        dest = d + SET_ASIDE_MARK + (f"-{k}" if k else "")
        if not os.path.exists(dest):
            try:
                os.rename(d, dest)
            except OSError:
                return None
            return dest
    return None


def read_position(run_dir: str, step: int) -> dict:
    path = os.path.join(step_dir(run_dir, step), POSITION_FILE)
    try:
        doc = _read_json(path)
    except (OSError, ValueError) as err:
        raise TrainError(
            f"cannot read {path}: {_why(err)}; delete that checkpoint to resume from an older one."
        ) from None
    doc.pop("manifest", None)
    return doc


class IncompatibleCheckpoint(TrainError):
    """A sound checkpoint that this version cannot continue: refused as it is, not set aside."""


def load(run_dir: str, step: int, sae, optimizer, objective) -> tuple[dict, dict]:
    """Restore weights (in place), optimizer and objective state from checkpoint ``step``;
    returns (its position.json, the ``extra`` saved with it). Any failure is a TrainError naming
    the checkpoint (verify first with :func:`valid_steps` to fall back instead)."""
    from safetensors.torch import load_file

    from actcache.sae.spec import SAEConfig

    d = step_dir(run_dir, step)
    try:
        with open(os.path.join(d, CONFIG_FILE), encoding="utf-8") as fh:
            cfg = SAEConfig.from_json(fh.read())
    except Exception as err:  # noqa: BLE001 - a damaged file: one clear message
        raise TrainError(f"{d}: cannot load checkpoint ({type(err).__name__}: {err}); move it away.") from None
    if cfg.activation == "jumprelu" and cfg.jumprelu_param != sae.cfg.jumprelu_param:
        raise IncompatibleCheckpoint(
            f"{d}: this JumpReLU checkpoint trains its thresholds as log theta (actcache before the direct "
            f"threshold) and cannot be continued exactly; delete {os.path.join(run_dir, CKPT_DIR)} to train the SAE "
            "again with the current recipe."
        )
    if cfg != sae.cfg:
        raise TrainError(f"{d}: checkpoint config {cfg} differs from the run's {sae.cfg}; move it away.")
    try:
        device = next(sae.parameters()).device
        tensors = load_file(os.path.join(d, WEIGHTS_FILE), device=str(device))
        sae.load_state_dict(tensors)
        state = torch.load(os.path.join(d, STATE_FILE), map_location=device, weights_only=True)
        optimizer.load_state_dict(state["optimizer"])
        why = objective.incompatible(state["objective"])
        if why is None:
            objective.load_state_dict(state["objective"])
    except Exception as err:  # noqa: BLE001 - SafetensorError, UnpicklingError, EOFError, ...: one message
        text = " ".join(str(err).split())
        raise TrainError(
            f"{d}: cannot load checkpoint ({type(err).__name__}: {text}); move it away to resume from an older one."
        ) from None
    if why is not None:
        raise IncompatibleCheckpoint(f"{d}: {why}; delete {os.path.join(run_dir, CKPT_DIR)} to train the SAE again with "
                                     "the current recipe.")
    return read_position(run_dir, step), state.get("extra", {})


def prune(run_dir: str, keep_newest: int) -> None:
    """Delete every checkpoint but the newest ``keep_newest`` (at least 1 is kept)."""
    for step in steps(run_dir)[: -max(1, keep_newest)]:
        shutil.rmtree(step_dir(run_dir, step), ignore_errors=True)


def clean_temps(run_dir: str) -> None:
    """Remove temporary checkpoint directories left by a killed job (call before training)."""
    root = os.path.join(run_dir, CKPT_DIR)
    if os.path.isdir(root):
        for name in os.listdir(root):
            if is_temp(name):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def truncate_metrics(path: str, step: int) -> None:
    """Drop the lines of a metrics.jsonl logged after ``step`` (a resume recomputes them), and any
    line that is not a metrics object (cut by a kill, say). Read within rundir's bounds."""
    from actcache.rundir import read_metrics

    if not os.path.lexists(path):
        return
    keep = [ln for ln in read_metrics(os.path.dirname(path)) if ln["step"] <= step]
    atomic_write_bytes(path, "".join(json.dumps(ln) + "\n" for ln in keep).encode())
