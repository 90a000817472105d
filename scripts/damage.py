"""Ways to damage a cache that `actcache verify --deep` must catch, and a count of shard writes.

For scripts/chaos.py and the tests (import this file by path, as scripts import benchlib):

    DAMAGES["flipped byte"](cache_dir, "acts000001.bin")      # also: "zeroed shard",
    caught_by_verify(cache_dir, "acts000001.bin")            #   "duplicated shard", "swapped shards"
    shard_writes([log_text, ...])                             # "wrote actsNNNNNN.bin" lines of dump logs

Each damage keeps the file's size and name, so plain `verify` still passes and only the bytes tell.
"""

from __future__ import annotations

import os
import re
import shutil

from actcache.protocol import shard_name
from actcache.validate import check_dir


def flip_byte(cache: str, shard: str, offset: int = 100) -> None:
    """Flip the lowest bit of one byte of ``shard``."""
    with open(os.path.join(cache, shard), "r+b") as fd:
        fd.seek(offset)
        b = fd.read(1)
        fd.seek(offset)
        fd.write(bytes([b[0] ^ 0x01]))


def zero_shard(cache: str, shard: str) -> None:
    """Overwrite every byte of ``shard`` with zeros."""
    f = os.path.join(cache, shard)
    size = os.path.getsize(f)
    with open(f, "r+b") as fd:
        fd.write(b"\0" * size)


def duplicate_shard(cache: str, shard: str) -> None:
    """Replace ``shard`` by a copy of another shard of the same size (the first one, or the second)."""
    other = shard_name(1) if shard == shard_name(0) else shard_name(0)
    shutil.copyfile(os.path.join(cache, other), os.path.join(cache, shard))


def swap_shards(cache: str, shard: str) -> None:
    """Swap ``shard`` with another shard of the same size (by renames)."""
    other = shard_name(1) if shard == shard_name(0) else shard_name(0)
    a, b = os.path.join(cache, other), os.path.join(cache, shard)
    os.rename(a, a + ".swap")
    os.rename(b, a)
    os.rename(a + ".swap", b)


DAMAGES = {
    "flipped byte": flip_byte,
    "zeroed shard": zero_shard,
    "duplicated shard": duplicate_shard,
    "swapped shards": swap_shards,
}


def caught_by_verify(cache: str, shard: str, checksums_dir: str | None = None) -> bool:
    """Whether `verify --deep` fails with a problem naming ``shard``."""
    rep = check_dir(cache, deep=True, checksums_dir=checksums_dir)
    return not rep.ok and any(shard in p for p in rep.problems)


def shard_writes(logs: list[str]) -> int:
    """Shards written, counted from the "wrote actsNNNNNN.bin" lines of dump logs."""
    return sum(len(re.findall(r" wrote acts\d{6}\.bin\b", text)) for text in logs)
