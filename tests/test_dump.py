"""actcache dump on a tiny random CLIP checkpoint and real image files (offline, no mocks)."""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import time

import numpy as np
import PIL.Image
import pytest
import torch
import yaml

from actcache.cache import ActivationCache
from actcache.config import load_experiment
from actcache.dump import ShardSink, check_shard_range, dump_shards, parse_shard_range
from actcache.errors import ConfigError, DumpError
from actcache.fsutil import is_temp
from actcache.protocol import SHARDS_FILE, Metadata, shard_name
from actcache.validate import validate_dir
from actcache.writer import gather
from conftest import in_mount_namespace
from fixtures_vit import make_checkpoint, pil_processor_class, reference_hidden_states

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = [-2, 0]  # blocks 1 and 0 of the 3-block test model
T = 17  # CLS + 16 patches
IMGS_PER_SHARD = 4
N_IMGS = 22  # 6 shards, the last one holds 2 images


# ---- shared helpers (also used by test_dump_kill.py) --------------------------------------------


def make_images(root, n=N_IMGS, seed=0, classes=("cat", "dog")) -> list[str]:
    """PNG/JPEG files of varied sizes and modes in class folders; returns sorted relative paths."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        cls = classes[i % len(classes)]
        os.makedirs(os.path.join(root, cls), exist_ok=True)
        h, w = (int(v) for v in rng.integers(20, 90, 2))
        arr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        img = PIL.Image.fromarray(arr, "RGB")
        if i % 5 == 3:
            img = img.convert("L")
        name = f"{cls}/img{i:04d}.{'jpg' if i % 4 == 1 else 'png'}"
        img.save(os.path.join(root, name))
        out.append(name)
    return sorted(out)


def write_experiment(path, ckpt, images, family="clip", layers=LAYERS, imgs_per_shard=IMGS_PER_SHARD,
                     batch_size=3, n_workers=0, dump_to=None, device=None) -> str:  # fmt: skip
    doc = {
        "vit": {"family": family, "ckpt": str(ckpt), "layers": list(layers)},
        "data": {"kind": "image_folder", "root": str(images)},
        "cache": {
            "max_patches_per_shard": imgs_per_shard * T * len(layers),
            "batch_size": batch_size,
            "n_workers": n_workers,
        },
    }
    if dump_to is not None:
        doc["dump_to"] = str(dump_to)
    if device is not None:
        doc["cache"]["device"] = device
    with open(path, "w") as fd:
        yaml.safe_dump(doc, fd)
    return str(path)


def dump_argv(exp, dump_to) -> list[str]:
    """The command line of `actcache dump` for an experiment (for a process of its own)."""
    return [sys.executable, "-m", "actcache.cli", "dump", "--experiment", str(exp), "--dump-to", str(dump_to),
            "--no-progress"]  # fmt: skip


def cli(*args, timeout=120, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "actcache.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT, **kw)  # fmt: skip


def shard_files(path) -> dict[str, bytes]:
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path)) if n.endswith(".bin")}


def temp_files(path) -> list[str]:
    return [n for n in os.listdir(path) if is_temp(n)]


def hash_dirs(dump_to) -> list[str]:
    """Cache directories under dump_to (the image listing cache, .listings, is not one)."""
    if not os.path.exists(dump_to):
        return []
    return [os.path.join(dump_to, n) for n in sorted(os.listdir(dump_to)) if not n.startswith(".")]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "clip"), "clip")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    make_images(str(root))
    return str(root)


# ---- the cache is right and does not depend on the job split ------------------------------------


def test_one_job_equals_three_jobs_and_the_model(tmp_path, ckpt, images):
    exp = load_experiment(write_experiment(tmp_path / "exp.yaml", ckpt, images))
    one = dump_shards(exp, None, str(tmp_path / "one"), n_workers=2, progress=False)
    for a, b in [(0, 2), (2, 3), (3, 6)]:  # three "jobs", in-process, no workers
        three = dump_shards(exp, (a, b), str(tmp_path / "three"), n_workers=0, progress=False)
    assert os.path.basename(one) == os.path.basename(three)
    md = Metadata.load(one)
    assert md.n_imgs == N_IMGS and md.n_shards == 6 and md.layers == tuple(LAYERS) and md.n_tokens_per_img == T
    assert not os.path.exists(os.path.join(one, SHARDS_FILE))  # a dump never gathers
    gather(one)
    gather(three)
    for name in [*shard_files(one), SHARDS_FILE, "metadata.json", "labels.npy", "labels.json"]:
        assert open(os.path.join(one, name), "rb").read() == open(os.path.join(three, name), "rb").read(), name
    assert len(shard_files(one)) == 6 and not temp_files(one) and not temp_files(three)
    validate_dir(one, deep=True)

    # Straight from transformers: its own image processor and output_hidden_states.
    files = sorted(os.path.relpath(os.path.join(d, f), images) for d, _, fs in os.walk(images) for f in fs)
    pil = [PIL.Image.open(os.path.join(images, f)).convert("RGB") for f in files]
    # the PIL processor (the reference; AutoImageProcessor picks the torchvision one where torchvision is installed)
    proc = pil_processor_class("CLIPImageProcessor").from_pretrained(ckpt)
    pixels = torch.as_tensor(np.asarray(proc(images=pil, return_tensors="np")["pixel_values"]))
    hidden = reference_hidden_states(ckpt, "clip", pixels)
    want = torch.stack([hidden[1 + (layer % 3)] for layer in LAYERS], dim=1).numpy()  # (N, L, T, D)
    with ActivationCache.open(one) as cache:
        got = cache[0:N_IMGS]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(cache[13], got[13])
        np.testing.assert_array_equal(cache[13, 0, 5], got[13, 1, 5])  # layer value 0 is stored second
        np.testing.assert_array_equal(cache.labels, [0 if f.startswith("cat/") else 1 for f in files])
        assert cache.class_names == ["cat", "dog"]

    # Re-running a finished range writes nothing.
    before = {n: os.stat(os.path.join(one, n)).st_mtime_ns for n in shard_files(one)}
    dump_shards(exp, (1, 5), str(tmp_path / "one"), progress=False)
    assert before == {n: os.stat(os.path.join(one, n)).st_mtime_ns for n in shard_files(one)}


def test_cli_dump_gather_verify(tmp_path, ckpt, images):
    exp = write_experiment(tmp_path / "exp.yaml", ckpt, images, n_workers=1)
    d = tmp_path / "dump"
    out = cli("dump", "--experiment", exp, "--shards", "0:2", "--dump-to", str(d), "--no-progress")
    assert out.returncode == 0, out.stderr
    path = out.stdout.strip().splitlines()[-1]
    assert os.path.dirname(path) == str(d) and sorted(shard_files(path)) == [shard_name(0), shard_name(1)]
    out = cli("gather", path)  # shards 2..5 are missing
    assert out.returncode == 2 and shard_name(2) in out.stderr and "missing" in out.stderr
    out = cli("dump", "--experiment", exp, "--shards", "2:", "--dump-to", str(d), "--no-progress")
    assert out.returncode == 0, out.stderr
    assert "already complete" not in out.stderr
    assert cli("gather", path).returncode == 0
    out = cli("verify", path)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr


# ---- bad input: a clear error, no shard that looks complete -------------------------------------


def test_shard_ranges():
    assert parse_shard_range("0:2") == (0, 2) and parse_shard_range("3:") == (3, None)
    assert parse_shard_range(None) is None and check_shard_range(None, 6) == (0, 6)
    assert check_shard_range((None, 2), 6) == (0, 2)
    for bad in ["2", "a:b", "1-3"]:
        with pytest.raises(ConfigError, match="A:B"):
            parse_shard_range(bad)
    for bad in [(2, 2), (3, 1), (0, 7), (6, 7), (-1, 2)]:
        with pytest.raises(ConfigError, match="6 shard"):
            check_shard_range(bad, 6)


def test_range_and_dump_to_checked_before_any_work(tmp_path, ckpt, images):
    exp = load_experiment(write_experiment(tmp_path / "exp.yaml", ckpt, images))
    with pytest.raises(ConfigError, match=r"4:9.*6 shard"):
        dump_shards(exp, (4, 9), str(tmp_path / "d"), progress=False)
    with pytest.raises(ConfigError, match="--dump-to"):
        dump_shards(exp, None, None, progress=False)
    assert hash_dirs(tmp_path / "d") == []


def test_missing_and_empty_image_folder(tmp_path, ckpt):
    exp = load_experiment(write_experiment(tmp_path / "exp.yaml", ckpt, tmp_path / "nope"))
    with pytest.raises(ConfigError, match=r"exp.yaml: key .data.root. is .*nope.*no such directory"):
        dump_shards(exp, None, str(tmp_path / "d"), progress=False)
    (tmp_path / "empty" / "cls").mkdir(parents=True)
    (tmp_path / "empty" / "cls" / "notes.txt").write_text("not an image")
    exp = load_experiment(write_experiment(tmp_path / "exp.yaml", ckpt, tmp_path / "empty"))
    with pytest.raises(ConfigError, match="empty.*no image files"):
        dump_shards(exp, None, str(tmp_path / "d"), progress=False)
    assert hash_dirs(tmp_path / "d") == []


def test_corrupt_image_names_the_file_and_writes_no_shard_for_it(tmp_path, ckpt):
    root = tmp_path / "imgs"
    files = make_images(str(root), n=12)
    bad = root / files[6]  # image 6: shard 1 (images 4..7), in its second batch (6..7)
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) // 2])  # its header reads, its pixels are cut short: found when decoded
    exp = load_experiment(write_experiment(tmp_path / "exp.yaml", ckpt, root, n_workers=1))
    with pytest.raises(DumpError) as info:
        dump_shards(exp, None, str(tmp_path / "d"), progress=False)
    assert str(bad) in str(info.value) and shard_name(1) in str(info.value)
    (path,) = hash_dirs(tmp_path / "d")
    assert sorted(shard_files(path)) == [shard_name(0)]  # shard 0 was complete before the bad batch
    assert not temp_files(path)


def test_three_corrupt_images_are_one_error_naming_all_three_before_the_model_loads(tmp_path, ckpt, caplog):
    root = tmp_path / "imgs"
    files = make_images(str(root), n=12)
    bad = [root / files[i] for i in (1, 6, 11)]  # one in each of the three shards
    for i, f in enumerate(bad):
        f.write_bytes([b"", b"\x89PNG\r\n\x1a\n" + b"garbage" * 10, b"\xff\xd8garbage"][i])
    exp = load_experiment(write_experiment(tmp_path / "exp.yaml", ckpt, root, n_workers=1))
    caplog.set_level("INFO", logger="actcache")
    with pytest.raises(ConfigError) as info:
        dump_shards(exp, None, str(tmp_path / "d"), progress=False)
    msg = str(info.value)
    assert "3 of 12 images" in msg and all(str(f) in msg for f in bad) and "\n" not in msg
    assert "no model was loaded" in msg and "loaded clip" not in caplog.text  # the model never loaded
    (path,) = hash_dirs(tmp_path / "d")
    assert shard_files(path) == {}


def test_unknown_family_and_wrong_family(tmp_path, ckpt, images):
    yml = write_experiment(tmp_path / "exp.yaml", ckpt, images, family="vitx")
    with pytest.raises(ConfigError, match="vitx"):
        load_experiment(yml)
    out = cli("dump", "--experiment", yml, "--dump-to", str(tmp_path / "d"))
    assert out.returncode == 2 and "vitx" in out.stderr and "Traceback" not in out.stderr
    exp = load_experiment(write_experiment(tmp_path / "exp.yaml", ckpt, images, family="dinov2"))
    with pytest.raises(ConfigError, match="clip"):
        dump_shards(exp, None, str(tmp_path / "d"), progress=False)
    assert hash_dirs(tmp_path / "d") == []


def test_layer_beyond_the_model(tmp_path, ckpt, images):
    for layers in ([3], [0, -4]):
        exp = load_experiment(write_experiment(tmp_path / "exp.yaml", ckpt, images, layers=layers))
        with pytest.raises(ConfigError, match=r"3 blocks"):
            dump_shards(exp, None, str(tmp_path / "d"), progress=False)
    assert hash_dirs(tmp_path / "d") == []


def _dump_with_file_size_limit(exp, dump_to, limit):
    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return cli("dump", "--experiment", exp, "--dump-to", dump_to, "--no-progress", preexec_fn=small_files)


def test_write_failure_file_size_limit(tmp_path, ckpt, images):
    # A 17,408-byte shard exceeds the limit; metadata.json, the labels and a 1-image batch
    # (12,288 bytes of shared memory from the worker) do not.
    exp = write_experiment(tmp_path / "exp.yaml", ckpt, images, batch_size=1, n_workers=1)
    out = _dump_with_file_size_limit(exp, str(tmp_path / "d"), 15_000)
    assert out.returncode == 2, out.stderr
    assert shard_name(0) in out.stderr and "EFBIG" in out.stderr and "Traceback" not in out.stderr
    (path,) = hash_dirs(tmp_path / "d")
    assert shard_files(path) == {} and not temp_files(path)
    # Without the limit the same dump completes.
    assert dump_shards(load_experiment(exp), None, str(tmp_path / "d"), progress=False) == path
    assert len(shard_files(path)) == 6 and gather(path)


def test_worker_cannot_share_a_batch_fails_without_hanging(tmp_path, ckpt, images):
    # The limit also caps the worker's shared-memory batch, as a full /dev/shm would: a clear
    # error, not a main process waiting for a batch that never comes. 3 images are 36,864 bytes as
    # float32, 9,216 as the uint8 a CUDA dump's workers send (device "auto" picks a GPU if any).
    # torch leaves the file of a segment it could not size in /dev/shm: the worker removes it.
    exp = write_experiment(tmp_path / "exp.yaml", ckpt, images, batch_size=3, n_workers=1)
    before = set(os.listdir("/dev/shm"))
    out = _dump_with_file_size_limit(exp, str(tmp_path / "d"), 8_000)
    assert out.returncode == 2 and "shm" in out.stderr and shard_name(0) in out.stderr, out.stderr
    (path,) = hash_dirs(tmp_path / "d")
    assert shard_files(path) == {} and not temp_files(path)
    assert not {n for n in set(os.listdir("/dev/shm")) - before if n.startswith("torch_")}


def _dump_over_small_dev_shm(tmp_path, exp, size):
    """The dump in its own mount namespace over a tmpfs /dev/shm of ``size`` (needs root); the
    namespace's /dev/shm is listed once the dump has ended: (process, what was left there)."""
    dump = dump_argv(exp, tmp_path / "d")
    script = (
        f'mount -t tmpfs -o size={size} tmpfs /dev/shm || exit 99; "$@"; rc=$?; echo "left:$(ls -A /dev/shm)"; exit $rc'
    )
    out = in_mount_namespace(script, dump, timeout=120)
    assert out.returncode != 99, out.stderr
    return out, out.stdout.strip().splitlines()[-1].removeprefix("left:")


