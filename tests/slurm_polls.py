"""`snakemake` for the Slurm tests, with the Slurm executor plugin's status checks every few seconds.

    python tests/slurm_polls.py [snakemake arguments]

After each status check that finds no job finished, the plugin waits 10 s longer before the next
one (up to 180 s): right for a busy production cluster, idle time on the tests' private one,
where it made up most of each Slurm test's duration. The wait is capped at POLL_CAP_S; the
tests also pass --slurm-init-seconds-before-status-checks 2. Nothing else changes: the jobs,
their scripts and the plugin's handling of their states are the production ones.
"""

import sys

import snakemake_executor_plugin_slurm as slurm
from snakemake.cli import main
from snakemake_interface_executor_plugins.executors.remote import RemoteExecutor

POLL_CAP_S = 3
_base = RemoteExecutor.next_seconds_between_status_checks


def _set(self, seconds):
    _base.fset(self, None if seconds is None else min(seconds, POLL_CAP_S))


slurm.Executor.next_seconds_between_status_checks = property(_base.fget, _set)

if __name__ == "__main__":
    sys.exit(main())
