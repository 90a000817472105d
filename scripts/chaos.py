"""Chaos trials: killed processes, damaged files, shrinking shards; records BENCHMARKS.md's
Reliability section (one row per trial kind; the target of every row is 0 failures).

    python scripts/chaos.py [--only ROWS] [--trials N] [--work DIR] [--no-record]

Rows (``--only kill-dump,fuzz-cache``; ``--trials`` replaces every row's default count):
  kill-dump (20)       SIGKILL a real `actcache dump` at a random moment, rerun it: byte-identical shards
  kill-train (20)      SIGKILL a deterministic CPU training run, rerun it: identical final weights
  fuzz-cache (300)     damaged metadata.json/shards.json: the CLI, ActivationCache.open, the ordered loader
  fuzz-experiment (250) damaged experiment YAML: `plan` (every 10th also `dump`)
  checkpoint-corrupt (12) a damaged newest checkpoint: resume from the previous one, or one clear error
  loader-shrink (10)   a shard truncated, replaced or made unreadable while the shuffled and the
                       ordered loader read it: a LoaderError or right rows, never a crash or
                       wrong rows (10 trials of each of the 6 combinations)
  verify-corrupt (12)  flipped bytes, zeroed, duplicated, swapped shards: `verify --deep` exits 1
  concurrent-dumps (4) two dumps of overlapping ranges: at most 1.05x the needed shard writes
  damaged-weights (48) a finished run's sae.safetensors flipped, cut, grown, zeroed or swapped:
                       export and SAE.load refuse it in one line (done.json records its sha256)
  concurrent-trains (9) two trains of one run: the second exits 2 within 1 s naming the first, or
                       waits (--wait-for-lock); metrics.jsonl strictly increasing, one done.json
  unbounded-files (7)  7 run files x (/dev/zero, FIFO, oversized, 64 GiB sparse, directory) x 3
                       readers: exit 0 or one line, under 8 GiB of address space
  inplace-rewrite (4)  another shard copied over one, or one cut and re-extended, before or while
                       the shuffled and ordered loaders, ActivationCache and IndexedDataset read a
                       sealed cache with verify_reads: first (16 trials a round): a one-line
                       LoaderError naming the shard, never wrong rows
  bitflip-read (8)     one bit flipped, before or while those four read (8 trials a round): the same
  activation-cache (4) ActivationCache read directly while a shard is truncated, replaced, made
                       unreadable or rewritten in place (8 trials a round): the same, no SIGBUS
  shrink-seal-verify (12) a shard cut or rewritten while `actcache seal` or `verify --deep` reads it:
                       no traceback; seal never records bytes the shard did not hold
A row whose feature is not in this build (``keep_checkpoints``, ``actcache seal``) reports
"not built". Fuzz cases are judged by scripts/fuzzlib.py (no traceback, no hang, exit 1 or 2
with one error line).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, os.path.join(ROOT, "tests")]
import benchlib  # noqa: E402
import fuzzlib  # noqa: E402

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@dataclasses.dataclass
class Row:
    name: str
    trials: int = 0
    failures: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)
    built: bool = True
    seconds: float = 0.0

    def fail(self, what: str) -> None:
        self.failures += 1
        if len(self.notes) < 5:
            self.notes.append(what[:300])


def not_built(name: str, what: str) -> Row:
    return Row(name, built=False, notes=[f"not built: {what}"])


# ---- kill -9 during a dump ---------------------------------------------------------------------


def row_kill_dump(work: str, n: int, rng: random.Random) -> Row:
    from actcache.protocol import SHARDS_FILE, Metadata
    from actcache.writer import gather
    from fixtures_vit import make_checkpoint
    from test_dump import hash_dirs, make_images, shard_files, temp_files, write_experiment
    from test_dump_kill import n_complete, start_dump, wait_for

    row = Row("kill-dump")
    ckpt = make_checkpoint(os.path.join(work, "ckpt"), "clip")
    make_images(os.path.join(work, "imgs"), n=80, seed=1)
    exp = write_experiment(os.path.join(work, "exp.yaml"), ckpt, os.path.join(work, "imgs"), batch_size=2, n_workers=1)
    log = os.path.join(work, "dump.log")
    ref_root = os.path.join(work, "ref")
    if start_dump(exp, ref_root, log).wait(timeout=600) != 0:
        row.fail("the reference dump failed")
        return row
    (ref,) = hash_dirs(ref_root)
    gather(ref)
    ref_shards, md = shard_files(ref), Metadata.load(ref)
    ref_table = Path(ref, SHARDS_FILE).read_text()
    for i in range(n):
        row.trials += 1
        dump_to = os.path.join(work, f"d{i}")
        proc = start_dump(exp, dump_to, log)

        def hdir(dump_to=dump_to):
            dirs = hash_dirs(dump_to)
            return dirs[0] if dirs else None

        moment = rng.choice(["startup", "mid-shard", "after-shards"])
        try:
            if moment == "startup":
                time.sleep(rng.uniform(0.1, 3.0))
            elif moment == "mid-shard":
                wait_for(proc, lambda: hdir() and temp_files(hdir()), timeout=300)
            else:
                target = rng.randint(1, md.n_shards - 1)
                wait_for(proc, lambda target=target: n_complete(hdir(), md) >= target, timeout=300)
        except AssertionError:  # the dump never reached the moment: killed below all the same
            row.notes.append(f"trial {i}: {moment} not reached in 300 s")
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait(timeout=60)
        if rc not in (0, -signal.SIGKILL):
            row.fail(f"trial {i}: the dump exited {rc} before its kill")
            continue
        rerun = start_dump(exp, dump_to, log)
        if rerun.wait(timeout=600) != 0:
            row.fail(f"trial {i} ({moment}): the rerun failed")
            continue
        path = hdir()
        gather(path)
        same = shard_files(path) == ref_shards and Path(path, SHARDS_FILE).read_text() == ref_table
        if not same or temp_files(path):
            row.fail(f"trial {i} ({moment}): shards differ from the uninterrupted dump")
        shutil.rmtree(dump_to, ignore_errors=True)
    return row


# ---- kill -9 during training -------------------------------------------------------------------

TRAIN = {"batch_size": 128, "steps": 120, "width": 64, "log_every": 20, "ckpt_every": 20, "eval_frac": 0.1,
         "dead_tokens": 500, "deterministic": True, "lr": 3e-3, "activation": "topk", "k": 4}  # fmt: skip
TRAIN_SCRIPT = (
    "import sys, json, torch\ntorch.set_num_threads(1)\nfrom actcache.sae.config import RunConfig\n"
    "from actcache.sae.train import train_group\nruns = [RunConfig.from_dict(d) for d in json.loads(sys.argv[3])]\n"
    "train_group(sys.argv[1], runs, sys.argv[2], device='cpu')\n"
)


def _train(cache: str, runs, out: str) -> subprocess.Popen:
    argv = [sys.executable, "-c", TRAIN_SCRIPT, cache, out, json.dumps([r.to_dict() for r in runs])]
    return subprocess.Popen(argv, env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _weights(cache: str, runs, out: str) -> bytes | None:
    from actcache.rundir import WEIGHTS_FILE, run_dir

    path = os.path.join(run_dir(out, os.path.basename(cache), runs[0]), WEIGHTS_FILE)
    return Path(path).read_bytes() if os.path.exists(path) else None


def row_kill_train(work: str, n: int, rng: random.Random) -> Row:
    from actcache.rundir import run_dir
    from actcache.sae import checkpoint as ckpt
    from actcache.sae.config import expand_train_section
    from test_sae_train import dictionary_cache

    row = Row("kill-train")
    cache, _ = dictionary_cache(os.path.join(work, "cache"), n_imgs=200, imgs_per_shard=64)
    runs = expand_train_section(TRAIN, "chaos.yaml")
    ref_out = os.path.join(work, "ref")
    proc = _train(cache, runs, ref_out)
    if proc.wait(timeout=600) != 0:
        row.fail(f"the reference run failed: {proc.stderr.read().decode()[-300:]}")
        return row
    want = _weights(cache, runs, ref_out)
    for i in range(n):
        row.trials += 1
        out = os.path.join(work, f"t{i}")
        d = run_dir(out, os.path.basename(cache), runs[0])
        at = rng.choice([20, 40, 60, 80, 100])
        proc = _train(cache, runs, out)
        deadline = time.monotonic() + 300
        while proc.poll() is None and not any(s >= at for s in ckpt.steps(d)) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.3))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        rerun = _train(cache, runs, out)
        if rerun.wait(timeout=600) != 0:
            row.fail(f"trial {i} (after step {at}): the rerun failed: {rerun.stderr.read().decode()[-200:]}")
        elif _weights(cache, runs, out) != want:
            row.fail(f"trial {i} (after step {at}): final weights differ from the uninterrupted run")
        shutil.rmtree(out, ignore_errors=True)
    return row


# ---- fuzzed files ------------------------------------------------------------------------------


def row_fuzz_cache(work: str, n: int, rng: random.Random) -> Row:
    row = Row("fuzz-cache")
    pristine = fuzzlib.make_cache(os.path.join(work, "pristine"))
    fuzzlib.warm_up(fuzzlib.make_checkpoint_config(os.path.join(work, "ckpt")), pristine, os.path.join(work, "warm"))
    for i in range(n):
        row.trials += 1
        kind, failures = fuzzlib.fuzz_cache_case(pristine, os.path.join(work, "w"), rng, loaders=True)
        for f in failures:
            row.fail(f"case {i} ({kind}): {f}")
    return row


def row_fuzz_experiment(work: str, n: int, rng: random.Random) -> Row:
    row = Row("fuzz-experiment")
    ckpt = fuzzlib.make_checkpoint_config(os.path.join(work, "ckpt"))
    fuzzlib.warm_up(ckpt, None, os.path.join(work, "warm"))
    for i in range(n):
        row.trials += 1
        commands = ("plan", "dump") if i % 10 == 9 else ("plan",)
        kind, failures = fuzzlib.fuzz_experiment_case(ckpt, os.path.join(work, "w"), rng, commands)
        for f in failures:
            row.fail(f"case {i} ({kind}): {f}")
    return row


# ---- rows for features built on other branches (#44 items 1-3, 6) ----------------------------


def _has_key(name: str) -> bool:
    """Whether a config key is declared (the training keys live in actcache.sae.config)."""
    import actcache.keys
    import actcache.sae.config

    return any(name in Path(m.__file__).read_text(encoding="utf-8") for m in (actcache.keys, actcache.sae.config))


def _has_command(name: str) -> bool:
    from actcache.cli import HANDLERS

    return name in HANDLERS


CORRUPTIONS = ("truncate", "flip", "empty", "delete", "garbage-json", "zero")


def _corrupt_file(path: str, how: str, rng: random.Random) -> None:
    with open(path, "rb") as fh:
        data = fh.read()
    if how == "truncate":
        data = data[: rng.randrange(max(1, len(data)))]
    elif how == "flip":
        b = bytearray(data)
        for _ in range(8):
            b[rng.randrange(len(b))] ^= 0xFF
        data = bytes(b)
    elif how == "empty":
        data = b""
    elif how == "zero":
        data = bytes(len(data))
    elif how == "garbage-json":
        data = b'{"step": [' + b"[" * 100
    if how == "delete":
        os.unlink(path)
        return
    with open(path, "wb") as fh:
        fh.write(data)


def row_checkpoint_corrupt(work: str, n: int, rng: random.Random) -> Row:
    if not _has_key("keep_checkpoints"):
        return not_built("checkpoint-corrupt", "keep_checkpoints (issue #44 item 3)")
    from actcache.rundir import run_dir
    from actcache.sae import checkpoint as ckpt
    from actcache.sae.config import expand_train_section
    from test_sae_train import dictionary_cache

    row = Row("checkpoint-corrupt")
    cache, _ = dictionary_cache(os.path.join(work, "cache"), n_imgs=200, imgs_per_shard=64)
    for i in range(n):
        row.trials += 1
        out = os.path.join(work, f"c{i}")
        runs = expand_train_section({**TRAIN, "steps": 60, "keep_checkpoints": 2}, "chaos.yaml")
        d = run_dir(out, os.path.basename(cache), runs[0])
        proc = _train(cache, runs, out)
        deadline = time.monotonic() + 300
        while proc.poll() is None and len(ckpt.steps(d)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        steps = ckpt.steps(d)
        if not steps:
            row.fail(f"trial {i}: no checkpoint before the kill")
            continue
        newest = ckpt.step_dir(d, steps[-1])
        files = sorted(os.path.join(newest, f) for f in os.listdir(newest))
        how = CORRUPTIONS[i % len(CORRUPTIONS)]
        _corrupt_file(rng.choice(files), how, rng)
        rerun = _train(cache, runs, out)
        rc = rerun.wait(timeout=600)
        err = rerun.stderr.read().decode()
        if "Traceback" in err or rc not in (0, 2, 1):
            row.fail(f"trial {i} ({how}): exit {rc}: {err.strip().splitlines()[-1:]!r}")
        shutil.rmtree(out, ignore_errors=True)
    return row


LOADER_SCRIPT = """
import os, sys, time
from actcache.errors import LoaderError
from actcache.loaders import OrderedLoader, ShuffledLoader
path, kind, how = sys.argv[1], sys.argv[2], sys.argv[3]
if kind == "shuffled":
    loader = ShuffledLoader(path, batch_size=64, layer=-2, buffer_bytes=2**20, seed=1, n_epochs=50,
                            batch_timeout_s=20)
