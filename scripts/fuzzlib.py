"""Fuzzed inputs for scripts/chaos.py and tests/test_fuzz_inputs.py: a small real cache and a
small real experiment, ways to damage their files, and a judge of what the CLI did with them.

A case is judged in process (``actcache.cli.main``): an exception that escapes main is a
traceback; a case that takes longer than ``HANG_S`` is a hang (SIGALRM); exit status 2 must come
with exactly one error line on stderr, and the status must be 0, 1 or 2. ``ActivationCache.open``
and the loaders must raise only ActCacheError.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import shutil
import signal

import numpy as np

from actcache.errors import ActCacheError
from actcache.protocol import Metadata
from actcache.writer import write_cache_from_array

HANG_S = 20.0
LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d (DEBUG|INFO|WARNING) ")  # the CLI's log format; not an error line
CACHE_COMMANDS = (["hash", "{dir}/metadata.json"], ["inspect", "{dir}"], ["inspect", "--json", "{dir}"],
                  ["verify", "{dir}"], ["verify", "--deep", "{dir}"], ["gather", "{dir}"])  # fmt: skip


class Hang(BaseException):
    """Raised by SIGALRM inside a case that ran past HANG_S."""


def _alarm(signum, frame):
    raise Hang()


@contextlib.contextmanager
def alarm(seconds: float = HANG_S):
    """Raise Hang in the block once it has run ``seconds`` (the main thread only)."""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_cli(argv: list[str], hang_s: float = HANG_S) -> tuple[int | None, str, str]:
    """(exit status, stdout, stderr) of ``actcache.cli.main(argv)`` in this process; the status is
    None when an exception escaped (its type and text are in stderr, after "Traceback: ")."""
    from actcache.cli import main

    out, err = io.StringIO(), io.StringIO()
    try:
        with alarm(hang_s), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as exc:
                rc = exc.code if isinstance(exc.code, int) else 2
    except Hang:
        return None, out.getvalue(), f"Hang: more than {hang_s:.0f} s"
    except Exception as exc:  # what a user would see as a traceback
        return None, out.getvalue(), f"Traceback: {type(exc).__name__}: {exc}"
    return rc, out.getvalue(), err.getvalue()


def judge(argv: list[str], rc: int | None, stderr: str) -> str | None:
    """None when the command behaved; else one line saying what went wrong."""
    cmd = " ".join(argv[:2])
    if rc is None:
        return f"{cmd}: {stderr.splitlines()[0] if stderr else 'no output'}"
    if rc not in (0, 1, 2):
        return f"{cmd}: exit status {rc}"
    errors = [
        ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("warning:") and not LOG_LINE.match(ln)
    ]
    if "Traceback" in stderr:
        return f"{cmd}: a traceback on stderr"
    if rc == 2 and len(errors) != 1:
        return f"{cmd}: exit 2 with {len(errors)} error lines: {errors[:3]!r}"
    return None


# ---- a small cache and ways to damage its JSON files -------------------------------------------


def make_cache(root: str) -> str:
    """A 3-shard cache of random activations (7 images, 2 layers, 5 tokens, d=4); returns its dir."""
    md = Metadata(vit_family="clip", vit_ckpt="fuzz/ckpt", layers=(3, 7), n_patches_per_img=4, cls_token=True,
                  d_vit=4, n_imgs=7, max_patches_per_shard=3 * 5 * 2, data={"__class__": "Fuzz", "seed": 0})  # fmt: skip
    acts = np.random.default_rng(0).standard_normal((7, 2, 5, 4), dtype=np.float32)
    return write_cache_from_array(root, md, acts)


def random_json(rng: random.Random, depth: int = 0) -> object:
    """A random JSON value: mostly small, sometimes odd (huge numbers, NUL, long strings)."""
    pick = rng.random()
    if depth > 3 or pick < 0.45:
        return rng.choice([None, True, False, 0, -1, 1, 2**63, 10**400 if rng.random() < 0.05 else 7, 1.5, -0.0,
                           float("nan"), "", "a", "x" * 300, "\x00", "../metadata.json", "acts000000.bin",
                           "\udcff"[:0] + "é", "/" * 2000])  # fmt: skip
    if pick < 0.7:
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    keys = ["name", "n_imgs", "layers", "d_vit", "data", "protocol", "vit_family", rng.choice(["k", "", "\x00"])]
    return {rng.choice(keys): random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def _deep(n: int, lists: bool = True) -> str:
    return ("[" * n + "]" * n) if lists else ('{"a":' * n + "1" + "}" * n)


def _set_field(doc: object, rng: random.Random) -> object:
    """A copy of a parsed document with one field (or shard entry field) replaced."""
    if isinstance(doc, dict) and doc:
        k = rng.choice(sorted(doc))
        doc = {**doc, k: random_json(rng, 2)}
    elif isinstance(doc, list) and doc:
        i = rng.randrange(len(doc))
        entry = doc[i]
        if isinstance(entry, dict) and entry and rng.random() < 0.8:
            k = rng.choice(sorted(entry))
            doc = [*doc[:i], {**entry, k: random_json(rng, 2)}, *doc[i + 1 :]]
        else:
            doc = [*doc[:i], random_json(rng, 1), *doc[i + 1 :]]
    return doc


def _write(path: str, data: bytes) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    with open(path, "wb") as fh:
        fh.write(data)


def _replace_node(path: str, make) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    make(path)


def damage_json_file(path: str, rng: random.Random) -> str:
    """Damage one JSON file in one of many ways; returns the way's name."""
    with open(path, "rb") as fh:
        raw = fh.read()
    kind = rng.choice(JSON_DAMAGE)
    if kind == "field":
        doc = json.loads(raw)
        for _ in range(rng.randint(1, 3)):
            doc = _set_field(doc, rng)
        _write(path, json.dumps(doc).encode())
    elif kind == "random-doc":
        _write(path, json.dumps(random_json(rng)).encode())
    elif kind == "truncate":
        _write(path, raw[: rng.randrange(len(raw))])
    elif kind == "flip-bytes":
        b = bytearray(raw)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        _write(path, bytes(b))
    elif kind == "latin1":
        _write(path, raw.replace(b"}", ' "caf\xe9": 1}'.encode("latin-1"), 1).replace(b"]", b"]", 1))
    elif kind == "deep":
        _write(path, _deep(rng.choice([65, 1000, 100_000]), lists=rng.random() < 0.5).encode())
    elif kind == "huge-int":
        _write(path, b'{"n_imgs": ' + b"9" * rng.choice([5000, 50_000]) + b"}")
    elif kind == "big-file":
        _write(path, b"[" + b"0," * (9 * 2**20) + b"0]")
    elif kind == "empty":
        _write(path, b"")
    elif kind == "symlink-loop":
        _replace_node(path, lambda p: os.symlink(os.path.basename(p), p))
    elif kind == "dangling-symlink":
        _replace_node(path, lambda p: os.symlink("nowhere/at/all.json", p))
    elif kind == "directory":
        _replace_node(path, os.mkdir)
    elif kind == "fifo":
        _replace_node(path, os.mkfifo)
    elif kind == "unreadable":
        os.chmod(path, 0)
    elif kind == "long-name":
        doc = json.loads(raw)
        if isinstance(doc, list) and doc:
            doc[rng.randrange(len(doc))]["name"] = rng.choice(["a" * 300, "a/" * 3000, "x\x00y", "../metadata.json",
                                                                "/etc/passwd", "acts000000.bin/.."])  # fmt: skip
        else:
            doc["vit_ckpt"] = "a" * 5000
        _write(path, json.dumps(doc).encode())
    return kind