@pytest.mark.parametrize("size, batch_size, where", [("128k", 16, "pass a batch"), ("4k", 3, "start 1 image-loading")])
def test_full_dev_shm_is_a_clear_error_and_leaves_nothing(tmp_path, ckpt, images, size, batch_size, where):
    # A real full /dev/shm. 128 KiB: the workers start (their queues' semaphores take a page each),
    # but one batch of 16 images (float32 pixels: 196,608 bytes; shards of 16 images, so the batch
    # is not cut at a shard's end) does not fit; torch's allocation fails (ENOSPC) and leaves the
    # segment's file, sized but not allocated, which the worker removes. 4 KiB: not even the
    # semaphores fit. On the CPU: a CUDA dump's workers pass uint8 pixels, a quarter of the bytes;
    # the shared-memory handling is the same code.
    exp = write_experiment(tmp_path / "exp.yaml", ckpt, images, batch_size=batch_size, n_workers=1, device="cpu",
                           imgs_per_shard=16)  # fmt: skip
    out, left = _dump_over_small_dev_shm(tmp_path, exp, size)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"cannot {where}" in out.stderr and "No space left on device" in out.stderr, out.stderr
    assert "/dev/shm full" in out.stderr and "--workers 0" in out.stderr
    assert left == "", left
    (path,) = hash_dirs(tmp_path / "d")
    assert shard_files(path) == {} and not temp_files(path)


