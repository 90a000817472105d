"""Ask the Slurm cluster, before anything is submitted, whether the profile's site settings fit it.

The dry run and a real run (workflow/rules/common.smk, on the login node) check the values in
force for every rule: the account (the user is associated with it), each partition (it exists,
is up, and admits the account, the user's groups and the QOS), the GPU partition's nodes (they
have GPUs, of the model asked for) and the QOS (it exists and the account may use it). Each
problem is one line naming the variable to set and the values that would work; the run then
stops before submitting anything.

One call per Slurm command, all started at once with a short timeout (the dry run waits for the
slowest, not their sum). Where a command is missing, fails or hangs, its checks are skipped:
there is nothing to check against (the local profile, a machine without Slurm).
ACTCACHE_SLURM_SKIP_CHECKS=1 skips every check (a site where one is wrong).
"""

from __future__ import annotations

import getpass
import grp
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field

SKIP_VAR = "ACTCACHE_SLURM_SKIP_CHECKS"
TIMEOUT_S = 5.0
COMMANDS = {
    "assoc": ["sacctmgr", "-n", "-P", "show", "assoc", "user={user}", "format=account,partition,qos"],
    "partitions": ["scontrol", "--all", "--oneliner", "show", "partition"],
    "nodes": ["scontrol", "--all", "--oneliner", "show", "node"],
    "qos": ["sacctmgr", "-n", "-P", "show", "qos", "format=name"],
}
_VAR_IN_EXPR = re.compile(r"environ\.get\(\s*['\"](ACTCACHE_SLURM_\w+)['\"]")


@dataclass(frozen=True)
class Setting:
    """One value the jobs will be submitted with, and how the user sets it."""

    value: str
    source: str  # the environment variable the profile reads it from, else where it is written

    def is_variable(self) -> bool:
        return self.source.startswith("ACTCACHE_")

    def names(self) -> str:
        return f"{self.source}={self.value}" if self.is_variable() else f"{self.source} ({self.value})"

    def fix(self, choices) -> str:
        how = f"set {self.source}" if self.is_variable() else f"change {self.source}"
        return f"{how} to one of them" if choices else how


@dataclass(frozen=True)
class JobSite:
    """Where one rule's jobs go: the Slurm resources of the profile in force, evaluated."""

    rule: str
    account: Setting | None = None
    partition: Setting | None = None
    gpus: int = 0
    gpu_model: Setting | None = None
    qos: Setting | None = None


@dataclass
class Cluster:
    """What the cluster said; None where it could not be asked."""

    assoc: list[tuple[str, str, list[str]]] | None = None  # (account, partition or "", allowed QOS)
    partitions: dict[str, dict[str, str]] | None = None
    nodes: list[dict[str, str]] | None = None
    qos: set[str] | None = None
    groups: set[str] = field(default_factory=set)
    user: str = ""
    is_root: bool = False


# ---- parsing the commands' output ------------------------------------------------------------


def parse_oneliners(text: str) -> list[dict[str, str]]:
    """`scontrol --oneliner show ...`: one record per line of Key=Value fields (a value may hold
    spaces, e.g. OS=Linux 6.1 #1 SMP: a word without a Key= belongs to the value before it)."""
    records = []
    for line in text.splitlines():
        rec: dict[str, str] = {}
        last = None
        for word in line.split():
            m = re.match(r"([A-Za-z][\w/]*)=(.*)", word)
            if m:
                last = m.group(1)
                rec[last] = m.group(2)
            elif last is not None:
                rec[last] += " " + word
        if rec:
            records.append(rec)
    return records


def parse_assoc(text: str) -> list[tuple[str, str, list[str]]]:
    """`sacctmgr -nP show assoc format=account,partition,qos`: (account, partition, [qos])."""
    rows = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 3 and parts[0]:
            rows.append((parts[0].lower(), parts[1], [q for q in parts[2].split(",") if q]))
    return rows


