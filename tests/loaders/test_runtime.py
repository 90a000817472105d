"""Loader threads (actcache.loaders.runtime.Runtime): spawning, roles and errors."""

from __future__ import annotations

import threading

from actcache.loaders.runtime import Runtime


def test_spawn_all_holds_every_thread_until_the_last_has_started():
    """Runtime.spawn_all: no role's work begins before every thread of the batch has started (a
    thread that went straight to Python work used to keep the GIL from the spawning one), every
    role runs once, and a role's exception still reaches the runtime's error."""
    rt = Runtime("t")
    seen, lock = [], threading.Lock()

    def role(i):
        with lock:
            seen.append((i, len(rt.threads)))
        if i == 3:
            raise ValueError("role 3 failed")

    rt.spawn_all([(f"r{i}", lambda i=i: role(i)) for i in range(5)])
    for t in rt.threads:
        t.join(10)
    assert sorted(i for i, _ in seen) == list(range(5))
    assert all(n == 5 for _, n in seen), seen  # each began once all five existed
    assert rt.error is not None and rt.error[0] == "r3" and "role 3 failed" in str(rt.error[2])
