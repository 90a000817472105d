"""A real single-node Slurm cluster for tests (started by scripts/slurm/up.sh).

Use from a test module:

    import pytest
    import slurm_fixture

    slurm_cluster = slurm_fixture.slurm_cluster  # the module-scoped fixture

    pytestmark = pytest.mark.slurm

    def test_something(slurm_cluster):
        slurm_cluster.run(["sbatch", "--wait", ...])

Nothing is skipped: if the cluster cannot start, the test fails with up.sh's output. The cluster
is left running afterwards so later modules reuse it (up.sh's fast path takes well under a second).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
UP_SH = REPO / "scripts" / "slurm" / "up.sh"
DOWN_SH = REPO / "scripts" / "slurm" / "down.sh"
UP_TIMEOUT_S = 900  # a first run installs Debian packages


@dataclass(frozen=True)
class SlurmCluster:
    """What a test needs to know about the running cluster."""

    account: str
    partition: str
    repo: Path
    venv_bin: Path  # bin/ of the Python environment running the tests (snakemake lives there)

    def run(self, args, *, timeout: float = 120, check: bool = True, **kw):
        """Run a command, capturing text output; on failure, fail the test with that output."""
        proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, **kw)
        if check and proc.returncode != 0:
            pytest.fail(
                f"command failed (rc={proc.returncode}): {' '.join(map(str, args))}\n"
                f"--- stdout ---\n{proc.stdout[-8000:]}\n--- stderr ---\n{proc.stderr[-8000:]}",
                pytrace=False,
            )
        return proc

    def sacct(
        self, *args: str, fields: str = "JobID,JobName,State,ExitCode,Comment", wait_s: float = 15.0, until=None
    ) -> list[dict[str, str]]:
        """`sacct -X -P` rows as dicts. Accounting is written asynchronously, so poll until
        `until(rows)` is true (default: at least one row) or `wait_s` passes; return the last
        rows either way."""
        names = fields.split(",")
        deadline = time.monotonic() + wait_s
        while True:
            proc = self.run(["sacct", "-X", "-n", "-P", "-o", fields, *args], timeout=30)
            rows = [
                dict(zip(names, line.split("|", len(names) - 1), strict=False))
                for line in proc.stdout.splitlines()
                if line.strip()
            ]
            if (until(rows) if until else rows) or time.monotonic() > deadline:
                return rows
            time.sleep(0.5)


def start_cluster() -> SlurmCluster:
    """Run up.sh (idempotent); fail, never skip, when it does not come up."""
    account = os.environ.get("ACTCACHE_SLURM_ACCOUNT", "actcache")
    partition = os.environ.get("ACTCACHE_SLURM_PARTITION", "debug")
    try:
        proc = subprocess.run(
            ["bash", str(UP_SH)],
            capture_output=True,
            text=True,
            timeout=UP_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{UP_SH} timed out after {UP_TIMEOUT_S}s\n{e.stdout}\n{e.stderr}", pytrace=False)
    if proc.returncode != 0:
        pytest.fail(
            f"{UP_SH} failed (rc={proc.returncode}); the local Slurm cluster did not start\n"
            f"--- stdout ---\n{proc.stdout[-8000:]}\n--- stderr ---\n{proc.stderr[-8000:]}",
            pytrace=False,
        )
    return SlurmCluster(account=account, partition=partition, repo=REPO, venv_bin=Path(sys.executable).parent)


@pytest.fixture(scope="module")
def slurm_cluster() -> SlurmCluster:
    """A running local Slurm cluster (left running after the module)."""
    return start_cluster()