def gres_gpus(gres: str) -> list[str | None]:
    """GPU models of a node's Gres field, one entry per GPU kind (None: GPUs without a model):
    "gpu:a100:4(S:0-1),gpu:h100:2" -> ["a100", "h100"]; "gpu:2" -> [None]; "(null)" -> []."""
    out: list[str | None] = []
    for item in re.split(r",(?![^(]*\))", gres):
        parts = re.sub(r"\(.*\)$", "", item.strip()).split(":")
        if parts[0] != "gpu" or len(parts) < 2:
            continue
        if len(parts) == 2:
            out.append(None if parts[1].isdigit() else parts[1])
        else:
            out.append(parts[1])
    return out


def _listed(value: str | None) -> set[str] | None:
    """A partition's AllowX/DenyX list; None for ALL (or not set)."""
    if value is None or value.upper() in ("ALL", "", "(NULL)"):
        return None
    return {v.strip() for v in value.split(",") if v.strip()}


# ---- asking the cluster ------------------------------------------------------------------------


def _start(cmd: list[str]) -> subprocess.Popen | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError:
        return None


def _finish(proc: subprocess.Popen | None, deadline: float) -> str | None:
    """stdout of a started command, or None where it failed or is still running at ``deadline``."""
    if proc is None:
        return None
    try:
        out, _ = proc.communicate(timeout=max(0.01, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return None
    return out if proc.returncode == 0 else None


def ask_cluster(want_qos: bool, timeout_s: float = TIMEOUT_S) -> Cluster:
    """Run each Slurm command once, all at the same time, and parse what they say."""
    user = getpass.getuser()
    names = [n for n in COMMANDS if n != "qos" or want_qos]
    procs = {n: _start([a.format(user=user) for a in COMMANDS[n]]) for n in names}
    deadline = time.monotonic() + timeout_s  # one for all: they run at the same time
    outs = {n: _finish(p, deadline) for n, p in procs.items()}
    c = Cluster(user=user, is_root=os.geteuid() == 0, groups=_user_groups())
    if outs.get("assoc") is not None:
        c.assoc = parse_assoc(outs["assoc"]) or None  # no rows: accounting cannot tell
    if outs.get("partitions") is not None:  # none listed: not an answer (every cluster has one)
        parts = {r["PartitionName"]: r for r in parse_oneliners(outs["partitions"]) if "PartitionName" in r}
        c.partitions = parts or None
    if outs.get("nodes") is not None:
        c.nodes = [r for r in parse_oneliners(outs["nodes"]) if "NodeName" in r] or None
    if outs.get("qos") is not None:
        c.qos = {q.strip() for q in outs["qos"].splitlines() if q.strip()} or None
    return c


def _user_groups() -> set[str]:
    names = set()
    for gid in {os.getgid(), *os.getgroups()}:
        try:
            names.add(grp.getgrgid(gid).gr_name)
        except KeyError:
            continue
    return names


# ---- the checks ------------------------------------------------------------------------------


def _refusal(part: dict[str, str], c: Cluster, account: str | None, qos: str | None) -> str | None:
    """Why partition record ``part`` takes no job of this user (with this account and QOS), or None."""
    state = part.get("State", "UP").upper()
    if state != "UP":
        return f"is {state}"
    if part.get("RootOnly", "NO").upper() == "YES" and not c.is_root:
        return "takes jobs of root only"
    allowed = _listed(part.get("AllowAccounts"))
    if account and allowed is not None and account.lower() not in {a.lower() for a in allowed}:
        return f"admits the accounts {', '.join(sorted(allowed))} only, not {account}"
    denied = _listed(part.get("DenyAccounts"))
    if account and denied is not None and account.lower() in {a.lower() for a in denied}:
        return f"refuses the account {account}"
    groups = _listed(part.get("AllowGroups"))
    if groups is not None and not (groups & c.groups) and not c.is_root:
        return f"admits the groups {', '.join(sorted(groups))} only (yours: {', '.join(sorted(c.groups))})"
    qoses = _listed(part.get("AllowQos"))
    if qos and qoses is not None and qos not in qoses:
        return f"admits the QOS {', '.join(sorted(qoses))} only, not {qos}"
    deny_qos = _listed(part.get("DenyQos"))
    if qos and deny_qos is not None and qos in deny_qos:
        return f"refuses the QOS {qos}"
    return None


def _gpu_models(c: Cluster, partition: str) -> list[str | None] | None:
    """GPU models on the nodes of ``partition`` (None in it: GPUs without a model); None: unknown."""
    if c.nodes is None:
        return None
    models: list[str | None] = []
    for node in c.nodes:
        if partition in node.get("Partitions", "").split(","):
            models += gres_gpus(node.get("Gres", ""))
    return models


def _partitions_with_gpus(c: Cluster, account, qos, model: str | None) -> list[str]:
    out = []
    for name, part in sorted((c.partitions or {}).items()):
        models = _gpu_models(c, name) or []
        if models and (model is None or model in models) and _refusal(part, c, account, qos) is None:
            out.append(name)
    return out


def _usable(c: Cluster, account, qos) -> list[str]:
    return [n for n, p in sorted((c.partitions or {}).items()) if _refusal(p, c, account, qos) is None]


def _one_of(names) -> str:
    return ", ".join(names) if names else "none"


def account_problem(job: JobSite, c: Cluster) -> str | None:
    if job.account is None or not job.account.value or c.assoc is None:
        return None
    mine = sorted({a for a, _, _ in c.assoc})
    if job.account.value.lower() in mine:
        return None
    return (
        f"{job.account.names()} is not a Slurm account of user {c.user} (sacctmgr: {_one_of(mine)}): "
        f"{job.account.fix(mine)}"
    )


def _partition_refusal(name: str, job: JobSite, c: Cluster) -> str | None:
    """Why one partition takes none of ``job``'s jobs, or None."""
    account, qos = _value(job.account), _value(job.qos)
    part = c.partitions.get(name) if c.partitions is not None else None
    if part is None:
        return "names no partition of this cluster"
    why = _refusal(part, c, account, qos)
    if why is None and c.assoc is not None and account:
        only = {p for a, p, _ in c.assoc if a == account.lower()}
        if "" not in only and only and name not in only:
            why = f"is not one of the partitions of account {account} ({', '.join(sorted(only))})"
    if why is None and job.gpus and _gpu_models(c, name) == []:
        why = "has no node with a GPU (Gres=gpu)"
    return why


def partition_problem(job: JobSite, c: Cluster) -> str | None:
    """A partition (or a list, sbatch -p a,b: Slurm takes the first that can run the job) that takes
    none of the job's jobs."""
    if job.partition is None or not job.partition.value or c.partitions is None:
        return None
    whys = [_partition_refusal(n, job, c) for n in _names(job.partition.value)]
    if not whys or None in whys:
        return None
    account, qos = _value(job.account), _value(job.qos)
    choices = _partitions_with_gpus(c, account, qos, None) if job.gpus else _usable(c, account, qos)
    what = "GPU partitions you may use" if job.gpus else "partitions you may use"
    why = (
        whys[0]
        if len(whys) == 1
        else "; ".join(f"{n} {w}" for n, w in zip(_names(job.partition.value), whys, strict=True))
    )
    return f"{job.partition.names()} {why} ({what}: {_one_of(choices)}): {job.partition.fix(choices)}"


def _names(value: str) -> list[str]:
    return [n.strip() for n in value.split(",") if n.strip()]


def gpu_model_problem(job: JobSite, c: Cluster) -> str | None:
    if not job.gpus or job.gpu_model is None or not job.gpu_model.value or job.partition is None:
        return None
    parts = _names(job.partition.value)
    if c.partitions is not None and not any(p in c.partitions for p in parts):
        return None  # the partition's own line says what to do
    models = [m for p in parts for m in (_gpu_models(c, p) or [])]
    want = job.gpu_model.value
    if not models or want in models:
        return None  # unknown, or no GPUs at all: the partition's line
    named = sorted({m for m in models if m is not None})
    where = f"partition {job.partition.value}" if len(parts) == 1 else f"partitions {job.partition.value}"
    if not named:
        how = f"unset {job.gpu_model.source}" if job.gpu_model.is_variable() else f"remove {job.gpu_model.source}"
        return f"{job.gpu_model.names()} matches no node of {where} (its GPUs have no model name): {how}"
    elsewhere = _partitions_with_gpus(c, _value(job.account), _value(job.qos), want)
    also = f"; partitions with {want}: {', '.join(elsewhere)}" if elsewhere else ""
    return (
        f"{job.gpu_model.names()} matches no node of {where} (models there: {', '.join(named)}{also}): "
        f"{job.gpu_model.fix(named)}"
    )


def qos_problem(job: JobSite, c: Cluster) -> str | None:
    if job.qos is None or not job.qos.value:
        return None
    want = job.qos.value
    if c.qos is not None and want not in c.qos:
        return f"{job.qos.names()} names no QOS of this cluster (QOS: {_one_of(sorted(c.qos))}): {job.qos.fix(c.qos)}"
    account = _value(job.account)
    if c.assoc is None or not account:
        return None
    rows = [q for a, _, q in c.assoc if a == account.lower()]
    allowed = sorted({x for q in rows for x in q})
    if rows and allowed and want not in allowed:
        return (
            f"{job.qos.names()} is not a QOS of account {account} for user {c.user} "
            f"(allowed: {', '.join(allowed)}): {job.qos.fix(allowed)}"
        )
    return None


def _value(s: Setting | None) -> str | None:
    return s.value if s is not None and s.value else None


CHECKS = (account_problem, partition_problem, gpu_model_problem, qos_problem)


def site_problems(jobs: list[JobSite], cluster: Cluster) -> list[str]:
    """One line per problem of the jobs' site settings on ``cluster`` (a line shared by several
    rules once)."""
    lines = [check(job, cluster) for job in jobs for check in CHECKS]
    return list(dict.fromkeys(line for line in lines if line))


def check_site(jobs: list[JobSite], env=None) -> list[str]:
    """The problems of ``jobs`` on the cluster this machine submits to; [] where it cannot be asked
    or ACTCACHE_SLURM_SKIP_CHECKS is set."""
    env = os.environ if env is None else env
    if env.get(SKIP_VAR, "").strip() not in ("", "0") or not jobs:
        return []
    cluster = ask_cluster(want_qos=any(_value(j.qos) for j in jobs))
    return site_problems(jobs, cluster)


# ---- the values in force, from Snakemake's resources -----------------------------------------


def _setting(res, where: str) -> Setting | None:
    """A Snakemake resource evaluated outside any job (the profile's expressions read only the
    environment), with the variable its expression reads; None where it needs a job or is empty."""
    try:
        value = res.evaluate(None, None, 1, 1, None, None)
    except Exception:  # an expression of wildcards or input: not a site setting we can check
        return None
    value = getattr(value, "value", value)
    if value is None or value == "" or not isinstance(value, (str, int)):
        return None
    m = _VAR_IN_EXPR.search(str(getattr(res, "raw", "") or ""))
    return Setting(str(value), m.group(1) if m else where)


def jobs_from_resources(default_resources, overwrite_resources) -> list[JobSite]:
    """The JobSite of every rule the profile sets resources for, plus one of the defaults (any
    other rule), from Snakemake's ``default_resources`` and ``overwrite_resources``."""
    defaults = default_resources if default_resources is not None else {}
    per_rule = dict(overwrite_resources or {})
    jobs = []
    for rule, own in [("(default-resources)", {}), *sorted(per_rule.items())]:

        def get(name, own=own, rule=rule):
            if name in own:
                return _setting(own[name], f"set-resources {rule}: {name} of the profile")
            if name in defaults:
                return _setting(defaults[name], f"default-resources {name} of the profile")
            return None

        gpus = get("gpu")
        jobs.append(
            JobSite(
                rule,
                account=get("slurm_account"),
                partition=get("slurm_partition"),
                gpus=int(gpus.value) if gpus is not None and str(gpus.value).isdigit() else 0,
                gpu_model=get("gpu_model"),
                qos=get("qos"),
            )
        )
    return jobs


def submits_to_slurm(argv: list[str], jobs: list[JobSite]) -> bool:
    """Whether a snakemake started with ``argv`` submits ``jobs`` through Slurm: its profile sets
    Slurm partitions or accounts, and its command line names no other executor."""
    executor = None
    for i, arg in enumerate(argv):
        if arg in ("--executor", "-e") and i + 1 < len(argv):
            executor = argv[i + 1]
        elif arg.startswith("--executor="):
            executor = arg.split("=", 1)[1]
    if executor is not None and executor != "slurm":
        return False
    return any(j.partition is not None or j.account is not None for j in jobs)