def test_plan_states_the_cost_and_dump_refuses_a_range_that_cannot_fit(tmp_path, ckpt, images):
    # dump_to a 64 KiB tmpfs (root, its own mount namespace): the 22 images take 95,744 bytes.
    exp = write_experiment(tmp_path / "exp.yaml", ckpt, images)
    d = tmp_path / "d"
    d.mkdir()
    plan = [sys.executable, "-m", "actcache.cli", "plan", "--experiment", exp, "--dump-to", str(d),
            "--runs-to", str(tmp_path / "runs")]  # fmt: skip
    script = f'mount -t tmpfs -o size=64k tmpfs {d} || exit 99\n"$@"; echo "rc=$?" >&2\n{" ".join(plan)}\n'
    out = in_mount_namespace(script, dump_argv(exp, d), timeout=120)
    assert "rc=2" in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]
    need = N_IMGS * 2 * T * 32 * 4
    assert f"the 6 shard(s) to write (0..5) need 93.5 KiB ({need} bytes) but only" in out.stderr, out.stderr
    assert "No shard was written" in out.stderr and "Traceback" not in out.stderr
    assert "size      93.5 KiB in 6 shard(s), 93.5 KiB still to write" in out.stdout, out.stdout
    assert f"on {d}  (does not fit: " in out.stdout


