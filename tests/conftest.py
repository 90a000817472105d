"""Shared test helpers: small real caches written through the project's own writer."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from actcache.protocol import Metadata
from actcache.writer import write_cache_from_array

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SHM = "/dev/shm"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def in_mount_namespace(script: str, argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """``sh -c script`` with ``argv`` as "$@", in a mount namespace of its own (needs root): the
    script can mount a small tmpfs over a folder, for a real full disk that the machine's own
    filesystems never see."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = ["unshare", "--mount", "sh", "-c", script, "sh", *map(str, argv)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def _shm_names() -> set[str]:
    return set(os.listdir(SHM)) if os.path.isdir(SHM) else set()


@pytest.fixture(autouse=True)
def no_shared_memory_left_behind():
    """Every test: nothing it created in /dev/shm (torch's shared batches, multiprocessing
    semaphores, ...) may outlive it. Entries still going away get 2 s."""
    before = _shm_names()
    yield
    left = _shm_names() - before
    deadline = time.monotonic() + 2.0
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left &= _shm_names()
    assert not left, f"left behind in {SHM}: {sorted(left)}"


_FADVISE = os.posix_fadvise  # the real call, whatever a test patches later


def resident(fd: int, size: int) -> np.ndarray:
    """Per page of the open file, whether it is in the page cache (mincore: reads nothing in)."""
    import mmap

    from actcache.loaders.maps import PAGE, _mincore

    mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    a = np.frombuffer(mm, np.uint8)
    vec = np.zeros(-(-size // PAGE), np.uint8)
    try:
        assert _mincore(a.ctypes.data, size, vec.ctypes.data) == 0
    finally:
        del a
        mm.close()
    return (vec & 1).astype(bool)


def evict_fd(fd: int, size: int) -> None:
    """The open file's pages out of the page cache, confirmed with mincore (a RWF_NOWAIT probe that
    misses would start the kernel's read-ahead). The kernel may keep a page it cannot drop yet, so
    this retries for a few seconds before failing the test."""
    deadline = time.monotonic() + 10
    while True:
        os.pread(fd, size, 0)  # waits for any read still in flight
        os.fsync(fd)  # clean pages: DONTNEED leaves dirty ones
        _FADVISE(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        left = int(resident(fd, size).sum())
        if not left:
            return
        assert time.monotonic() < deadline, f"{left} pages stayed cached after DONTNEED"
        time.sleep(0.05)


def evict(*paths) -> None:
    """Each file out of the page cache (evict_fd)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            evict_fd(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)


def evict_dir(path) -> None:
    """Every shard (.bin) of a cache directory out of the page cache."""
    evict(*(os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".bin")))


def make_metadata(
    n_imgs=10, layers=(3, 7), n_patches=4, cls=True, d=8, max_patches=None, imgs_per_shard=4, **kw
) -> Metadata:
    T = n_patches + int(cls)
    if max_patches is None:
        max_patches = imgs_per_shard * T * len(layers)
    return Metadata(
        vit_family=kw.pop("vit_family", "clip"),
        vit_ckpt=kw.pop("vit_ckpt", "test/ckpt"),
        layers=tuple(layers),
        n_patches_per_img=n_patches,
        cls_token=cls,
        d_vit=d,
        n_imgs=n_imgs,
        max_patches_per_shard=max_patches,
        data=kw.pop("data", {"__class__": "Test", "seed": 0}),
        **kw,
    )


def make_cache(root, seed=0, labels=None, class_names=None, **kw):
    """Write a cache of random activations; returns (path, metadata, full logical array)."""
    md = make_metadata(**kw)
    rng = np.random.default_rng(seed)
    acts = rng.standard_normal((md.n_imgs, len(md.layers), md.n_tokens_per_img, md.d_vit), dtype=np.float32)
    path = write_cache_from_array(root, md, acts, labels=labels, class_names=class_names)
    return path, md, acts


@pytest.fixture
def small_cache(tmp_path):
    return make_cache(tmp_path)


@pytest.fixture
def sigint_raises():
    """Ctrl-C tests send SIGINT with ``_thread.interrupt_main()``, which does nothing when SIGINT
    is ignored, as it is for a command started in the background of a non-interactive shell
    (``cmd &``): Python then keeps that disposition. Such tests install Python's own handler."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.fixture
def one_torch_thread():
    """torch on one thread for the test, then as before: small matrices gain nothing from more, the
    float results do not depend on the machine's core count, and it degrades gracefully when other
    jobs share the CPU. Modules ask for it with ``pytestmark``."""
    import torch  # here, not at the top: most test modules never import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def chromium():
    """Chromium's executable: Debian's package, installed with apt-get when missing (as CI does on
    a clean machine); a failure to install fails the test rather than skipping it."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        cmd = "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium"
        if os.geteuid() != 0:
            cmd = "sudo -n sh -c " + repr(cmd)
        proc = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=1200)
        exe = shutil.which("chromium")
        if exe is None:
            pytest.fail(
                f"chromium is needed to render the visuals page and could not be installed:\n{proc.stderr[-2000:]}"
            )
    return exe
