"""Benchmark: how long the workflow takes to parse many experiments with many shards.

    python scripts/bench_workflow_parse.py [--experiments 20] [--shards 1000]

Writes N experiment YAMLs (a tiny local CLIP checkpoint, an image folder of a few files listed once
and then served from the listing cache... here synthetic data sized for S shards each), then times:
  parse      `snakemake --list-rules` (reads config, plans every experiment: hashes, shard ranges)
  dry run    `snakemake -n` (parse + build the DAG of every dump job)
Reference, same run: parse on an empty one-rule Snakefile (Snakemake's own start-up); the dry run on
a one-rule Snakefile with as many jobs (Snakemake's own DAG building, the floor of any dry run).
Target: parsing 20 experiments x 1000 shards <= 5 s.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

ROOT = benchlib.ROOT
SNAKEMAKE = os.path.join(os.path.dirname(sys.executable), "snakemake")


def timed(cmd, cwd) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experiments", type=int, default=20)
    ap.add_argument("--shards", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "src"))
    import yaml

    from actcache.demo import make_tiny_clip

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_clip(os.path.join(tmp, "tiny-clip"))
        files = []
        for e in range(args.experiments):
            doc = {
                "name": f"exp{e:02d}",
                "vit": {"family": "clip", "ckpt": ckpt, "layers": [-2]},
                # 17 tokens x 1 layer: 1 image per shard -> n_imgs = shards
                "data": {"kind": "synthetic", "n_imgs": args.shards, "seed": e},
                "cache": {"max_patches_per_shard": 17, "shards_per_job": 1},
            }
            path = os.path.join(tmp, f"exp{e:02d}.yaml")
            with open(path, "w") as fd:
                yaml.safe_dump(doc, fd)
            files.append(path)
        cfg = os.path.join(tmp, "config.yaml")
        with open(cfg, "w") as fd:
            yaml.safe_dump(
                {"dump_to": os.path.join(tmp, "cache"), "runs_to": os.path.join(tmp, "runs"), "experiments": files}, fd
            )
        empty = os.path.join(tmp, "Empty.smk")
        with open(empty, "w") as fd:
            fd.write("rule all:\n    output: 'x'\n    shell: 'touch {output}'\n")
        # The floor: Snakemake's own DAG of as many one-rule jobs, with nothing computed per job.
        floor = os.path.join(tmp, "Floor.smk")
        with open(floor, "w") as fd:
            fd.write(
                f"rule all:\n    input: expand('m/{{i}}.done', i=range({args.experiments * args.shards}))\n"
                "rule dump:\n    output: 'm/{i}.done'\n    shell: 'touch {output}'\n"
            )
        wf = [SNAKEMAKE, "-s", os.path.join(ROOT, "Snakefile"), "--configfile", cfg, "-d", tmp, "--cores", "1"]
        ref = [SNAKEMAKE, "-s", empty, "-d", tmp, "--cores", "1"]
        floor_cmd = [SNAKEMAKE, "-s", floor, "-d", tmp, "--cores", "1"]
        rows = []
        for what, extra in (("parse (--list-rules)", ["--list-rules"]), ("dry run (-n)", ["-n", "--quiet", "rules"])):
            t_wf = min(timed(wf + extra, tmp) for _ in range(args.repeats))
            t_ref = min(timed((floor_cmd if extra[0] == "-n" else ref) + extra, tmp) for _ in range(args.repeats))
            rows.append(
                {
                    "command": what,
                    "experiments": args.experiments,
                    "shards each": args.shards,
                    "dump jobs": args.experiments * args.shards,
                    "workflow s": t_wf,
                    "reference s": t_ref,
                    "ratio": t_wf / t_ref,
                }
            )
            print(rows[-1], flush=True)
    parse = rows[0]
    check = benchlib.check(
        f"parse {args.experiments} experiments x {args.shards:,} shards <= 5 s", parse["workflow s"], 5.0, "s",
        at_least=False,
    )  # fmt: skip
    setup = [
        f"{args.experiments} experiment YAMLs of {args.shards:,} shards each (synthetic data); best of "
        f"{args.repeats} runs.",
        "Reference, same run: parse against an empty one-rule Snakefile (Snakemake's own start-up); dry run "
        "against a one-rule Snakefile with as many jobs as dump jobs (Snakemake's own DAG building: the floor).",
    ]
    notes = [check.bullet(), f"a dry run, which builds the DAG of every dump job, takes {rows[-1]['workflow s']:.1f} s"]
    body = benchlib.section_body(setup, [benchlib.table(rows)], notes)
    print(body)
    if not args.no_record:
        benchlib.record("workflow-parse", "Workflow parse time", body, checks=[check])


if __name__ == "__main__":
    main()
