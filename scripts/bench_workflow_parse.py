"""Benchmark: how long the workflow takes to parse and dry-run many experiments with many shards.

    python scripts/bench_workflow_parse.py [--experiments 20] [--shards 1000] [--repeats 3]

Writes N experiment YAMLs (a tiny local CLIP checkpoint, synthetic data sized for S shards each),
then times, each against a reference run in alternating rounds (medians):
  parse      `snakemake --list-rules` (reads config, plans every experiment: hashes, shard ranges);
             reference: an empty one-rule Snakefile (Snakemake's own start-up)
  dry run    `snakemake -n` with profiles/local and profiles/osc (parse + the DAG of every dump job),
             at the default job sizing (`shards_per_job: auto`) on full-size shards (the default
             max_patches_per_shard at d=1024, float32), on tiny shards, and at shards_per_job 1;
             reference: a one-rule Snakefile with as many jobs under the same profile (Snakemake's
             own DAG building and job printing, the floor of any dry run with that job count)
The osc profile runs against the local Slurm of scripts/slurm/up.sh with profiles/sites/local-slurm.env
(a dry run submits nothing; it asks Slurm for accounts, MinJobAge and jobs in flight).
Targets: parsing 20 experiments x 1000 shards <= 5 s; their dry run at the default sizing <= 10 s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

ROOT = benchlib.ROOT
SNAKEMAKE = os.path.join(os.path.dirname(sys.executable), "snakemake")
TIME = "/usr/bin/time"  # GNU time
TINY_D = 64  # actcache.demo.make_tiny_clip: d=64, 16 patches + CLS = 17 tokens, one layer recorded


def run(cmd, cwd, env) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds (user + system, its children included) and peak resident MB of one
    command, from GNU time (a child forked from this process, which holds torch, would report this
    process's peak memory instead)."""
    with tempfile.TemporaryDirectory() as d:
        usage = os.path.join(d, "usage")
        t0 = time.perf_counter()
        proc = subprocess.run([TIME, "-f", "%U %S %M", "-o", usage, *cmd], cwd=cwd, env=env, capture_output=True,
                              text=True)  # fmt: skip
        dt = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        with open(usage) as fd:
            user, system, kb = fd.read().split()[-3:]
    return dt, float(user) + float(system), int(kb) / 1024


