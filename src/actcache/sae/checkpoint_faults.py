"""Checkpoint corruptions: the damage a disk, a filesystem or a person can do to a checkpoint
directory, for the test suite and scripts/chaos.py.

    corrupt(checkpoint_dir, "weights-flipped")

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
