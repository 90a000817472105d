"""The Slurm site checks (actcache.slurmsite) on what Slurm's commands print.

The records are real output of the local cluster of scripts/slurm/up.sh (Slurm 22.05); where a
test needs what that cluster lacks (GPU models, a down or restricted partition), it edits one
field of a real record, as named there."""

from __future__ import annotations

import os

from snakemake.resources import Resources

from actcache.slurmsite import (
    Cluster,
    JobSite,
    Setting,
    gres_gpus,
    jobs_from_resources,
    parse_assoc,
    parse_oneliners,
    site_problems,
    submits_to_slurm,
)

# sacctmgr -nP show assoc user=root format=account,partition,qos
ASSOC = "actcache||normal\nroot||normal\n"
# scontrol --all --oneliner show partition
PARTITION = (
    "PartitionName=debug AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=YES QoS=N/A "
    "DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 Hidden=NO MaxNodes=UNLIMITED "
    "MaxTime=UNLIMITED MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED Nodes=vm PriorityJobFactor=1 PriorityTier=1 "
    "RootOnly=NO ReqResv=NO OverSubscribe=NO OverTimeLimit=NONE PreemptMode=OFF State=UP TotalCPUs=2 "
    "TotalNodes=1 SelectTypeParameters=NONE JobDefaults=(null) DefMemPerNode=UNLIMITED MaxMemPerNode=UNLIMITED "
    "TRES=cpu=2,mem=22899M,node=1,billing=2,gres/gpu=2\n"
)
# scontrol --all --oneliner show node
NODE = (
    "NodeName=vm Arch=x86_64 CoresPerSocket=2  CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=2.22 "
    "AvailableFeatures=(null) ActiveFeatures=(null) Gres=gpu:2 NodeAddr=127.0.0.1 NodeHostName=vm "
    "Version=22.05.8 OS=Linux 6.18.44-fc-v1300 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=22899 AllocMem=0 "
    "FreeMem=17424 Sockets=1 Boards=1 State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A "
    "Partitions=debug  BootTime=2026-12-07T11:48:41 SlurmdStartTime=2026-12-07T14:28:16 "
    "LastBusyTime=2026-12-07T14:28:17 CfgTRES=cpu=2,mem=22899M,billing=2,gres/gpu=2 AllocTRES= CapWatts=n/a "
    "CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s\n"
)
QOS = "normal\n"

GPU_PART, CPU_PART, MODEL, ACCOUNT, QOS_VAR = (
    "ACTCACHE_SLURM_GPU_PARTITION", "ACTCACHE_SLURM_CPU_PARTITION", "ACTCACHE_SLURM_GPU_MODEL",
    "ACTCACHE_SLURM_ACCOUNT", "ACTCACHE_SLURM_QOS",
)  # fmt: skip


def cluster(partitions=PARTITION, nodes=NODE, groups=("users",), is_root=False) -> Cluster:
    return Cluster(
        assoc=parse_assoc(ASSOC),
        partitions={r["PartitionName"]: r for r in parse_oneliners(partitions)},
        nodes=parse_oneliners(nodes),
        qos={q for q in QOS.split()},
        groups=set(groups),
        user="root",
        is_root=is_root,
    )


def gpu_job(partition="debug", model=None, account="actcache", qos=None) -> JobSite:
    return JobSite(
        "dump",
        account=Setting(account, ACCOUNT),
        partition=Setting(partition, GPU_PART),
        gpus=1,
        gpu_model=Setting(model, MODEL) if model else None,
        qos=Setting(qos, QOS_VAR) if qos else None,
    )


def cpu_job(partition="debug") -> JobSite:
    return JobSite("gather", account=Setting("actcache", ACCOUNT), partition=Setting(partition, CPU_PART))


def test_scontrol_records_parse_with_values_that_hold_spaces():
    (node,) = parse_oneliners(NODE)
    assert node["OS"] == "Linux 6.18.44-fc-v1300 #1 SMP PREEMPT_DYNAMIC @0"
    assert node["Gres"] == "gpu:2" and node["Partitions"] == "debug" and node["AllocTRES"] == ""
    (part,) = parse_oneliners(PARTITION)
    assert part["State"] == "UP" and part["AllowAccounts"] == "ALL" and part["TRES"].endswith("gres/gpu=2")
    assert parse_assoc(ASSOC) == [("actcache", "", ["normal"]), ("root", "", ["normal"])]