def test_dump_to_with_one_page_of_room(tmp_path, ckpt, images):
    # dump_to a 4 KiB tmpfs in the dump's own mount namespace (root): its one page goes to the image
    # listing or to metadata.json, and the next set-up write fails. One clear error; what is left
    # is whole.
    exp = write_experiment(tmp_path / "exp.yaml", ckpt, images)
    d, out_dir = tmp_path / "d", tmp_path / "out"
    d.mkdir()
    dump = dump_argv(exp, d)
    script = f'mount -t tmpfs -o size=4k tmpfs {d} || exit 99\n"$@"; echo "rc=$?" >&2\ncp -r {d} {out_dir}\n'
    out = in_mount_namespace(script, dump, timeout=120)
    assert "rc=2" in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "error: creating " in out.stderr or "error: writing labels into" in out.stderr, out.stderr[-3000:]
    assert re.search(r"failed( \([^)]*\))?: No space left on device \(ENOSPC\)\. Check that dump_to is writable and has "
                     "free space", out.stderr)  # fmt: skip
    for path in hash_dirs(out_dir):
        left = os.listdir(path)
        assert set(left) <= {"metadata.json"}, left  # no labels file, whole or partial; no temporary file
        if left:
            assert Metadata.load(os.path.join(path, "metadata.json")).hash == os.path.basename(path)


