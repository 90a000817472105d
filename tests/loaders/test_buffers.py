"""Batch buffer sets (actcache.loaders.buffers): fresh memory faulted in, the pool that lends
sets to the consumer and takes them back, and the page size sets go on."""

from __future__ import annotations

import ctypes
import mmap as _mmap
import threading

import numpy as np

from actcache.loaders import buffers
from actcache.loaders.buffers import STOP_CHECK_BYTES, BatchBuffers, BatchPool, huge_empty, populate_small
from actcache.loaders.maps import HUGE


def test_populate_small_faults_a_fresh_array_in_and_keeps_to_its_bytes():
    """A set on 4 KiB pages is faulted in with MADV_POPULATE_WRITE (no page-fault exception per
    page, unlike writing into each page); the ends that are not whole pages are written to, and
    nothing outside the array is."""

    page = _mmap.PAGESIZE
    a = huge_empty((4096, 768), np.float32, huge=False)
    raw = a.reshape(-1).view(np.uint8)
    raw[-page:] = 9  # the last page, touched, holds data that must not change
    part = raw[100 : raw.nbytes - page - 3]  # neither end on a page boundary
    assert populate_small(part)
    vec = (ctypes.c_ubyte * (raw.nbytes // page))()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(raw.ctypes.data), ctypes.c_size_t(raw.nbytes), vec) == 0
    assert all(v & 1 for v in vec), "populate_small left pages out"
    assert (raw[: raw.nbytes - page] == 0).all() and (raw[-page:] == 9).all()
    assert not populate_small(np.zeros(16, np.uint8))  # too small to bother: the caller touches it


def test_pool_spares_the_batch_a_loop_still_holds_while_next_runs():
    """While next() hands out batch k+1, a plain loop still holds batch k: with every set
    owned and those two lent, the pool must wait, not take k for a kept batch and allocate."""

    pool = BatchPool(lambda huge: BatchBuffers(4, 2, huge), 3, threading.Condition())
    sets = [pool.try_acquire() for _ in range(3)]
    assert pool.n_allocated == 3 and pool.try_acquire() is None
    held = [sets[0].to_torch()]  # the loop variable: batch k
    pool.lend(sets[0])
    held.append(sets[1].to_torch())  # batch k+1, being returned by next()
    pool.lend(sets[1])
    assert pool.try_acquire() is None and pool.n_allocated == 3
    held.pop(0)  # the loop moved on: batch k is free again
    assert pool.try_acquire() is sets[0] and pool.n_allocated == 3
    kept = [sets[0].to_torch(), sets[2].to_torch(), *held]  # a consumer that keeps every batch
    pool.lend(sets[2])
    pool.lend(sets[0])
    assert pool.try_acquire() is not None and pool.n_allocated == 4  # 3 lent and in use
    del held, kept


def test_a_prefill_gives_up_when_the_loader_stops(monkeypatch):
    """Faulting in a fresh batch buffer set can be slow (the host backing the memory): a loader that
    finishes or stops meanwhile must not wait for it. prefill(stop=...) looks at stop() between
    pieces, leaves the rest untouched and gives the set up; without a stop it fills the set."""

    monkeypatch.setattr(buffers, "STOP_CHECK_BYTES", 4096)
    pool = BatchPool(lambda huge: BatchBuffers(1024, 16, huge), 3, threading.Condition())  # 64 KiB of act
    calls = []
    pool.prefill(stop=lambda: calls.append(1) or len(calls) > 3)  # one check first, then 2 pieces
    assert pool.n_owned == 0 and pool.free == [] and len(calls) == 4
    pool.prefill(stop=lambda: True)  # stopped already: nothing allocated
    assert pool.n_owned == 0 and pool.n_allocated == 1
    pool.prefill(stop=lambda: False)
    assert pool.n_owned == 1 and len(pool.free) == 1
    a = np.full(3 * 4096, 7, np.uint8)  # touching writes a zero into each page
    assert not buffers.prefault(a, stop=iter([False, True]).__next__)
    assert a[0] == 0 and (a[4096:] == 7).all()  # the first piece touched, the rest left


def vm_flags(addr: int) -> set[str]:
    """The VmFlags of this process's mapping that holds ``addr`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_sets_go_on_small_pages_while_huge_ones_fault_in_slowly_and_back_later(monkeypatch):
    """Where 2 MiB pages fault in slower than HUGE_FAULT_MIN_BPS (a VM host backing the memory
    again), the rest of a set being prefilled goes on 4 KiB pages (MADV_NOHUGEPAGE from the piece
    after the slow one), and so do the next sets; a small set used more than SMALL_SET_USES
    times is replaced by one on 2 MiB pages. Fast enough, nothing changes."""

    rows, d = 4096, 768  # 12 MiB of act: three 4 MiB pieces
    monkeypatch.setattr(buffers, "HUGE_FAULT_MIN_BPS", 0.0)  # never slow
    pool = BatchPool(lambda huge: BatchBuffers(rows, d, huge), 3, threading.Condition())
    pool.prefill()
    (b,) = pool.free
    addr = b.act.ctypes.data
    assert b.huge and pool.huge and addr % HUGE == 0
    assert "hg" in vm_flags(addr) and "hg" in vm_flags(addr + b.act.nbytes - 1)

    monkeypatch.setattr(buffers, "HUGE_FAULT_MIN_BPS", float("inf"))  # every piece slow
    pool.prefill()
    b2 = pool.free[-1]
    a2 = b2.act.ctypes.data
    assert not b2.huge and not pool.huge
    assert "hg" in vm_flags(a2)  # the first piece, timed, stays as it was
    for off in (STOP_CHECK_BYTES, b2.act.nbytes - 1):
        assert "nh" in vm_flags(a2 + off) and "hg" not in vm_flags(a2 + off)
    b3 = pool.try_acquire()  # free sets first (b2, then b)
    assert b3 is b2 and b2.uses == 1
    pool.give_back(b2)
    b4 = pool.try_acquire()
    assert b4 is b2
    assert pool.try_acquire() is b  # a set on 2 MiB pages: no count
    assert b.uses == 0
    b5 = pool.try_acquire()  # grows: the third set, on 4 KiB pages like the last
    assert not b5.huge and "nh" in vm_flags(b5.act.ctypes.data) and pool.n_owned == 3

    monkeypatch.setattr(buffers, "SMALL_SET_USES", 3)
    pool.give_back(b2)
    assert pool.try_acquire() is b2 and b2.uses == 3  # still within the limit
    pool.give_back(b2)
    n0 = pool.n_allocated
    b7 = pool.try_acquire()  # b2's fourth use: replaced by a new set on 2 MiB pages
    assert b7 is not b2 and b7.huge and pool.huge and pool.n_allocated == n0 + 1 and pool.n_owned == 3
    assert "hg" in vm_flags(b7.act.ctypes.data)