def test_gres_field_gives_the_gpu_models_of_a_node():
    assert gres_gpus("gpu:2") == [None]
    assert gres_gpus("gpu:a100:4(S:0-1),gpu:h100:2") == ["a100", "h100"]
    assert gres_gpus("gpu:l40s:2(S:0,1),shard:8") == ["l40s"]
    assert gres_gpus("gpu:a100") == ["a100"]
    assert gres_gpus("(null)") == [] and gres_gpus("") == []


def test_settings_that_fit_the_local_cluster_raise_nothing():
    assert site_problems([gpu_job(qos="normal"), cpu_job()], cluster()) == []


def test_unknown_account_names_the_variable_and_the_users_accounts():
    (line,) = site_problems([gpu_job(account="nosuch"), cpu_job()], cluster())
    assert line.startswith("ACTCACHE_SLURM_ACCOUNT=nosuch is not a Slurm account of user root")
    assert "actcache, root" in line and line.endswith("set ACTCACHE_SLURM_ACCOUNT to one of them")


def test_missing_partitions_name_their_own_variable_once_each():
    jobs = [gpu_job("gpu"), JobSite("train", partition=Setting("gpu", GPU_PART), gpus=1), cpu_job("cpu")]
    lines = site_problems(jobs, cluster())
    assert lines == [
        "ACTCACHE_SLURM_GPU_PARTITION=gpu names no partition of this cluster (GPU partitions you may use: debug): "
        "set ACTCACHE_SLURM_GPU_PARTITION to one of them",
        "ACTCACHE_SLURM_CPU_PARTITION=cpu names no partition of this cluster (partitions you may use: debug): "
        "set ACTCACHE_SLURM_CPU_PARTITION to one of them",
    ]


def test_gpu_model_absent_from_the_partition_lists_the_models_there_and_where_it_is():
    # the real node with typed GPUs, and a second partition "big" whose node has the model asked for
    typed = NODE.replace("Gres=gpu:2", "Gres=gpu:h100:1(S:0),gpu:l40s:1(S:0)")
    big = (
        NODE.replace("NodeName=vm", "NodeName=vm2")
        .replace("Gres=gpu:2", "Gres=gpu:a100:4")
        .replace("Partitions=debug", "Partitions=big")
    )
    parts = PARTITION + PARTITION.replace("PartitionName=debug", "PartitionName=big")
    (line,) = site_problems([gpu_job(model="a100")], cluster(parts, typed + big))
    assert line == (
        "ACTCACHE_SLURM_GPU_MODEL=a100 matches no node of partition debug (models there: h100, l40s; partitions "
        "with a100: big): set ACTCACHE_SLURM_GPU_MODEL to one of them"
    )
    assert site_problems([gpu_job(model="h100")], cluster(parts, typed + big)) == []


def test_gpu_model_on_a_cluster_of_untyped_gpus_says_to_unset_it():
    (line,) = site_problems([gpu_job(model="a100")], cluster())
    assert line == (
        "ACTCACHE_SLURM_GPU_MODEL=a100 matches no node of partition debug (its GPUs have no model name): "
        "unset ACTCACHE_SLURM_GPU_MODEL"
    )


def test_gpu_jobs_on_a_partition_without_gpus_name_the_gpu_partitions():
    parts = PARTITION + PARTITION.replace("PartitionName=debug", "PartitionName=cpu")
    nodes = NODE + NODE.replace("NodeName=vm", "NodeName=c1").replace("Gres=gpu:2", "Gres=(null)").replace(
        "Partitions=debug", "Partitions=cpu"
    )
    (line,) = site_problems([gpu_job("cpu"), cpu_job("cpu")], cluster(parts, nodes))
    assert line.startswith("ACTCACHE_SLURM_GPU_PARTITION=cpu has no node with a GPU (Gres=gpu)")
    assert "(GPU partitions you may use: debug)" in line


def test_partition_that_is_down_or_refuses_the_account_group_or_qos_says_why():
    def one(field_from, field_to, **job):
        (line,) = site_problems([gpu_job(**job)], cluster(PARTITION.replace(field_from, field_to)))
        return line

    assert "debug is DOWN (GPU partitions you may use: none)" in one("State=UP", "State=DOWN")
    assert "admits the accounts physics only, not actcache" in one("AllowAccounts=ALL", "AllowAccounts=physics")
    assert "admits the groups gpuusers only (yours: users)" in one("AllowGroups=ALL", "AllowGroups=gpuusers")
    assert "admits the QOS long only, not normal" in one("AllowQos=ALL", "AllowQos=long", qos="normal")
    assert "takes jobs of root only" in one("RootOnly=NO", "RootOnly=YES")