def test_disk_full_keeps_complete_shards_and_a_rerun_finishes_the_cache(tmp_path, ckpt, images):
    # A real full disk: dump_to is a tmpfs of ~2.5 shards (and 4 pages) in the dump's own mount namespace (root).
    # The dump stops with ENOSPC, having kept only complete shards; the filesystem is then grown
    # (what an admin would do) and the same command finishes the cache, equal to an unhindered one.
    exp = write_experiment(tmp_path / "exp.yaml", ckpt, images)
    ref = dump_shards(load_experiment(exp), None, str(tmp_path / "ref"), progress=False)
    want = shard_files(ref)
    shard = len(want[shard_name(0)])
    d, out_dir = tmp_path / "d", tmp_path / "out"
    d.mkdir()
    dump = [*dump_argv(exp, d), "--no-space-check"]  # a disk that fills during the dump, not before it
    script = (
        f"mount -t tmpfs -o size={(-(-shard // 4096) * 5 // 2 + 4) * 4096} tmpfs {d} || exit 99\n"
        '"$@"; echo "rc1=$?" >&2\n'
        f"find {d} -type f -printf 'file %P %s\\n' | sort\n"
        f"mount -o remount,size=64m {d}\n"
        '"$@"; echo "rc2=$?" >&2\n'
        f"cp -r {d} {out_dir}\n"
    )
    out = in_mount_namespace(script, dump, timeout=240)
    assert out.returncode == 0 and "rc1=2" in out.stderr and "rc2=0" in out.stderr, out.stderr
    first = out.stderr.split("rc1=")[0]
    assert "No space left on device" in first and "re-run the same command" in first and "Traceback" not in first
    after_full = dict(line[5:].rsplit(" ", 1) for line in out.stdout.splitlines() if line.startswith("file "))
    bins = {os.path.basename(p): int(n) for p, n in after_full.items() if p.endswith(".bin")}
    assert 0 < len(bins) < len(want) and set(bins.values()) == {shard}, after_full  # complete shards only
    assert not [p for p in after_full if is_temp(os.path.basename(p))], after_full
    (path,) = hash_dirs(out_dir)
    assert os.path.basename(path) == os.path.basename(ref) and shard_files(path) == want
    assert gather(path)