else:
    loader = OrderedLoader(path, batch_size=64, layer=-2, batch_timeout_s=20)
bad = 0  # rows no dictionary activation has: all zeros, non-finite or huge (random bytes)
try:
    for i, batch in enumerate(loader):
        x = batch["act"]
        bad += int(((x == 0).all(1) | ~x.isfinite().all(1) | (x.abs() > 1e3).any(1)).sum())
        if i == 3:
            victim = os.path.join(path, "acts000001.bin")
            if how == "truncate":
                os.truncate(victim, 1024)
            elif how == "unreadable":
                os.truncate(victim, 0)
                os.unlink(victim)
            else:
                tmp = victim + ".new"
                with open(tmp, "wb") as fh:
                    fh.write(os.urandom(os.path.getsize(victim)))
                os.replace(tmp, victim)
    print("finished", bad)
except LoaderError as err:
    print("LoaderError", str(err).splitlines()[0])
"""


def fresh_copy(pristine: str, work: str) -> str:
    """A new copy of the cache ``pristine`` under work/c/ (its hash name kept) for one trial."""
    path = os.path.join(work, "c", os.path.basename(pristine))
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    shutil.copytree(pristine, path)
    return path


def row_loader_shrink(work: str, n: int, rng: random.Random) -> Row:
    from test_sae_train import dictionary_cache

    row = Row("loader-shrink")
    pristine, _ = dictionary_cache(os.path.join(work, "pristine"), n_imgs=400, imgs_per_shard=64)
    for _ in range(n):
        for kind in ("shuffled", "ordered"):
            for how in ("truncate", "replace", "unreadable"):
                row.trials += 1
                path = fresh_copy(pristine, work)
                try:
                    proc = subprocess.run([sys.executable, "-c", LOADER_SCRIPT, path, kind, how], env=ENV, cwd=ROOT,
                                          capture_output=True, text=True, timeout=120)  # fmt: skip
                except subprocess.TimeoutExpired:
                    row.fail(f"{kind}/{how}: hang")
                    continue
                if proc.returncode != 0 or "Traceback" in proc.stderr:
                    row.fail(f"{kind}/{how}: exit {proc.returncode} {proc.stderr.strip().splitlines()[-1:]!r}")
                elif proc.stdout.startswith("finished") and proc.stdout.split()[1] != "0":
                    row.fail(f"{kind}/{how}: {proc.stdout.split()[1]} wrong rows delivered without a LoaderError")
    return row


def row_verify_corrupt(work: str, n: int, rng: random.Random) -> Row:
    if not _has_command("seal"):
        return not_built("verify-corrupt", "per-shard checksums and `actcache seal` (issue #44 item 1)")
    from test_sae_train import dictionary_cache

    row = Row("verify-corrupt")
    pristine, _ = dictionary_cache(os.path.join(work, "pristine"), n_imgs=256, imgs_per_shard=64)
    rc, _, err = fuzzlib.run_cli(["seal", pristine])
    if rc != 0:
        row.fail(f"seal failed: {err.strip()}")
        return row
    kinds = ("flip", "zero", "duplicate", "swap", "symlink")
    for i in range(n):
        how = kinds[i % len(kinds)]
        row.trials += 1
        path = fresh_copy(pristine, work)
        a, b = (os.path.join(path, f"acts{j:06d}.bin") for j in rng.sample(range(4), 2))
        if how in ("flip", "zero"):
            _corrupt_file(a, how, rng)
        elif how == "duplicate":
            shutil.copyfile(b, a)
        elif how == "swap":
            os.rename(a, a + ".x")
            os.rename(b, a)
            os.rename(a + ".x", b)
        else:
            os.unlink(a)
            os.symlink(os.path.basename(b), a)
        rc, out, err = fuzzlib.run_cli(["verify", "--deep", path])
        if rc != 1:
            row.fail(f"{how}: verify --deep exited {rc}")
    return row


def row_concurrent_dumps(work: str, n: int, rng: random.Random) -> Row:
    if not _has_command("seal"):
        return not_built("concurrent-dumps", "per-shard dump locks (issue #44 item 6)")
    from fixtures_vit import make_checkpoint
    from test_dump import IMGS_PER_SHARD, make_images, write_experiment

    row = Row("concurrent-dumps")
    ckpt = make_checkpoint(os.path.join(work, "ckpt"), "clip")
    make_images(os.path.join(work, "imgs"), n=80, seed=1)
    exp = write_experiment(os.path.join(work, "exp.yaml"), ckpt, os.path.join(work, "imgs"), batch_size=2, n_workers=1)
    writes = needed = 0
    for i in range(n):
        row.trials += 1
        dump_to = os.path.join(work, f"d{i}")
        logs = [os.path.join(work, f"dump{i}-{j}.log") for j in range(2)]
        n_shards = -(-80 // IMGS_PER_SHARD)
        ranges = [f"0:{n_shards * 3 // 4}", f"{n_shards // 4}:{n_shards}"]
        procs = []
        for log, shards in zip(logs, ranges, strict=True):
            with open(log, "wb") as fh:
                argv = [sys.executable, "-m", "actcache.cli", "dump", "--experiment", exp, "--dump-to", dump_to,
                        "--shards", shards, "--no-progress"]  # fmt: skip
                procs.append(subprocess.Popen(argv, stdout=fh, stderr=fh, env=ENV, cwd=ROOT))
        if any(p.wait(timeout=600) != 0 for p in procs):
            row.fail(f"trial {i}: a dump failed")
            continue
        writes += sum(Path(log).read_text().count(" wrote acts") for log in logs)
        needed += n_shards
    ratio = writes / needed if needed else 0.0
    row.notes.append(f"{writes} shard writes for {needed} needed ({ratio:.3f}x)")
    if ratio > 1.05:
        row.fail(f"{ratio:.3f}x the needed shard writes")
    return row


# ---- the run directory: final weights, one owner, bounded files (issue #55 items 4-6) ---------

RUN_TRAIN = {"layer": 7, "batch_size": 16, "steps": 4, "log_every": 2, "ckpt_every": 2, "eval_frac": 0.2,
             "b_dec_init": "mean", "buffer_bytes": 20000, "saes": [{"activation": "topk", "width": 12, "k": 3}]}  # fmt: skip


def _tiny_run(work: str, train: dict) -> tuple[str, str, str]:
    """(cache, train file, run directory) of one tiny SAE trained here on a random cache."""
    import yaml

    from actcache.sae.on_cache import train_on_cache
    from conftest import make_cache

    cache, _, _ = make_cache(os.path.join(work, "cache"), n_imgs=40, layers=(7,), n_patches=4, d=8, imgs_per_shard=10)
    train_file = os.path.join(work, "train.yaml")
    Path(train_file).write_text(yaml.safe_dump({"train": train}))
    (d,) = train_on_cache(cache, train_file, runs_to=os.path.join(work, "runs"))
    return cache, train_file, d


def _cli(argv: list[str]) -> tuple[int | str, str]:
    """`actcache ARGV` in this process: (exit status, or "traceback: ..." for an uncaught exception; stderr)."""
    import contextlib
    import io
    import logging

    from actcache import cli

    err = io.StringIO()
    root = logging.getLogger()
    handlers = root.handlers[:]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc: int | str = cli.main(argv)
    except BaseException as e:  # noqa: BLE001 - judged: a traceback is a failure
        rc = f"traceback: {type(e).__name__}: {e}"
    finally:
        root.handlers[:] = handlers
    return rc, err.getvalue()


WEIGHT_DAMAGE = ("flip-data", "flip-header", "truncate", "append", "zero-tail", "swap")


def _damage_weights(path: str, how: str, rng: random.Random, other: bytes) -> None:
    data = bytearray(Path(path).read_bytes())
    hlen = 8 + int.from_bytes(data[:8], "little")
    if how == "flip-data":
        data[rng.randrange(hlen, len(data))] ^= 1 << rng.randrange(8)
    elif how == "flip-header":
        data[rng.randrange(0, hlen)] ^= 1 << rng.randrange(8)
    elif how == "truncate":
        del data[rng.randrange(len(data)) :]
    elif how == "append":
        data += os.urandom(rng.randrange(1, 64))
    elif how == "zero-tail":
        at = rng.randrange(hlen, len(data))
        data[at:] = bytes(len(data) - at)
    else:  # another SAE's weights of the same shape
        data = bytearray(other)
    Path(path).write_bytes(bytes(data))


def row_damaged_weights(work: str, n: int, rng: random.Random) -> Row:
    """A finished run's sae.safetensors damaged: `export` and SAE.load (what eval and visuals call)
    exit 2 / raise one line naming the file. With done.json's record every damage is caught; a run
    without it (an older actcache) is only held to no traceback (a flipped weight passes there)."""
    from actcache.errors import ActCacheError
    from actcache.rundir import DONE_FILE, WEIGHTS_FILE
    from actcache.sae.modeling import SAE

    row = Row("damaged-weights")
    _, _, d = _tiny_run(os.path.join(work, "a"), RUN_TRAIN)
    _, _, other = _tiny_run(os.path.join(work, "b"), {**RUN_TRAIN, "data_seed": 1})
    other_bytes = Path(other, WEIGHTS_FILE).read_bytes()
    for i in range(n):
        row.trials += 1
        how, recorded = WEIGHT_DAMAGE[i % len(WEIGHT_DAMAGE)], i % 4 != 3
        t = os.path.join(work, f"t{i}")
        shutil.copytree(d, t, ignore=shutil.ignore_patterns("checkpoints"))
        if not recorded:
            done = json.loads(Path(t, DONE_FILE).read_text())
            done.pop("files")
            Path(t, DONE_FILE).write_text(json.dumps(done))
        _damage_weights(os.path.join(t, WEIGHTS_FILE), how, rng, other_bytes)
        rc, err = _cli(["export", t, "--to", "saelens", os.path.join(t, "out")])
        try:
            SAE.load(t)
            loaded = None
        except ActCacheError as e:
            loaded = str(e)
        except Exception as e:  # noqa: BLE001 - judged
            row.fail(f"trial {i} ({how}): SAE.load: traceback {type(e).__name__}: {e}")
            continue
        lines = [ln for ln in err.splitlines() if "error:" in ln]
        if isinstance(rc, str) or rc not in (0, 2) or (rc == 2 and len(lines) != 1):
            row.fail(f"trial {i} ({how}, recorded={recorded}): export exit {rc}: {err[-200:]!r}")
        elif recorded and (rc != 2 or WEIGHTS_FILE not in lines[0] or loaded is None or WEIGHTS_FILE not in loaded):
            row.fail(f"trial {i} ({how}): damaged weights not refused (export exit {rc}, load {loaded!r})")
        shutil.rmtree(t, ignore_errors=True)
    return row


TRAIN_CLI = "import sys; from actcache.cli import main; sys.exit(main(sys.argv[1:]))"


def _train_cli(cache: str, train_file: str, runs_to: str, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-c", TRAIN_CLI, "train", "--cache", cache, "--train", train_file, "--runs-to", runs_to,
            "--device", "cpu", *extra]  # fmt: skip
    return subprocess.Popen(argv, env={**ENV, "OMP_NUM_THREADS": "1"}, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def row_concurrent_trains(work: str, n: int, rng: random.Random) -> Row:
    """Two trains of one run. "later": a second train (in this process, timed) while a first one
    (a process) owns the run: exit 2 within 1 s naming the first's host and pid. "race": both
    started together: one trains (exit 0), the other exits 2. "wait": the second with
    --wait-for-lock waits, then finds the run done (exit 0). Always: one done.json, metrics.jsonl
    steps strictly increasing."""
    import socket

    import yaml

    from actcache.rundir import DONE_FILE, LOCK_FILE, read_metrics, run_dir
    from actcache.sae.config import expand_train_section

    row = Row("concurrent-trains")
    long = {**RUN_TRAIN, "steps": 3000, "log_every": 100, "ckpt_every": 1000}
    cache, train_file, _ = _tiny_run(os.path.join(work, "base"), RUN_TRAIN)
    Path(train_file).write_text(yaml.safe_dump({"train": long}))
    (run,) = expand_train_section(long, train_file, layers=(7,), d_vit=8)
    waits = []
    for i in range(n):
        row.trials += 1
        kind = ("later", "race", "wait")[i % 3]
        runs_to = os.path.join(work, f"t{i}")
        d = run_dir(runs_to, os.path.basename(cache), run)
        first = _train_cli(cache, train_file, runs_to)
        second = _train_cli(cache, train_file, runs_to) if kind == "race" else None
        if kind != "race":  # the first owns the run before the second starts
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and first.poll() is None:
                lock = Path(d, LOCK_FILE)
                if lock.exists() and lock.read_text().split()[1:] == [str(first.pid)]:
                    break
                time.sleep(0.02)
        if kind == "wait":
            second = _train_cli(cache, train_file, runs_to, "--wait-for-lock")
        note = ""
        if kind == "later":
            t0 = time.monotonic()
            rc, err = _cli(["train", "--cache", cache, "--train", train_file, "--runs-to", runs_to, "--device", "cpu"])
            dt = time.monotonic() - t0
            waits.append(dt)
            if first.poll() is not None:
                note = "the first train ended before the second started; "
            want = f"host {socket.gethostname()}, pid {first.pid}"
            if rc != 2 or want not in err or dt > 1.0:
                row.fail(f"trial {i} (later): {note}exit {rc} after {dt:.2f} s: {err.strip()[-200:]!r}")
        procs = [first] + ([second] if second is not None else [])
        errs = [p.communicate(timeout=600)[1] for p in procs]
        rcs = [p.returncode for p in procs]
        if any("Traceback" in e for e in errs):
            row.fail(f"trial {i} ({kind}): a traceback: {[e[-200:] for e in errs]!r}")
        elif kind == "race" and sorted(rcs) != [0, 2]:
            row.fail(f"trial {i} (race): exits {rcs}, want one 0 and one 2: {[e[-150:] for e in errs]!r}")
        elif kind != "race" and any(rc != 0 for rc in rcs):
            row.fail(f"trial {i} ({kind}): exits {rcs}: {[e[-150:] for e in errs]!r}")
        steps = [m["step"] for m in read_metrics(d)]
        if steps != sorted(set(steps)) or steps[-1:] != [long["steps"]] or not os.path.exists(os.path.join(d, DONE_FILE)):
            row.fail(f"trial {i} ({kind}): metrics.jsonl steps {steps[:8]}... not strictly increasing to the end")
        shutil.rmtree(runs_to, ignore_errors=True)
    if waits:
        row.notes.append(f"the second train exited after {max(waits):.2f} s at most (median "
                         f"{sorted(waits)[len(waits) // 2]:.2f} s, n={len(waits)})")  # fmt: skip
    return row


UNBOUNDED_SCRIPT = r"""
import contextlib, io, json, os, resource, shutil, sys, traceback
resource.setrlimit(resource.RLIMIT_AS, (8 * 2**30, 8 * 2**30))
from actcache import cli
from actcache.errors import ActCacheError
from actcache.rundir import load_run, read_metrics
from actcache.sae.modeling import SAE
pristine, work, name = sys.argv[1], sys.argv[2], sys.argv[3]
out = []
for how in ("dev-zero", "fifo", "oversized", "sparse-64g", "directory"):
    t = os.path.join(work, f"{name}-{how}")
    shutil.copytree(pristine, t, ignore=shutil.ignore_patterns("checkpoints"))
    p = os.path.join(t, name)
    os.remove(p)
    if how == "dev-zero":
        os.symlink("/dev/zero", p)
    elif how == "fifo":
        os.mkfifo(p)
    elif how == "oversized":
        with open(p, "wb") as fh:
            fh.write(b"[" * (600 * 2**20) if name.endswith(".jsonl") else b"[" * (20 * 2**20))
    elif how == "sparse-64g":
        with open(p, "wb") as fh:
            fh.truncate(64 * 2**30)
    else:
        os.mkdir(p)
    for cmd in (["visuals", t, "--plots-only"], ["export", t, "--to", "saelens", os.path.join(t, "out")], "library"):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                if cmd == "library":
                    run = load_run(t)
                    run.name, run.eval(), run.sae_config(), read_metrics(t)
                    SAE.load(t)
                    rc = 0
                else:
                    rc = cli.main(cmd)
        except ActCacheError as e:
            rc, msg = 2, str(e)
            err.write(f"error: {msg}\n")
        except BaseException as e:
            rc = "traceback: " + "".join(traceback.format_exception_only(e)).strip()[-200:]
        out.append({"how": how, "cmd": cmd if isinstance(cmd, str) else cmd[0], "rc": rc,
                    "err": [ln for ln in err.getvalue().splitlines() if "error:" in ln]})
        shutil.rmtree(os.path.join(t, "out"), ignore_errors=True)
    shutil.rmtree(t, ignore_errors=True)
