"""The local Slurm cluster schedules GPU jobs, keeps accounting, and runs a Snakemake workflow
through snakemake-executor-plugin-slurm (the same path the osc profile takes in production)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import uuid

import pytest

import slurm_fixture

# The module-scoped fixture, made visible to pytest in this module.
slurm_cluster = slurm_fixture.slurm_cluster

SNAKEMAKE_TIMEOUT_S = 300


@pytest.mark.slurm
def test_sbatch_gpu_job_runs_and_is_accounted(slurm_cluster, tmp_path):
    out = tmp_path / "job.out"
    proc = slurm_cluster.run(
        [
            "sbatch",
            "--wait",
            "--parsable",
            "--gpus=1",
            "--mem=300M",
            "--time=2",
            f"--account={slurm_cluster.account}",
            f"--partition={slurm_cluster.partition}",
            "--job-name=actcache-gpu-probe",
            f"--chdir={tmp_path}",
            f"--output={out}",
            "--wrap",
            'echo "CVD=${CUDA_VISIBLE_DEVICES:-unset} JOB=$SLURM_JOB_ID"',
        ],
        timeout=120,
    )
    job_id = proc.stdout.strip().split(";")[0]
    assert job_id.isdigit(), proc.stdout

    text = out.read_text()
    m = re.search(r"CVD=(\S+) JOB=(\d+)", text)
    assert m, text
    assert m.group(1) in {"0", "1"}, f"job did not get a (fake) GPU: {text!r}"
    assert m.group(2) == job_id

    # Accounting is eventually consistent: right after the job ends, slurmdbd may still show a
    # placeholder record (JobName "allocation") until the job-start message is stored.
    rows = slurm_cluster.sacct(
        "-j", job_id, until=lambda rs: rs and rs[0]["State"] == "COMPLETED" and rs[0]["JobName"] == "actcache-gpu-probe"
    )
    assert rows and rows[0]["State"] == "COMPLETED", rows
    assert rows[0]["JobName"] == "actcache-gpu-probe"
    assert rows[0]["ExitCode"] == "0:0"


SNAKEFILE = textwrap.dedent(
    """
    SHARDS = [0, 1]

    rule all:
        input: "gathered.txt"

    rule gpu_step:
        output: "gpu_{shard}.txt"
        resources: gpu=1
        shell: "echo shard={wildcards.shard} job=${{SLURM_JOB_ID:-local}} cvd=${{CUDA_VISIBLE_DEVICES:-none}} > {output}"

    rule gather_step:
        input: expand("gpu_{shard}.txt", shard=SHARDS)
        output: "gathered.txt"
        shell: "cat {input} > {output}; echo gather_job=${{SLURM_JOB_ID:-local}} >> {output}"
    """
)


@pytest.mark.slurm
def test_snakemake_slurm_executor_runs_gpu_and_cpu_rules(slurm_cluster, tmp_path):
    (tmp_path / "Snakefile").write_text(SNAKEFILE)
    prefix = "actcachetest" + uuid.uuid4().hex[:8]
    fast_polls = slurm_cluster.repo / "tests" / "slurm_polls.py"  # snakemake, polling Slurm every few seconds
    proc = slurm_cluster.run(
        [
            "timeout",
            "-s",
            "KILL",
            str(SNAKEMAKE_TIMEOUT_S),
            sys.executable,
            fast_polls,
            "--executor",
            "slurm",
            "--jobs",
            "4",
            "--directory",
            tmp_path,
            "--snakefile",
            tmp_path / "Snakefile",
            "--default-resources",
            f"slurm_account={slurm_cluster.account}",
            f"slurm_partition={slurm_cluster.partition}",
            "mem_mb=500",
            "runtime=10",
            "--slurm-init-seconds-before-status-checks",
            "2",
            "--slurm-jobname-prefix",
            prefix,
            "--latency-wait",
            "5",
        ],
        timeout=SNAKEMAKE_TIMEOUT_S + 30,
        cwd=tmp_path,
    )
    assert "100%" in proc.stderr + proc.stdout

    for shard in (0, 1):
        text = (tmp_path / f"gpu_{shard}.txt").read_text()
        m = re.fullmatch(rf"shard={shard} job=(\d+) cvd=(\S+)\n", text)
        assert m, f"gpu_{shard}.txt did not come from a Slurm job with a GPU: {text!r}"
        assert m.group(2) in {"0", "1"}, text
    gathered = (tmp_path / "gathered.txt").read_text()
    assert re.search(r"^gather_job=\d+$", gathered, re.M), gathered

    # The plugin names every job "<prefix>_<run uuid>" and comments it "rule_<name>_...".
    def mine(rows):
        return [r for r in rows if r["JobName"].startswith(prefix + "_")]

    rows = mine(
        slurm_cluster.sacct(
            "-S", "now-1hour", until=lambda rs: len(mine(rs)) == 3 and all(r["State"] == "COMPLETED" for r in mine(rs))
        )
    )
    assert len(rows) == 3, rows
    assert all(r["State"] == "COMPLETED" for r in rows), rows
    rules = sorted(re.match(r"rule_([a-z_]+?)(?:_wildcards_.*)?$", r["Comment"]).group(1) for r in rows)
    assert rules == ["gather_step", "gpu_step", "gpu_step"], rows


# The workflow's rule names, as in workflow/rules/*.smk; only what the profiles key on matters.
PROFILE_SNAKEFILE = textwrap.dedent(
    """
    rule all:
        input: "report.txt"
    rule dump:
        output: "acts_{s}.bin"
        shell: "touch {output}"
    rule gather:
        input: expand("acts_{s}.bin", s=[0, 1])
        output: "shards.json"
        shell: "touch {output}"
    rule train:
        input: "shards.json"
        output: "sae.pt"
        shell: "touch {output}"
    rule report:
        input: "sae.pt"
        output: "report.txt"
        shell: "touch {output}"
    """
)


def _dry_run_resources(profile, tmp_path, env):
    """`snakemake --profile PROFILE -n` on a throwaway workflow: {rule: resources line}."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "Snakefile").write_text(PROFILE_SNAKEFILE)
    snakemake = os.path.join(os.path.dirname(sys.executable), "snakemake")
    proc = subprocess.run(
        ["timeout", "-s", "KILL", "120", snakemake, "--profile", str(slurm_fixture.REPO / "profiles" / profile), "-n"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=150,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    return dict(re.findall(r"^rule (\w+):\n(?:    .*\n)*?    resources: (.*)$", log, re.M)), log


@pytest.mark.parametrize("profile", ["osc", "test-slurm"])
def test_slurm_profiles_parse_and_give_gpu_rules_a_gpu(profile, tmp_path):
    res, log = _dry_run_resources(profile, tmp_path, {"ACTCACHE_SLURM_ACCOUNT": "proj123"})
    assert set(res) >= {"dump", "gather", "train", "report"}, log
    for rule in ("dump", "train"):
        assert "gpu=1" in res[rule] and "cpus_per_gpu=" in res[rule], (rule, res[rule])
    assert "gpu=" not in res["gather"], res["gather"]
    account = "proj123" if profile == "osc" else "actcache"  # osc reads $ACTCACHE_SLURM_ACCOUNT
    assert all(f"slurm_account={account}" in r for r in res.values()), res


def test_osc_profile_takes_site_settings_from_the_environment_with_osc_defaults(tmp_path):
    site = {
        "ACTCACHE_SLURM_ACCOUNT": "proj9",
        "ACTCACHE_SLURM_GPU_PARTITION": "gpu-a100",
        "ACTCACHE_SLURM_CPU_PARTITION": "short",
        "ACTCACHE_SLURM_GPU_MODEL": "a100",
        "ACTCACHE_SLURM_CPUS_PER_GPU": "6",
        "ACTCACHE_SLURM_DUMP_MEM_MB": "1234",
        "ACTCACHE_SLURM_TRAIN_RUNTIME": "99",
        "ACTCACHE_SLURM_QOS": "normal",
        "ACTCACHE_SLURM_GPU_CONSTRAINT": "a100",
        "ACTCACHE_SLURM_RESERVATION": "hack day",
        "ACTCACHE_SLURM_EXTRA": "--exclusive",
        "ACTCACHE_SLURM_TRAIN_EXTRA": "--mail-type=FAIL",
    }
    res, log = _dry_run_resources("osc", tmp_path / "site", {**site})
    assert all("qos=normal" in r for r in res.values()), res
    assert "constraint=a100" in res["dump"] and "constraint" not in res["gather"], res
    assert "slurm_extra=--reservation='hack day' --exclusive --mail-type=FAIL" in res["train"], res["train"]
    assert "slurm_extra=--reservation='hack day' --exclusive," in res["dump"] + ",", res["dump"]
    assert "slurm_partition=gpu-a100" in res["dump"] and "gpu_model=a100" in res["dump"], res["dump"]
    assert "mem_mb=1234" in res["dump"] and "cpus_per_gpu=6" in res["dump"], res["dump"]
    assert "runtime=99" in res["train"] and "slurm_partition=short" in res["gather"], res
    assert all("slurm_account=proj9" in r for r in res.values()), res

    unset = {k: "" for k in site}  # empty counts as unset: OSC's values
    res, log = _dry_run_resources("osc", tmp_path / "osc", unset)
    assert "slurm_partition=gpu" in res["dump"] and "gpu_model" not in res["dump"], res["dump"]
    assert "mem_mb=64000" in res["dump"] and "cpus_per_gpu=8" in res["dump"], res["dump"]
    assert "runtime=720" in res["train"] and "slurm_partition=cpu" in res["gather"], res
    assert not any(k in r for r in res.values() for k in ("qos", "constraint", "slurm_extra")), res


@pytest.mark.slurm
def test_site_warnings_name_an_unset_or_unknown_account_and_stay_quiet_for_a_known_one(slurm_cluster):
    from actcache.slurmjobs import site_warnings

    (unset,) = site_warnings(env={})
    assert "ACTCACHE_SLURM_ACCOUNT is not set" in unset and slurm_cluster.account in unset
    (unknown,) = site_warnings(env={"ACTCACHE_SLURM_ACCOUNT": "nosuchproject"})
    assert "nosuchproject is not one of your Slurm accounts" in unknown
    assert site_warnings(env={"ACTCACHE_SLURM_ACCOUNT": slurm_cluster.account}) == []
