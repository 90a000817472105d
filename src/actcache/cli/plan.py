"""`actcache plan`: per experiment, its cache hash, directory and status, and its SAEs."""

from __future__ import annotations

import json
import os

from actcache.errors import ConfigError
from actcache.plan import plan, plan_from_config, plan_summary


def _print_row(r: dict) -> None:
    st = r["cache"]
    print(f"{r['experiment']}  ({r['file']})")
    print(f"  hash      {r['hash']}")
    print(f"  dir       {r['dir']}")
    print(f"  cache     {st['state']} ({st['shards_done']}/{st['n_shards']} shards, {r['dump_jobs']} dump job(s))")
    if r["training"]:
        done = sum(t["done"] for t in r["training"])
        print(f"  training  {done} of {len(r['training'])} SAE(s) done")
        for t in r["training"]:
            print(f"    {'done   ' if t['done'] else 'pending'}  {t['sae_id']}  group {t['group']}")


def cmd_plan(args) -> int:
    dump_to, runs_to = args.dump_to, args.runs_to
    if args.experiment and not os.path.exists(args.config):
        if not (dump_to and runs_to):
            raise ConfigError("--experiment without a workflow config needs --dump-to and --runs-to.")
        planned = plan(args.experiment, dump_to, runs_to)
    else:
        planned = plan_from_config(args.config, dump_to, runs_to, args.experiment or None)
    rows = [plan_summary(p) for p in planned]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        _print_row(r)
    return 0