JSON_DAMAGE = ("field", "field", "field", "random-doc", "truncate", "flip-bytes", "latin1", "deep", "huge-int",
               "big-file", "empty", "symlink-loop", "dangling-symlink", "directory", "fifo", "unreadable",
               "long-name")  # fmt: skip


def rehash(cache_dir: str) -> str:
    """When the damaged metadata.json still parses, move the cache to its new hash (so that the
    commands look past the hash check); returns the cache's directory."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with alarm():
                digest = Metadata.load(cache_dir).hash
        except (Exception, Hang):  # the readers' own verdict is what check_cache judges
            return cache_dir
    new = os.path.join(os.path.dirname(cache_dir), digest)
    if new != cache_dir:
        os.rename(cache_dir, new)
    return new


def check_cache(cache_dir: str, loaders: bool = True) -> list[str]:
    """Every command, ActivationCache.open and the loaders on a (damaged) cache; the failures."""
    import warnings

    failures = []
    for cmd in CACHE_COMMANDS:
        argv = [a.format(dir=cache_dir) for a in cmd]
        rc, _, err = run_cli(argv)
        bad = judge(argv, rc, err)
        if bad:
            failures.append(bad)
    if loaders:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            failures += _check_library(cache_dir)
    return failures


def _check_library(cache_dir: str) -> list[str]:
    from actcache.cache import ActivationCache
    from actcache.loaders import OrderedLoader

    def open_and_read():
        cache = ActivationCache.open(cache_dir)
        _ = cache[cache.n_imgs - 1]

    def ordered():
        for _ in OrderedLoader(cache_dir, batch_size=8, layer=3, batch_timeout_s=10):
            pass

    failures = []
    for name, fn in (("ActivationCache.open", open_and_read), ("OrderedLoader", ordered)):
        try:
            with alarm():
                fn()
        except ActCacheError:
            pass
        except Hang:
            failures.append(f"{name}: hang")
        except Exception as exc:
            failures.append(f"{name}: Traceback: {type(exc).__name__}: {exc}")
    return failures


def fuzz_cache_case(pristine: str, work: str, rng: random.Random, loaders: bool = True) -> tuple[str, list[str]]:
    """Copy the pristine cache, damage metadata.json or shards.json, run every reader on it."""
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    cache_dir = os.path.join(work, os.path.basename(pristine))
    shutil.copytree(pristine, cache_dir)
    target = rng.choice(["metadata.json", "shards.json"])
    kind = damage_json_file(os.path.join(cache_dir, target), rng)
    if target == "metadata.json" and rng.random() < 0.5:
        cache_dir = rehash(cache_dir)
    try:
        return f"{target}:{kind}", check_cache(cache_dir, loaders=loaders)
    finally:
        _unblock(work)


def _unblock(work: str) -> None:
    """Give back read access and remove what a case left (FIFOs, unreadable files)."""
    for dirpath, dirs, files in os.walk(work):
        for n in dirs + files:
            with contextlib.suppress(OSError):
                if not os.path.islink(os.path.join(dirpath, n)):
                    os.chmod(os.path.join(dirpath, n), 0o755)
    shutil.rmtree(work, ignore_errors=True)


# ---- a small experiment and ways to damage its YAML --------------------------------------------

EXPERIMENT = """\
# a fuzzed experiment
name: fuzz
vit:
  family: clip
  ckpt: {ckpt}
  layers: [-2, -1]
