"""Checkpoint corruptions: the damage a disk, a filesystem or a person can do to a checkpoint
directory, for the test suite and scripts/chaos.py.

    corrupt(checkpoint_dir, "weights-flipped")
    resume_trial(cache_dir, runs, workdir, "state-truncated", stop_at=15)   # the whole round trip

After any of :data:`CORRUPTIONS`, :func:`actcache.sae.checkpoint.valid_steps` must find the
checkpoint damaged (training then resumes from the one before, or, with none left, stops with
one clear error), never raise a raw SafetensorError, EOFError, UnpicklingError or
JSONDecodeError.
"""

from __future__ import annotations

import os

from actcache.rundir import CHECKPOINT_STATE_FILE, CONFIG_FILE, MANIFEST_FILE, POSITION_FILE, WEIGHTS_FILE

CORRUPTIONS = (
    "weights-truncated",  # sae.safetensors cut in half
    "weights-zeroed",  # every byte zero, same size
    "weights-flipped",  # one byte of a tensor flipped
    "weights-header",  # the header's first bytes flipped (not safetensors any more)
    "weights-missing",
    "state-truncated",  # state.pt (torch pickle) cut in half
    "state-flipped",  # one byte near the middle flipped
    "state-missing",
    "position-garbled",  # position.json not JSON
    "position-missing",
    "manifest-missing",
    "manifest-garbled",
    "config-garbled",  # config.json not JSON
)


def _flip(path: str, where: float) -> None:
    size = os.path.getsize(path)
    off = min(size - 1, max(0, int(size * where)))
    with open(path, "r+b") as fh:
        fh.seek(off)
        b = fh.read(1)
        fh.seek(off)
        fh.write(bytes([b[0] ^ 0xFF]))


def corrupt(checkpoint_dir: str, kind: str) -> None:
    """Damage one file of a checkpoint directory in place, as ``kind`` says (see CORRUPTIONS)."""
    what, how = kind.rsplit("-", 1)
    name = {"weights": WEIGHTS_FILE, "state": CHECKPOINT_STATE_FILE, "position": POSITION_FILE,
            "manifest": MANIFEST_FILE, "config": CONFIG_FILE}.get(what)  # fmt: skip
    if name is None or kind not in CORRUPTIONS:
        raise ValueError(f"corruption {kind!r} not in {CORRUPTIONS}")
    path = os.path.join(checkpoint_dir, name)
    size = os.path.getsize(path)
    if how == "missing":
        os.unlink(path)
    elif how == "truncated":
        os.truncate(path, size // 2)
    elif how == "zeroed":
        with open(path, "r+b") as fh:
            fh.write(bytes(size))
    elif how == "flipped":
        _flip(path, 0.5 if what == "state" else 0.9)  # (the weights' tail: tensor data, not the header)
    elif how == "header":
        _flip(path, 0.0)
    elif how == "garbled":
        with open(path, "r+b") as fh:
            fh.write(b"{\x00 not json")


def resume_trial(
    cache_dir: str, runs: list, workdir: str, kind: str, stop_at: int, reference: dict | None = None
) -> dict:
    """One checkpoint trial: train ``runs`` (one group, on the CPU) until ``stop_at`` steps,
    corrupt the newest checkpoint of the first SAE with ``kind``, train again. -> {"kind",
    "damaged" (its step), "outcome": "resumed" (from an older step, ``start``), "same-step"
    (resumed from the damaged one: a failure), "error" (one clear TrainError: ``message``) or
    "raw:<type>" (any other exception: a failure), "identical" (the final weights equal
    ``reference``, {sae_id: state_dict}, when given), "warnings" (those naming a damaged one)}.
    The start step and warnings come from the trainer's log records: keep logging enabled."""
    import logging

    import torch

    from actcache.errors import TrainError
    from actcache.rundir import checkpoint_dir, run_dir
    from actcache.sae.checkpoint import steps
    from actcache.sae.modeling import SAE
    from actcache.sae.train import Preempted, train_group

    out = os.path.join(workdir, kind)
    calls = [0]

    def stop() -> bool:
        calls[0] += 1
        return calls[0] >= stop_at

    try:
        train_group(cache_dir, runs, out, device="cpu", stop=stop)
    except Preempted:
        pass
    dirs = [run_dir(out, os.path.basename(os.path.normpath(cache_dir)), r) for r in runs]
    damaged = steps(dirs[0])[-1]
    corrupt(checkpoint_dir(dirs[0], damaged), kind)
    seen: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("actcache.sae")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    res = {"kind": kind, "damaged": damaged, "start": None, "message": "", "identical": None}
    try:
        train_group(cache_dir, runs, out, device="cpu")
        starts = [int(m.rsplit("at step ", 1)[1].split()[0]) for m in seen if "resuming" in m and "at step " in m]
        res["start"] = min(starts) if starts else 0
        res["outcome"] = "resumed" if res["start"] < damaged else "same-step"
        if reference is not None:
            res["identical"] = all(
                torch.equal(torch.nan_to_num(SAE.load(d).state_dict()[k]), torch.nan_to_num(v))
                for r, d in zip(runs, dirs, strict=True)
                for k, v in reference[r.sae_id].items()
            )
    except TrainError as err:
        res["outcome"], res["message"] = "error", str(err)
    except Exception as err:  # noqa: BLE001 - the trial's result: a raw exception is a failure
        res["outcome"], res["message"] = f"raw:{type(err).__name__}", str(err)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    res["warnings"] = [m for m in seen if " is damaged: " in m]
    return res