def test_writer_thread_error_surfaces_promptly(tmp_path):
    from conftest import make_metadata

    md = make_metadata(n_imgs=8, imgs_per_shard=4)
    sink = ShardSink(str(tmp_path / "gone"), md).start()  # the directory does not exist
    acts = np.zeros((2, len(md.layers), md.n_tokens_per_img, md.d_vit), np.float32)
    t0 = time.monotonic()
    with pytest.raises(DumpError, match=f"{shard_name(0)}.*gone"):
        for _ in range(1000):
            sink.put(0, acts)
    assert time.monotonic() - t0 < 10
    sink.abort(drain=False)


def test_cuda_forward_runs_in_full_float32_and_restores_the_flags():
    from actcache.dump import forward_precision

    mm, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = mm.allow_tf32, cudnn.allow_tf32
    try:
        mm.allow_tf32 = cudnn.allow_tf32 = True  # what a training script may have set
        with forward_precision(torch.device("cuda")):
            assert (mm.allow_tf32, cudnn.allow_tf32) == (False, False)
        assert (mm.allow_tf32, cudnn.allow_tf32) == (True, True)
        with pytest.raises(RuntimeError), forward_precision(torch.device("cuda")):
            raise RuntimeError("a failed dump restores them too")
        assert (mm.allow_tf32, cudnn.allow_tf32) == (True, True)
        with forward_precision(torch.device("cpu")):
            assert (mm.allow_tf32, cudnn.allow_tf32) == (True, True)  # nothing to change on the CPU
        mm.allow_tf32 = cudnn.allow_tf32 = False
        with forward_precision(torch.device("cuda"), "tf32"):  # cache.forward: tf32 allows it
            assert (mm.allow_tf32, cudnn.allow_tf32) == (True, True)
        assert (mm.allow_tf32, cudnn.allow_tf32) == (False, False)
    finally:
        mm.allow_tf32, cudnn.allow_tf32 = saved


def _with_forward(path, forward: str) -> str:
    with open(path) as fd:
        doc = yaml.safe_load(fd)
    doc["cache"]["forward"] = forward
    out = f"{path}.{forward}.yaml"
    with open(out, "w") as fd:
        yaml.safe_dump(doc, fd)
    return out


