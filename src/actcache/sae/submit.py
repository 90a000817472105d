"""submitit entry point: one training group as a (re)queueable Slurm job.

    import submitit
    from actcache.sae.submit import TrainJob
    ex = submitit.AutoExecutor(folder="runs/submitit")
    ex.update_parameters(slurm_partition="gpu", gpus_per_node=1, timeout_min=240)
    job = ex.submit(TrainJob("<dump_to>/<HASH>", runs, "runs"))     # runs: list[RunConfig]

Preemption and time limits: Slurm sends SIGUSR2 ``signal_delay_s`` before the end (submitit asks
for it; ``job._interrupt()`` sends it in tests). :class:`TrainJob` puts its own handler in front of
submitit's: it only sets a flag, so the training loop finishes the current step, writes a
checkpoint (weights, optimizer, loader position) and stops. Then submitit's handler runs, calls
:meth:`TrainJob.checkpoint` (which returns a ``DelayedSubmission`` of a fresh TrainJob: all state is
on disk) and requeues the job; the requeued job resumes from that checkpoint. A job whose group is
already finished returns at once. scripts/sweep.py submits a whole sweep as a job array.
"""

from __future__ import annotations

import logging
import os
import signal

from actcache.sae.config import RunConfig

log = logging.getLogger(__name__)


def _preempt_signal() -> signal.Signals:
    name = os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")
    return getattr(signal, "SIG" + name, signal.SIGUSR2)


class TrainJob:
    """Callable that trains one group of SAEs (``train_group``); checkpointable by submitit."""

    def __init__(self, cache_dir: str, runs: list[RunConfig] | list[dict], runs_to: str, device: str | None = None):
        self.cache_dir = os.path.abspath(os.fspath(cache_dir))
        self.runs = [r.to_dict() if isinstance(r, RunConfig) else dict(r) for r in runs]
        self.runs_to = os.path.abspath(os.fspath(runs_to))
        self.device = device
        self._stop = False

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_stop"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._stop = False

    def __repr__(self) -> str:
        return f"TrainJob({self.cache_dir!r}, {len(self.runs)} SAE(s), runs_to={self.runs_to!r})"

    def run_configs(self) -> list[RunConfig]:
        return [RunConfig.from_dict(r) for r in self.runs]

    def __call__(self) -> list[str]:
        from actcache.sae.train import Preempted, train_group

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        sig = _preempt_signal()
        outer = signal.getsignal(sig)  # submitit's checkpoint-and-requeue handler (when under submitit)

        def on_signal(signum, frame):
            log.warning("got %s: checkpointing at the end of this step, then requeueing", signal.Signals(signum).name)
            self._stop = True

        signal.signal(sig, on_signal)
        try:
            return train_group(self.cache_dir, self.run_configs(), self.runs_to, device=self.device,
                               stop=lambda: self._stop)  # fmt: skip
        except Preempted as err:
            log.warning("preempted at step %d: checkpoint written; requeueing", err.step)
            if callable(outer):
                signal.signal(sig, outer)
                outer(sig, None)  # submitit: calls self.checkpoint(), requeues, exits
            raise
        finally:
            if signal.getsignal(sig) is on_signal:
                signal.signal(sig, outer if outer is not None else signal.SIG_DFL)

    def checkpoint(self, *args, **kwargs):
        """submitit calls this on preemption/timeout: requeue a fresh job (state is on disk)."""
        import submitit

        return submitit.helpers.DelayedSubmission(TrainJob(self.cache_dir, self.runs, self.runs_to, self.device))