data:
  kind: synthetic
  n_imgs: 8
  seed: 1
  size: 32
cache:
  max_patches_per_shard: 68
  batch_size: 4
  n_workers: 0
train:
  layer: -2
  batch_size: 16
  steps: 2
  sweep:
    k: [2, 4]
"""


def make_checkpoint_config(directory: str) -> str:
    """A checkpoint directory holding only its configs (planning reads no weights)."""
    os.makedirs(directory, exist_ok=True)
    vision = {"hidden_size": 8, "num_hidden_layers": 4, "image_size": 32, "patch_size": 16,
              "model_type": "clip_vision_model"}  # fmt: skip
    with open(os.path.join(directory, "config.json"), "w") as fh:
        json.dump(vision, fh)
    pre = {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 32}, "crop_size": 32,
           "do_resize": True, "do_center_crop": True, "do_normalize": True, "do_rescale": True,
           "rescale_factor": 1 / 255, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "resample": 3}  # fmt: skip
    with open(os.path.join(directory, "preprocessor_config.json"), "w") as fh:
        json.dump(pre, fh)
    return directory


YAML_SNIPPETS = ("[", "]", "{", "}", ":", "- ", "&a ", "*a", "!!python/object:os.system", "? ", "|", ">", "'", '"',
                 "\t", "%YAML 1.1\n", "---\n", "...\n", "2020-13-45", "1e999", "9" * 5000, "null", "~", "<<: *a",
                 "!!binary x", "\x00", "\ufeff", "\x85")  # fmt: skip


def damage_yaml(text: str, rng: random.Random) -> tuple[str, bytes]:
    """(name, damaged bytes) of an experiment YAML."""
    kind = rng.choice(YAML_DAMAGE)
    lines = text.splitlines(keepends=True)
    if kind == "latin1-comment":
        return kind, text.replace("# a fuzzed experiment", "# caf\xe9 cr\xe8me").encode("latin-1")
    if kind == "deep":
        n = rng.choice([65, 200, 5000])
        return kind, (text + "extra: " + "[" * n + "]" * n + "\n").encode()
    if kind == "deep-block":
        n = rng.choice([65, 400])
        return kind, (text + "".join("  " * i + f"k{i}:\n" for i in range(n)) + "  " * n + "v\n").encode()
    if kind == "alias-bomb":
        rows = ['a0: &a0 ["x","x","x","x","x","x","x","x","x"]']
        rows += [f"a{i}: &a{i} [{','.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
        return kind, (text + "\n".join(rows) + "\n").encode()
    if kind == "self-reference":
        return kind, text.replace("  sweep:\n", "  sweep: &s\n    self: *s\n    k2:\n").encode()
    if kind == "type-swap":
        keys = ["kind", "family", "ckpt", "layers", "n_imgs", "max_patches_per_shard", "batch_size", "name", "vit",
                "data", "cache", "train", "sweep", "k", "seed", "size", "steps", "layer"]  # fmt: skip
        k = rng.choice(keys)
        value = rng.choice(["[synthetic]", "{a: 1}", "[]", "{}", "null", "-1", "1.5", "true", "'x'", "[[1]]",
                            "0x10", ".inf", "2020-01-01", "[-2, -2]", "999999999999999999999"])  # fmt: skip
        out = [ln if not ln.strip().startswith(k + ":") else ln.split(":")[0] + ": " + value + "\n" for ln in lines]
        if out == lines:
            out.append(f"{k}: {value}\n")
        return kind, "".join(out).encode()
    if kind == "delete-line":
        del lines[rng.randrange(len(lines))]
        return kind, "".join(lines).encode()
    if kind == "snippets":
        chars = list(text)
        for _ in range(rng.randint(1, 6)):
            chars.insert(rng.randrange(len(chars)), rng.choice(YAML_SNIPPETS))
        return kind, "".join(chars).encode("utf-8", "surrogatepass")
    if kind == "flip-bytes":
        b = bytearray(text.encode())
        for _ in range(rng.randint(1, 6)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return kind, bytes(b)
    if kind == "truncate":
        raw = text.encode()
        return kind, raw[: rng.randrange(len(raw))]
    if kind == "not-a-mapping":
        return kind, rng.choice([b"- a\n- b\n", b"42\n", b"", b"null\n", b"'just a string'\n"])
    if kind == "big-file":
        return kind, text.encode() + b"# " + b"x" * (17 * 2**20) + b"\n"
    if kind == "utf16":
        return kind, text.encode("utf-16")
    raise AssertionError(kind)


YAML_DAMAGE = ("latin1-comment", "deep", "deep-block", "alias-bomb", "self-reference", "type-swap", "type-swap",
               "type-swap", "delete-line", "snippets", "snippets", "flip-bytes", "truncate", "not-a-mapping",
               "big-file", "utf16")  # fmt: skip


@contextlib.contextmanager
def no_slurm():
    """PATH without Slurm's commands: `plan` then skips its site queries (seconds each on a busy
    cluster), which are not what the fuzzing tests."""
    old = os.environ.get("PATH", "")
    keep = [d for d in old.split(os.pathsep) if not os.path.exists(os.path.join(d, "sbatch"))]
    os.environ["PATH"] = os.pathsep.join(keep)
    try:
        yield
    finally:
        os.environ["PATH"] = old


def check_experiment(path: str, dump_to: str, runs_to: str, commands=("plan",)) -> list[str]:
    """`actcache plan` (and optionally `dump`) on an experiment file; the failures."""
    with no_slurm():
        return _check_experiment(path, dump_to, runs_to, commands)


def _check_experiment(path: str, dump_to: str, runs_to: str, commands) -> list[str]:
    failures = []
    for cmd in commands:
        if cmd == "plan":
            argv = ["plan", "--experiment", path, "--dump-to", dump_to, "--runs-to", runs_to, "--json"]
        else:
            argv = ["dump", "--experiment", path, "--dump-to", dump_to, "--no-progress", "--device", "cpu",
                    "--shards", "0:1"]  # fmt: skip
        rc, _, err = run_cli(argv)
        bad = judge(argv, rc, err)
        if bad:
            failures.append(bad)
    return failures


def warm_up(ckpt: str, pristine: str | None, work: str) -> None:
    """Run the readers once on undamaged files, unjudged: the first import of torch can take longer
    than HANG_S on a loaded machine, and that is no hang of the case."""
    os.makedirs(work, exist_ok=True)
    path = os.path.join(work, "warm.yaml")
    with open(path, "w") as fh:
        fh.write(EXPERIMENT.format(ckpt=ckpt))
    check_experiment(path, os.path.join(work, "cache"), os.path.join(work, "runs"), ("plan",))
    if pristine is not None:
        check_cache(pristine, loaders=True)
    shutil.rmtree(work, ignore_errors=True)


def fuzz_experiment_case(ckpt: str, work: str, rng: random.Random, commands=("plan",)) -> tuple[str, list[str]]:
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    kind, raw = damage_yaml(EXPERIMENT.format(ckpt=ckpt), rng)
    path = os.path.join(work, "fuzz.yaml")
    with open(path, "wb") as fh:
        fh.write(raw)
    try:
        return kind, check_experiment(path, os.path.join(work, "cache"), os.path.join(work, "runs"), commands)
    finally:
        shutil.rmtree(work, ignore_errors=True)
