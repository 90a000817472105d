"""`actcache dump --experiment FILE --shards A:B`: compute and write a range of shards."""

from __future__ import annotations

from actcache.config import load_experiment
from actcache.dump import dump_shards, parse_shard_range


def cmd_dump(args) -> int:
    exp = load_experiment(args.experiment)
    shards = parse_shard_range(args.shards)
    path = dump_shards(
        exp,
        shards,
        dump_to=args.dump_to,
        device=args.device,
        batch_size=args.batch_size,
        n_workers=args.workers,
        progress=not args.no_progress,
        space_check=not args.no_space_check,
    )
    print(path)
    return 0