def test_forward_precision_key_fp32_is_byte_identical_and_others_change_the_hash(tmp_path, ckpt, images):
    plain = write_experiment(tmp_path / "exp.yaml", ckpt, images, imgs_per_shard=8)
    base = dump_shards(load_experiment(plain), (0, 1), str(tmp_path / "plain"), progress=False)
    meta = open(os.path.join(base, "metadata.json"), "rb").read()
    assert b"forward" not in meta  # a cache of the default forward is written as before the key
    paths = {}
    for forward in ("fp32", "tf32", "bf16"):
        exp = load_experiment(_with_forward(plain, forward))
        paths[forward] = dump_shards(exp, (0, 1), str(tmp_path / forward), progress=False)
        assert Metadata.load(paths[forward]).forward == forward
    # fp32 written out: same hash, same metadata.json, same bytes as with the key absent
    assert os.path.basename(paths["fp32"]) == os.path.basename(base)
    assert open(os.path.join(paths["fp32"], "metadata.json"), "rb").read() == meta
    assert shard_files(paths["fp32"]) == shard_files(base)
    want = np.frombuffer(shard_files(base)[shard_name(0)], np.float32)
    for forward in ("tf32", "bf16"):  # another forward is another cache
        assert os.path.basename(paths[forward]) != os.path.basename(base)
        assert f'"forward": "{forward}"' in open(os.path.join(paths[forward], "metadata.json")).read()
    # the CPU has no TF32: the same values; bf16 autocast rounds them (relative error ~1e-2)
    assert shard_files(paths["tf32"])[shard_name(0)] == shard_files(base)[shard_name(0)]
    got = np.frombuffer(shard_files(paths["bf16"])[shard_name(0)], np.float32)
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert 1e-5 < rel < 0.05, rel


def test_forward_precision_key_rejects_other_values(tmp_path, ckpt, images):
    bad = _with_forward(write_experiment(tmp_path / "exp.yaml", ckpt, images), "fp16")
    with pytest.raises(ConfigError, match=r"cache\.forward.*fp32, tf32, bf16.*fp16"):
        load_experiment(bad)


def test_uint8_pixel_route_of_cuda_dumps_writes_the_same_bytes(tmp_path, ckpt, images, monkeypatch):
    # A CUDA dump's workers send resized and cropped uint8 pixels, normalised where the model runs.
    # Taken here on the CPU (no GPU in CI), it must write exactly what the float32 route writes.
    exp = load_experiment(write_experiment(tmp_path / "exp.yaml", ckpt, images))
    plain = dump_shards(exp, None, str(tmp_path / "plain"), n_workers=2, progress=False)
    import actcache.dump as dump_mod

    monkeypatch.setattr(dump_mod, "_raw_pixels", lambda dev: True)
    for workers in (2, 0):
        raw = dump_shards(exp, None, str(tmp_path / f"raw{workers}"), n_workers=workers, progress=False)
        assert shard_files(raw) == shard_files(plain)


def test_auto_device_in_a_slurm_gpu_job_without_cuda_is_an_error_naming_the_fix():
    from actcache.dump import resolve_device

    gpu_job = {"SLURM_JOB_ID": "7", "SLURM_JOB_GPUS": "0"}
    if torch.cuda.is_available():  # a GPU machine: auto is the GPU
        assert resolve_device("auto", env=gpu_job).type == "cuda"
        return
    with pytest.raises(ConfigError) as err:
        resolve_device("auto", env=gpu_job)
    msg = str(err.value)
    assert "Slurm job 7" in msg and "SLURM_JOB_GPUS=0" in msg and "cache.device: cpu" in msg and "\n" not in msg
    assert ("download.pytorch.org/whl/cu" in msg) == (torch.version.cuda is None)
    assert resolve_device("auto", env={"SLURM_JOB_ID": "7"}).type == "cpu"  # a CPU job of Slurm
    assert resolve_device("auto", env={"SLURM_JOB_GPUS": "0"}).type == "cpu"  # not in a Slurm job


def test_image_workers_are_capped_at_the_cpus_here(caplog):
    import logging

    from actcache.dump import usable_workers

    with caplog.at_level(logging.INFO, logger="actcache.dump"):
        assert usable_workers(4, cpus=2) == 2  # the default n_workers on 2 cores: no PyTorch warning
    assert "4 image worker(s) asked for, 2 CPU(s) here: using 2" in caplog.text
    assert usable_workers(0, cpus=2) == 0 and usable_workers(2, cpus=8) == 2
    assert 1 <= usable_workers(10_000) <= os.cpu_count()