def write_project(root: str, ckpt: str, n_exp: int, n_shards: int, shard_vectors: int, per_job) -> str:
    """config.yaml and n_exp experiments of n_shards shards of shard_vectors vectors; returns its path."""
    import yaml

    os.makedirs(root)
    files = []
    for e in range(n_exp):
        cache = {"max_patches_per_shard": shard_vectors, **({"shards_per_job": per_job} if per_job else {})}
        doc = {
            "name": f"exp{e:02d}",
            "vit": {"family": "clip", "ckpt": ckpt, "layers": [-2]},
            "data": {"kind": "synthetic", "n_imgs": n_shards * (shard_vectors // 17), "seed": e},
            "cache": cache,
        }
        files.append(os.path.join(root, f"exp{e:02d}.yaml"))
        with open(files[-1], "w") as fd:
            yaml.safe_dump(doc, fd)
    cfg = os.path.join(root, "config.yaml")
    with open(cfg, "w") as fd:
        yaml.safe_dump({"dump_to": f"{root}/cache", "runs_to": f"{root}/runs", "experiments": files}, fd)
    return cfg


def dump_jobs(cfg: str) -> tuple[int, int]:
    """(dump jobs, shards per job of the first experiment) as `actcache plan` counts them."""
    sys.path.insert(0, os.path.join(ROOT, "src"))
    from actcache.plan import plan_from_config

    planned = plan_from_config(cfg)
    return sum(len(p.ranges) for p in planned), planned[0].ranges[0][1] - planned[0].ranges[0][0]


def floor_snakefile(tmp: str, n_jobs: int) -> str:
    """Snakemake's own DAG of as many one-rule jobs, with nothing computed per job (rule `dump`, so
    a profile's settings for dump apply to it)."""
    path = os.path.join(tmp, f"Floor{n_jobs}.smk")
    with open(path, "w") as fd:
        fd.write(
            f"rule all:\n    input: expand('m/{{i}}.done', i=range({n_jobs}))\n"
            "rule dump:\n    output: 'm/{i}.done'\n    shell: 'touch {output}'\n"
        )
    return path


def measure(wf_cmd, ref_cmd, cwd, env, repeats: int) -> dict:
    """Alternating rounds of the workflow and its reference; medians (memory: the peak)."""
    wf, ref = [], []
    for _ in range(repeats):
        wf.append(run(wf_cmd, cwd, env))
        ref.append(run(ref_cmd, cwd, env))

    def med(runs, i):
        return statistics.median(r[i] for r in runs)

    return {"wall s": med(wf, 0), "CPU s": med(wf, 1), "floor wall s": med(ref, 0), "floor CPU s": med(ref, 1),
            "CPU ratio": med(wf, 1) / med(ref, 1),
            "MB (floor)": f"{max(r[2] for r in wf):.0f} ({max(r[2] for r in ref):.0f})"}  # fmt: skip


def slurm_up() -> bool:
    try:
        return subprocess.run(["scontrol", "ping"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experiments", type=int, default=20)
    ap.add_argument("--shards", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3, help="rounds of each row (median)")
    ap.add_argument("--ref-repeats", type=int, default=1, help="rounds of the shards_per_job 1 rows")
    ap.add_argument("--no-osc", action="store_true", help="skip the osc profile (no local Slurm)")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "src"))
    from actcache.demo import make_tiny_clip
    from actcache.protocol import DEFAULT_MAX_PATCHES_PER_SHARD

    # full-size shards: the bytes of a default shard at d=1024 float32, in the tiny model's d=64
    full = DEFAULT_MAX_PATCHES_PER_SHARD * 1024 // TINY_D
    full_gib = full * TINY_D * 4 / 2**30
    load0 = os.getloadavg()[0]
    osc = not args.no_osc
    if osc and not slurm_up():
        raise SystemExit("no local Slurm (scontrol ping failed): start it with scripts/slurm/up.sh, or pass --no-osc")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_clip(os.path.join(tmp, "tiny-clip"))
        n, s = args.experiments, args.shards
        projects = {
            ("full-size", "auto"): write_project(f"{tmp}/full", ckpt, n, s, full, None),
            ("tiny", "auto"): write_project(f"{tmp}/tiny", ckpt, n, s, 17, None),
            ("tiny", 1): write_project(f"{tmp}/one", ckpt, n, s, 17, 1),
        }
        empty = os.path.join(tmp, "Empty.smk")
        with open(empty, "w") as fd:
            fd.write("rule all:\n    output: 'x'\n    shell: 'touch {output}'\n")
        local_env = dict(os.environ, HF_HUB_OFFLINE="1")
        profiles = {"local": local_env, **({"osc": benchlib.site_env()} if osc else {})}

        def base(snakefile, cfg=None, profile=None):
            cmd = [SNAKEMAKE, "-s", snakefile, "-d", tmp]
            cmd += ["--configfile", cfg] if cfg else []
            return cmd + (["--profile", os.path.join(ROOT, "profiles", profile)] if profile else ["--cores", "1"])

        rows = []
        cfg = projects[("tiny", 1)]
        r = measure(base(f"{ROOT}/Snakefile", cfg) + ["--list-rules"], base(empty) + ["--list-rules"], tmp,
                    local_env, args.repeats)  # fmt: skip
        rows.append({"command": "parse (--list-rules)", "profile": "none", "shards, per job": "tiny, 1",
                     "dump jobs": dump_jobs(cfg)[0], **r})  # fmt: skip
        print(rows[-1], flush=True)
        order = [("full-size", "auto", p) for p in profiles] + [("tiny", "auto", "local")]
        order += [("tiny", 1, p) for p in profiles]
        for shards, per_job, profile in order:
            cfg = projects[(shards, per_job)]
            jobs, per = dump_jobs(cfg)
            wf = base(f"{ROOT}/Snakefile", cfg, profile) + ["-n", "--quiet", "rules"]
            ref = base(floor_snakefile(tmp, jobs), None, profile) + ["-n", "--quiet", "rules"]
            repeats = args.ref_repeats if per_job == 1 else args.repeats
            r = measure(wf, ref, tmp, profiles[profile], repeats)
            label = "dry run (-n)" if per_job == "auto" else "dry run (-n), shards_per_job 1"
            per = f"{per} (auto)" if per_job == "auto" else per
            rows.append({"command": label, "profile": profile, "shards, per job": f"{shards}, {per}", "dump jobs": jobs,
                         **r})  # fmt: skip
            print(rows[-1], flush=True)
    load1 = os.getloadavg()[0]
    parse = rows[0]
    checks = [benchlib.check(f"parse {n} experiments x {s:,} shards <= 5 s (CPU s)", parse["CPU s"], 5.0, "s",
                             at_least=False)]  # fmt: skip
    sized = [r for r in rows if r["shards, per job"].startswith("full-size")]
    for row in sized:
        checks.append(benchlib.check(
            f"dry run {n} x {s:,} full-size shards, default job sizing, {row['profile']} profile <= 10 s (CPU s)",
            row["CPU s"], 10.0, "s", at_least=False,
        ))  # fmt: skip
    setup = [
        f"{n} experiment YAMLs of {s:,} shards each (synthetic data): full-size shards of {full_gib:.2f} GiB (the "
        "default max_patches_per_shard at d=1024, float32) or tiny ones (17 vectors); medians of "
        f"{args.repeats} alternating rounds ({args.ref_repeats} for shards_per_job 1).",
        "Reference, same run: parse against an empty one-rule Snakefile (Snakemake's own start-up); a dry run "
        "against a one-rule Snakefile with as many jobs under the same profile (Snakemake's own DAG and job "
        "printing: the floor). CPU s: user + system seconds of snakemake and its children, what the wall time "
        "is on an idle machine; MB: peak resident memory of the snakemake process.",
        "osc: profiles/osc with profiles/sites/local-slurm.env against the local Slurm of scripts/slurm/up.sh "
        "(a dry run asks it for accounts, MinJobAge and jobs in flight)." if osc else "osc profile not run.",
        f"Load average (1 min) at start / end: {load0:.1f} / {load1:.1f} (2 cores): wall times are inflated by it.",
    ]
    notes = [c.bullet() for c in checks]
    notes.append("wall time of those dry runs at this load: "
                 + ", ".join(f"{r['wall s']:.1f} s ({r['profile']})" for r in sized))  # fmt: skip
    one = [r for r in rows if r["shards, per job"] == "tiny, 1" and r["command"].startswith("dry")]
    if one:
        notes.append("at shards_per_job 1 (one job per shard) the dry run takes "
                     + ", ".join(f"{r['CPU s']:.1f} CPU s ({r['profile']})" for r in one)
                     + f"; Snakemake's own floor for {one[0]['dump jobs']:,} jobs alone is "
                     + ", ".join(f"{r['floor CPU s']:.1f} CPU s" for r in one))  # fmt: skip
    body = benchlib.section_body(setup, [benchlib.table(rows)], notes)
    print(body)
    if not args.no_record:
        benchlib.record("workflow-parse", "Workflow parse time", body, checks=checks)


if __name__ == "__main__":
    main()