def test_unknown_qos_and_one_the_account_may_not_use():
    (line,) = site_problems([gpu_job(qos="high")], cluster())
    assert (
        line
        == "ACTCACHE_SLURM_QOS=high names no QOS of this cluster (QOS: normal): set ACTCACHE_SLURM_QOS to one of them"
    )
    c = cluster()
    c.qos = {"normal", "high"}
    (line,) = site_problems([gpu_job(qos="high")], c)
    assert line.startswith("ACTCACHE_SLURM_QOS=high is not a QOS of account actcache for user root (allowed: normal)")


def test_what_the_cluster_could_not_say_is_not_checked():
    assert site_problems([gpu_job("gpu", model="a100", account="nosuch", qos="x")], Cluster()) == []


def test_settings_come_from_snakemakes_resources_with_the_variable_each_reads(monkeypatch):
    monkeypatch.setenv(GPU_PART, "gpu-a100")
    monkeypatch.delenv(MODEL, raising=False)
    monkeypatch.setenv(ACCOUNT, "proj1")
    env = "__import__('os').environ.get"
    defaults = Resources.parse(
        [f"slurm_account={env}('{ACCOUNT}') or ''", f"slurm_partition={env}('{CPU_PART}') or 'cpu'"],
        allow_expressions=True,
    )
    per_rule = {
        "dump": Resources.parse(
            ["gpu=1", f"slurm_partition={env}('{GPU_PART}') or 'gpu'", f"gpu_model={env}('{MODEL}') or None"],
            allow_expressions=True,
        ),
        "gather": Resources.parse(["slurm_partition=debug"], allow_expressions=True),
    }
    default, dump, gather = jobs_from_resources(defaults, per_rule)
    assert default.partition == Setting(os.environ.get(CPU_PART) or "cpu", CPU_PART)
    assert dump == JobSite(
        "dump", account=Setting("proj1", ACCOUNT), partition=Setting("gpu-a100", GPU_PART), gpus=1, gpu_model=None
    )
    assert gather.partition == Setting("debug", "set-resources gather: slurm_partition of the profile")
    assert submits_to_slurm(["snakemake", "-n"], [dump])
    assert not submits_to_slurm(["snakemake", "--executor", "local"], [dump])
    assert not submits_to_slurm(
        ["snakemake"], jobs_from_resources(None, {"dump": Resources.parse(["gpu=1"], allow_expressions=True)})
    )


def test_skip_variable_asks_nothing_and_passes_everything(monkeypatch):
    from actcache import slurmsite

    def no_asking(want_qos, timeout_s=0):
        raise AssertionError("the cluster was asked")

    monkeypatch.setattr(slurmsite, "ask_cluster", no_asking)
    assert slurmsite.check_site([gpu_job("nosuch")], env={slurmsite.SKIP_VAR: "1"}) == []


def test_a_list_of_partitions_passes_when_one_of_them_takes_the_jobs():
    assert site_problems([gpu_job("gpu,debug"), cpu_job("debug,short")], cluster()) == []
    (line,) = site_problems([gpu_job("gpu,a100", model="h100")], cluster())
    assert line.startswith("ACTCACHE_SLURM_GPU_PARTITION=gpu,a100 gpu names no partition of this cluster; a100 names")


def test_a_command_that_hangs_is_given_up_and_only_its_checks_are_skipped(tmp_path, monkeypatch):
    import time

    from actcache.slurmsite import ask_cluster

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "partition.txt").write_text(PARTITION)
    (tmp_path / "node.txt").write_text(NODE)
    scripts = {  # scontrol answers from the captured records; sacctmgr (slurmdbd away) hangs
        "scontrol": f'#!/bin/sh\nfor a; do last="$a"; done\ncat "{tmp_path}/$last.txt"\n',
        "sacctmgr": "#!/bin/sh\nexec sleep 30\n",
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    t0 = time.monotonic()
    c = ask_cluster(want_qos=True, timeout_s=0.5)
    assert time.monotonic() - t0 < 5  # one deadline for all, not one per command
    assert c.assoc is None and c.qos is None and list(c.partitions) == ["debug"] and len(c.nodes) == 1
    (line,) = site_problems([gpu_job(model="a100", account="nosuch", qos="high")], c)  # no account or QOS line
    assert line.startswith("ACTCACHE_SLURM_GPU_MODEL=a100")
