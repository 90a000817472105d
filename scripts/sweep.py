#!/usr/bin/env python
"""Launch an SAE sweep over an existing cache as a submitit job array (one job per group).

    python scripts/sweep.py --cache data/cache/<HASH> --train config/experiments/demo.yaml \\
        --runs-to data/runs --folder data/runs/submitit --partition gpu --account PAS1234 \\
        --gpus-per-node 1 --timeout-min 240

``--train`` is an experiment YAML (its ``train:`` section is used) or a YAML file holding only a
train section (see actcache.sae.config). Each group of SAEs that share a stream of batches is one
array task running :class:`actcache.sae.submit.TrainJob`; preempted or timed-out tasks checkpoint
and requeue themselves, then resume. Groups whose SAEs all have ``done.json`` are skipped.
``--executor local`` runs the jobs on this machine (no Slurm); ``--dry-run`` only prints the plan.
Several GPUs per group: ``--tasks-per-node N --gpus-per-node N`` (DDP, one rank per task).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import yaml

from actcache.errors import ActCacheError, ConfigError


def load_train_section(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            doc = yaml.safe_load(fh)
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: cannot read the train section ({err})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: must be a YAML mapping (an experiment file or a train section)")
    return doc["train"] if "train" in doc or "vit" in doc else doc


def plan(cache: str, train: dict, where: str, runs_to: str, only: list[str] | None = None) -> list[tuple[str, list]]:
    """[(group id, runs)] still to train (validated against the cache's layers and d_vit)."""
    from actcache.cache import ActivationCache
    from actcache.rundir import done_paths
    from actcache.sae.config import expand_train_section, groups

    md = ActivationCache.open(cache).metadata
    runs = expand_train_section(train, where, layers=md.layers, d_vit=md.d_vit)
    by_group = groups(runs)
    for g in only or []:
        if g not in by_group:
            raise ConfigError(f"{where}: no group {g!r}; groups: {', '.join(by_group)}")
    out = []
    for gid, members in by_group.items():
        if only and gid not in only:
            continue
        if all(os.path.exists(p) for p in done_paths(runs_to, md.hash, members)):
            continue
        out.append((gid, members))
    return out


def make_executor(folder: str, executor: str = "auto", *, partition=None, account=None, gpus_per_node=None,
                  tasks_per_node=1, cpus_per_task=None, mem_gb=None, timeout_min=240, signal_delay_s=120,
                  array_parallelism=None, name="actcache-train", extra: dict | None = None):  # fmt: skip
    import submitit

    cluster = None if executor == "auto" else executor
    ex = submitit.AutoExecutor(folder=folder, cluster=cluster)
    params: dict = {"timeout_min": timeout_min, "name": name, "tasks_per_node": tasks_per_node}
    for key, val in (("gpus_per_node", gpus_per_node), ("cpus_per_task", cpus_per_task), ("mem_gb", mem_gb)):
        if val is not None:
            params[key] = val
    if ex.cluster == "slurm":
        params["slurm_signal_delay_s"] = signal_delay_s
        for key, val in (("slurm_partition", partition), ("slurm_account", account),
                         ("slurm_array_parallelism", array_parallelism)):  # fmt: skip
            if val is not None:
                params[key] = val
    params.update(extra or {})
    ex.update_parameters(**params)
    return ex


def launch(cache: str, todo: list[tuple[str, list]], runs_to: str, executor, device: str | None = None) -> list:
    """Submit one TrainJob per group as one job array; returns [(group id, job)]."""
    from actcache.sae.submit import TrainJob

    if not todo:
        return []
    with executor.batch():
        jobs = [executor.submit(TrainJob(cache, members, runs_to, device=device)) for _, members in todo]
    return [(gid, job) for (gid, _), job in zip(todo, jobs, strict=True)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", required=True, help="the cache directory <dump_to>/<HASH>")
    p.add_argument("--train", required=True, help="experiment YAML (its train section) or a train-section YAML")
    p.add_argument("--runs-to", required=True, help="runs root: <runs_to>/<HASH>/<sae-id>/")
    p.add_argument("--folder", default=None, help="submitit folder for logs and pickles (default <runs_to>/submitit)")
    p.add_argument("--group", action="append", default=None, help="only this group (repeatable)")
    p.add_argument("--executor", choices=("auto", "slurm", "local", "debug"), default="auto")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--gpus-per-node", type=int)
    p.add_argument("--tasks-per-node", type=int, default=1, help="DDP ranks per group (one per GPU)")
    p.add_argument("--cpus-per-task", type=int)
    p.add_argument("--mem-gb", type=float)
    p.add_argument("--timeout-min", type=int, default=240)
    p.add_argument("--signal-delay-s", type=int, default=120, help="USR2 this long before the time limit")
    p.add_argument("--array-parallelism", type=int)
    p.add_argument("--device", default=None, help="cpu, cuda (default: cuda when present)")
    p.add_argument("--dry-run", action="store_true", help="print the groups, submit nothing")
    p.add_argument("--wait", action="store_true", help="wait for every job and report")
    p.add_argument("--json", action="store_true", help="print the submitted jobs as JSON")
    args = p.parse_args(argv)
    try:
        todo = plan(args.cache, load_train_section(args.train), args.train, args.runs_to, args.group)
        for gid, members in todo:
            print(f"group {gid}: {len(members)} SAE(s): {', '.join(r.sae_id for r in members)}", file=sys.stderr)
        if not todo:
            print("nothing to train: every SAE has done.json", file=sys.stderr)
            return 0
        if args.dry_run:
            return 0
        ex = make_executor(
            args.folder or os.path.join(args.runs_to, "submitit"), args.executor, partition=args.partition,
            account=args.account, gpus_per_node=args.gpus_per_node, tasks_per_node=args.tasks_per_node,
            cpus_per_task=args.cpus_per_task, mem_gb=args.mem_gb, timeout_min=args.timeout_min,
            signal_delay_s=args.signal_delay_s, array_parallelism=args.array_parallelism,
        )  # fmt: skip
        jobs = launch(args.cache, todo, args.runs_to, ex, device=args.device)
    except ActCacheError as err:
        print(f"sweep: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([{"group": g, "job_id": j.job_id, "folder": str(ex.folder)} for g, j in jobs]))
    else:
        for g, j in jobs:
            print(f"{j.job_id}\t{g}")
    if args.wait:
        failed = 0
        for g, j in jobs:
            try:
                j.result()
                print(f"{j.job_id}\t{g}\tdone", file=sys.stderr)
            except Exception as err:  # noqa: BLE001 - report every job
                failed += 1
                print(f"{j.job_id}\t{g}\tFAILED: {err}", file=sys.stderr)
        return 1 if failed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
