"""Splitting an epoch's examples over nodes x ranks x DataLoader workers.

An epoch is a sequence of ``n`` examples (storage order for the ordered loader, the epoch's
shuffled run order for the shuffled loader). :class:`Partition` cuts it into contiguous,
disjoint parts, one per (rank, worker), with a batch-size hint (as composer's
``StreamingDatasetIndex.get_partition``) so that:

- every rank gets the SAME number of batches (DDP lockstep), with at most one incomplete
  batch per rank per epoch (none with ``drop_last``);
- within a rank, DataLoader-style workers get whole batches in the order a DataLoader asks
  them for batches (batch ``j`` of the rank comes from worker ``j % n_workers``), so only the
  worker that serves the rank's last batch holds the incomplete one;
- every example is in exactly one part.

One corner case cannot have both exactly-once and equal batch counts: when
``0 < n mod (world_size * batch_size) < world_size``, there are fewer left-over examples than
ranks, so some rank would get an extra batch that the others cannot match. Those few
(``< world_size``) examples are left out of that epoch (``Partition.n_dropped``); the shuffled
loader's epoch order changes every epoch, so a different few are left out each time. With
``drop_last`` every left-over example beyond the last full batch of each rank is left out.
"""

from __future__ import annotations

import dataclasses
import os

from actcache.errors import ConfigError


def _check_int(name: str, value, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ConfigError(f"{name}={value!r} must be an integer >= {lo}")


@dataclasses.dataclass(frozen=True)
class World:
    """Who reads which part: ``rank`` of ``world_size`` (nodes x ranks per node), and worker
    ``worker_id`` of ``n_workers`` DataLoader-style workers within the rank."""

    rank: int = 0
    world_size: int = 1
    worker_id: int = 0
    n_workers: int = 1

    def __post_init__(self) -> None:
        _check_int("world_size", self.world_size, 1)
        _check_int("n_workers", self.n_workers, 1)
        _check_int("rank", self.rank, 0)
        _check_int("worker_id", self.worker_id, 0)
        if self.rank >= self.world_size:
            raise ConfigError(f"rank={self.rank} must be < world_size={self.world_size}")
        if self.worker_id >= self.n_workers:
            raise ConfigError(f"worker_id={self.worker_id} must be < n_workers={self.n_workers}")

    @classmethod
    def from_nodes(cls, node: int, n_nodes: int, local_rank: int, ranks_per_node: int, **kw) -> World:
        """rank = node * ranks_per_node + local_rank; world_size = n_nodes * ranks_per_node."""
        return cls(rank=node * ranks_per_node + local_rank, world_size=n_nodes * ranks_per_node, **kw)

    @classmethod
    def from_env(cls, worker_id: int = 0, n_workers: int = 1) -> World:
        """From torchrun's RANK/WORLD_SIZE, else Slurm's SLURM_PROCID/SLURM_NTASKS, else 0 of 1."""
        env = os.environ
        for r, w in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
            if r in env and w in env:
                return cls(int(env[r]), int(env[w]), worker_id, n_workers)
        return cls(0, 1, worker_id, n_workers)

    @property
    def part(self) -> int:
        return self.rank * self.n_workers + self.worker_id

    @property
    def n_parts(self) -> int:
        return self.world_size * self.n_workers


@dataclasses.dataclass(frozen=True)
class Partition:
    """Contiguous parts of an epoch of ``n_examples`` (see the module docstring)."""

    n_examples: int
    world: World
    batch_size: int
    drop_last: bool = False

    def __post_init__(self) -> None:
        _check_int("batch_size", self.batch_size, 1)
        _check_int("n_examples", self.n_examples, 0)

    # ---- rank level ---------------------------------------------------------------------------
    def _rank_sizes(self) -> tuple[list[int], int]:
        """(examples per rank, batches per rank)."""
        n, R, B = self.n_examples, self.world.world_size, self.batch_size
        k, rem = divmod(n, R * B)
        if self.drop_last or rem == 0 or rem < R:
            return [k * B] * R, k
        return [k * B + rem // R + (r < rem % R) for r in range(R)], k + 1

    @property
    def n_batches_per_rank(self) -> int:
        return self._rank_sizes()[1]

    @property
    def n_dropped(self) -> int:
        """Examples of the epoch that no part gets (see the module docstring)."""
        return self.n_examples - sum(self._rank_sizes()[0])

    def rank_range(self, rank: int) -> tuple[int, int]:
        sizes, _ = self._rank_sizes()
        start = sum(sizes[:rank])
        return start, start + sizes[rank]

    # ---- worker level -------------------------------------------------------------------------
    def _worker_sizes(self, rank: int) -> tuple[list[int], list[int]]:
        """(examples per worker, batches per worker) of one rank: batch j -> worker j % W."""
        W, B = self.world.n_workers, self.batch_size
        lo, hi = self.rank_range(rank)
        n_rank, nb = hi - lo, self.n_batches_per_rank
        counts = [nb // W + (w < nb % W) for w in range(W)]
        sizes = [c * B for c in counts]
        if nb and n_rank < nb * B:  # the last batch (worker (nb-1) % W) is the incomplete one
            sizes[(nb - 1) % W] -= nb * B - n_rank
        return sizes, counts

    def part_range(self, world: World | None = None) -> tuple[int, int]:
        """[start, end) of this (rank, worker)'s examples in the epoch sequence."""
        world = world or self.world
        lo, _ = self.rank_range(world.rank)
        sizes, _ = self._worker_sizes(world.rank)
        start = lo + sum(sizes[: world.worker_id])
        return start, start + sizes[world.worker_id]

    def n_batches(self, world: World | None = None) -> int:
        """Batches this (rank, worker) yields per epoch (the rank's total is the same on every rank)."""
        world = world or self.world
        return self._worker_sizes(world.rank)[1][world.worker_id]

    def all_parts(self) -> list[tuple[World, int, int, int]]:
        """(world, start, end, n_batches) for every part (tests, diagnostics)."""
        out = []
        for r in range(self.world.world_size):
            for w in range(self.world.n_workers):
                wd = World(r, self.world.world_size, w, self.world.n_workers)
                s, e = self.part_range(wd)
                out.append((wd, s, e, self.n_batches(wd)))
        return out