print(json.dumps(out))
"""


def row_unbounded_files(work: str, n: int, rng: random.Random) -> Row:
    """Each run file replaced by a symlink to /dev/zero, a FIFO, an oversized file, a 64 GiB sparse
    file or a directory, read by `visuals --plots-only`, `export` and the library (load_run, Run.eval,
    read_metrics, SAE.load) in a process limited to 8 GiB of address space and 120 s: exit 0 (not
    read) or one error line naming the file; never a traceback, a hang or unbounded memory.
    ``n`` files (of 7) x 5 damages x 3 readers trials."""
    from actcache.rundir import CONFIG_FILE, DONE_FILE, EVAL_FILE, METRICS_FILE, RUN_FILE, WEIGHTS_FILE

    row = Row("unbounded-files")
    _, _, d = _tiny_run(os.path.join(work, "a"), RUN_TRAIN)
    names = [RUN_FILE, DONE_FILE, EVAL_FILE, CONFIG_FILE, METRICS_FILE, WEIGHTS_FILE, "visuals/summary.json"]
    os.makedirs(os.path.join(d, "visuals"), exist_ok=True)
    Path(d, "visuals", "summary.json").write_text("{}")
    for name in names[: max(1, n)]:
        try:
            proc = subprocess.run([sys.executable, "-c", UNBOUNDED_SCRIPT, d, work, name], env=ENV, cwd=ROOT,
                                  capture_output=True, text=True, timeout=600)  # fmt: skip
            results = json.loads(proc.stdout.strip().splitlines()[-1])
        except subprocess.TimeoutExpired:
            row.trials += 15
            row.fail(f"{name}: the readers hung (600 s)")
            continue
        except (ValueError, IndexError):
            row.trials += 15
            row.fail(f"{name}: the reader process ended with {proc.returncode}: {proc.stderr[-300:]!r}")
            continue
        for r in results:
            row.trials += 1
            what = f"{name} as {r['how']}, {r['cmd']}"
            shown = os.path.basename(name)
            if isinstance(r["rc"], str) or r["rc"] not in (0, 2):
                row.fail(f"{what}: {r['rc']}")
            elif r["rc"] == 2 and (len(r["err"]) != 1 or shown not in r["err"][0]):
                row.fail(f"{what}: exit 2 without one line naming {shown}: {r['err'][:2]!r}")
    return row


# ---- rewrites in place, bit flips, direct ActivationCache damage (shardguard.py) ---------------


def _guard_cache(work: str) -> str:
    """A sealed cache of 6 shards (the writer records each shard's block digests)."""
    from conftest import make_cache

    path, _, _ = make_cache(os.path.join(work, "pristine"), n_imgs=24, layers=(3,), n_patches=16, d=256,
                            imgs_per_shard=4)  # fmt: skip
    return path


def _judge_reads(row: Row, trials: list[tuple], work: str, rng: random.Random) -> Row:
    """Run reader trials (loaders/faults.py) with verify_reads: first; a failure is anything but a
    one-line LoaderError naming the damaged shard, or every row equal to the undamaged read."""
    from actcache.loaders.faults import run_trials

    path = _guard_cache(work)
    results = run_trials(path, trials, os.path.join(work, "t"), timeout_s=60 + 5 * len(trials),
                         verify_reads="first", seed=rng.randrange(2**30))  # fmt: skip
    for r in results:
        row.trials += 1
        what = f"{r['loader']}/{r['damage']}/{r.get('when', 'during')}"
        if r["rc"] != 0 or r["outcome"] not in ("LoaderError", "finished"):
            row.fail(f"{what}: {r['outcome']} (rc {r['rc']}) {r['message'][:200]!r}")
        elif r["outcome"] == "LoaderError" and (r["shard"] not in r["message"] or "\n" in r["message"]):
            row.fail(f"{what}: the error does not name {r['shard']} in one line: {r['message'][:200]!r}")
    if not row.failures:
        n_err = sum(r["outcome"] == "LoaderError" for r in results)
        row.notes.append(f"{n_err} LoaderError, {len(results) - n_err} finished with the right rows")
    return row


def row_inplace_rewrite(work: str, n: int, rng: random.Random) -> Row:
    from actcache.loaders.faults import READERS

    trials = [(k, d, w) for _ in range(n) for k in READERS for d in ("rewrite", "regrow") for w in ("before", "during")]
    return _judge_reads(Row("inplace-rewrite"), trials, work, rng)


def row_bitflip_read(work: str, n: int, rng: random.Random) -> Row:
    from actcache.loaders.faults import READERS

    trials = [(k, "flip", w) for _ in range(n) for k in READERS for w in ("before", "during")]
    return _judge_reads(Row("bitflip-read"), trials, work, rng)


def row_activation_cache(work: str, n: int, rng: random.Random) -> Row:
    from actcache.loaders.faults import DAMAGES, REWRITES

    trials = [("cache", d, "during") for _ in range(n) for d in (*DAMAGES, *REWRITES)]
    trials += [("cache", d, "before") for _ in range(n) for d in ("rewrite", "flip")]
    return _judge_reads(Row("activation-cache"), trials, work, rng)


def _open_shards(pid: int, path: str) -> list[str]:
    """Shard files of ``path`` the process ``pid`` has open now."""
    out = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if os.path.dirname(target) == path and os.path.basename(target).startswith("acts"):
                    out.append(os.path.basename(target))
    except OSError:
        pass
    return out


def row_shrink_seal_verify(work: str, n: int, rng: random.Random) -> Row:
    """`seal` (records removed first) or `verify --deep` on a cache of 8 shards of 24 MiB; once
    the scan has a shard open, that shard (or, every other trial, a random one) is cut to a third
    or rewritten in place. A failure: a traceback, an exit status other than 0/1 (verify) or
    0/1/2 (seal), or a record seal wrote that differs from the one the dump wrote (a short or
    changed read recorded). (An exit 0 is no failure by itself: the damage may land after the
    scan of that shard; tests/test_shardguard.py damages it mid-scan deterministically.)"""
    from actcache import checksums
    from actcache.loaders.faults import damage_shard
    from conftest import make_cache

    row = Row("shrink-seal-verify")
    pristine, _, _ = make_cache(os.path.join(work, "pristine"), n_imgs=160, layers=(3,), n_patches=195, d=1536,
                                imgs_per_shard=20)  # fmt: skip
    names = sorted(f for f in os.listdir(pristine) if f.startswith("acts"))
    want = {m: checksums.read_record(checksums.record_dir(pristine), m) for m in names}
    code = "import sys; from actcache.cli import main; sys.exit(main(sys.argv[1:]))"
    for i in range(n):
        cmd, how = ("seal", "verify")[i % 2], ("truncate", "rewrite")[(i // 2) % 2]
        row.trials += 1
        path = os.path.realpath(fresh_copy(pristine, work))
        if cmd == "seal":
            shutil.rmtree(checksums.record_dir(path))
        argv = [sys.executable, "-c", code, cmd, path] + (["--deep"] if cmd == "verify" else [])
        proc = subprocess.Popen(argv, env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        scanning: list[str] = []
        while proc.poll() is None and not scanning:
            scanning = _open_shards(proc.pid, path)
            time.sleep(0.001)
        victim = scanning[0] if scanning and i % 4 < 2 else rng.choice(names)
        damage_shard(os.path.join(path, victim), how, seed=rng.randrange(2**30))
        out, err = proc.communicate(timeout=300)
        text = (out + err).decode(errors="replace")
        if "Traceback" in text or proc.returncode not in ((0, 1, 2) if cmd == "seal" else (0, 1)):
            row.fail(f"{cmd}/{how}: exit {proc.returncode} {text.strip().splitlines()[-1:]!r}")
            continue
        if cmd == "seal" and os.path.isdir(checksums.record_dir(path)):
            for m in names:
                got = checksums.read_record(checksums.record_dir(path), m)
                if got is not None and got.digest != want[m].digest:
                    row.fail(f"seal/{how}: recorded {m} as {got.digest}, the dump wrote {want[m].digest}")
    return row


ROWS = {
    "kill-dump": (row_kill_dump, 20, "kill -9 during dump, rerun: byte-identical"),
    "kill-train": (row_kill_train, 20, "kill -9 during train, rerun: identical weights"),
    "fuzz-cache": (row_fuzz_cache, 300, "fuzzed metadata.json/shards.json: 0 tracebacks, 0 hangs"),
    "fuzz-experiment": (row_fuzz_experiment, 250, "fuzzed experiment YAML: 0 tracebacks, 0 hangs"),
    "checkpoint-corrupt": (row_checkpoint_corrupt, 12, "corrupt newest checkpoint: resume or one clear error"),
    "loader-shrink": (
        row_loader_shrink,
        10,
        "shard truncated/replaced/unreadable while loading: LoaderError, no crash, no wrong rows",
    ),
    "verify-corrupt": (row_verify_corrupt, 12, "flipped/zeroed/duplicated/swapped shards: verify --deep fails"),
    "concurrent-dumps": (row_concurrent_dumps, 4, "overlapping concurrent dumps: <= 1.05x shard writes"),
    "damaged-weights": (row_damaged_weights, 48, "damaged final sae.safetensors: export/load exit 2 naming it"),
    "concurrent-trains": (row_concurrent_trains, 9, "two trains of one run: one owner, exit 2 in <= 1 s, monotonic metrics"),
    "unbounded-files": (row_unbounded_files, 7, "run files as /dev/zero, FIFO, oversized, sparse, directory: one line"),
    "inplace-rewrite": (
        row_inplace_rewrite,
        4,
        "shard copied over / cut and re-extended, before or while read (4 readers): error, no wrong rows",
    ),
    "bitflip-read": (row_bitflip_read, 8, "bit flipped before or while read, verify_reads first: error, no wrong rows"),
    "activation-cache": (row_activation_cache, 4, "ActivationCache read while a shard is damaged: error, no SIGBUS"),
    "shrink-seal-verify": (
        row_shrink_seal_verify,
        12,
        "shard cut/rewritten during seal or verify --deep: no false record",
    ),
}


def run(only: list[str], trials: int | None, work: str, seed: int = 44) -> list[Row]:
    out = []
    for name in only:
        fn, default, _ = ROWS[name]
        sub = os.path.join(work, name)
        os.makedirs(sub, exist_ok=True)
        t0 = time.monotonic()
        row = fn(sub, trials if trials is not None else default, random.Random(f"{seed}-{name}"))
        row.seconds = time.monotonic() - t0
        out.append(row)
        status = "not built" if not row.built else f"{row.failures} failures in {row.trials} trials"
        print(f"{name:20s} {status} ({row.seconds:.0f} s) {'; '.join(row.notes)}", flush=True)
    return out


def record(rows: list[Row], path: str = benchlib.BENCH_MD) -> None:
    table = benchlib.table(
        [
            {
                "trial kind": r.name,
                "what": ROWS[r.name][2],
                "trials": r.trials if r.built else "not built",
                "failures": r.failures if r.built else "-",
                "seconds": round(r.seconds),
                "notes": "; ".join(r.notes) or "-",
            }
            for r in rows
        ]  # fmt: skip
    )
    checks = [
        benchlib.Check(
            f"{r.name}: 0 failures",
            f"{r.failures} of {r.trials}" if r.built else "not built",
            (r.failures == 0) if r.built else None,
        )  # fmt: skip
        for r in rows
    ]
    setup = [
        "each row: real processes and files on this machine (scripts/fuzzlib.py damages the files)",
        "a failure: a traceback, a hang, a wrong exit status, bytes that differ from the uninterrupted run",
    ]
    built = [r for r in rows if r.built]
    conclusions = [f"{sum(r.failures == 0 for r in built)} of {len(built)} rows run have 0 failures "
                   f"({sum(r.trials for r in built)} trials)"]  # fmt: skip
    conclusions += [c.bullet() for c in checks if c.met is False][:3]
    missing = [r.name for r in rows if not r.built]
    if missing:
        conclusions.append(f"not built on this branch: {', '.join(missing)}")
    body = benchlib.section_body(setup, [table], conclusions)
    benchlib.record("reliability", "Reliability (chaos trials)", body, path=path, checks=checks)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(ROWS), help="comma-separated rows (default: all)")
    p.add_argument("--trials", type=int, default=None, help="trials per row (default: each row's own)")
    p.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    p.add_argument("--no-record", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    only = [r.strip() for r in args.only.split(",") if r.strip()]
    unknown = [r for r in only if r not in ROWS]
    if unknown:
        p.error(f"unknown row(s) {unknown}; rows: {', '.join(ROWS)}")
    work = args.work or tempfile.mkdtemp(prefix="chaos-")
    try:
        rows = run(only, args.trials, work)
    finally:
        if args.work is None:
            fuzzlib._unblock(work)
    if not args.no_record:
        record(rows)
    return 1 if any(r.failures for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
