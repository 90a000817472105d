"""Headless Chromium for tests: ``browse`` (one page, its DOM or a screenshot) and
:class:`DevTools` (a browser driven over the DevTools protocol, on a pipe). The ``chromium``
fixture (conftest.py) finds or installs the browser.

DevTools runs over
``--remote-debugging-pipe`` (NUL-terminated JSON on file descriptors 3 and 4), so it needs
neither a port nor a websocket library.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import tempfile
import time

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
    "--enable-logging=stderr", "--v=0",
]  # fmt: skip


def browse(exe: str, page: str, *, hash: str = "", screenshot: str | None = None, size=(1300, 1600)):
    """Load ``page`` (a file path) headless; returns (DOM or '', console lines)."""
    with tempfile.TemporaryDirectory() as profile:
        args = [exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}",
                "--virtual-time-budget=5000"]  # fmt: skip
        args += [f"--screenshot={screenshot}"] if screenshot else ["--dump-dom"]
        proc = subprocess.run([*args, "file://" + os.path.abspath(page) + hash], capture_output=True, text=True,
                              timeout=120, start_new_session=True)  # fmt: skip
    console = [ln for ln in proc.stderr.splitlines() if ":CONSOLE" in ln or "Uncaught" in ln]
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, console


class DevTools:
    """One headless Chromium and one tab, driven over the DevTools protocol.

    ``open(path)`` loads a file and waits for its load event; ``eval(js)`` runs an expression in
    the tab (promises awaited, the value returned as JSON); ``frames()`` lists the tab's frames;
    ``eval_in(frame_id, js)`` runs an expression inside one frame, whatever its origin.
    """

    def __init__(self, exe: str, size=(1300, 1600), timeout_s: float = 60):
        self.timeout_s, self.next_id, self.events, self.buf = timeout_s, 0, [], b""
        self.profile = tempfile.mkdtemp(prefix="actcache-chromium-")
        to_browser_r, self.to_browser = os.pipe()
        self.from_browser, from_browser_w = os.pipe()

        def wire() -> None:  # in the child: the protocol's descriptors 3 (commands) and 4 (replies)
            os.dup2(to_browser_r, 3)
            os.dup2(from_browser_w, 4)

        args = [exe, *CHROMIUM_FLAGS, "--remote-debugging-pipe", f"--user-data-dir={self.profile}",
                f"--window-size={size[0]},{size[1]}", "about:blank"]  # fmt: skip
        self.proc = subprocess.Popen(args, pass_fds=(3, 4), preexec_fn=wire, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        os.close(to_browser_r)
        os.close(from_browser_w)
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.call("Page.enable", session=self.session)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout_s=10)
        except (OSError, AssertionError, TimeoutError):
            self.proc.kill()
        self.proc.wait(timeout=30)
        os.close(self.to_browser)
        os.close(self.from_browser)
        shutil.rmtree(self.profile, ignore_errors=True)

    def _message(self, deadline: float) -> dict:
        while b"\0" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.from_browser], [], [], left)[0]:
                raise TimeoutError("no reply from chromium")
            chunk = os.read(self.from_browser, 1 << 20)
            assert chunk, "chromium closed its DevTools pipe"
            self.buf += chunk
        raw, self.buf = self.buf.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, params: dict | None = None, session: str | None = None,
             timeout_s: float | None = None) -> dict:  # fmt: skip
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self.to_browser, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            got = self._message(deadline)
            if got.get("id") == self.next_id:
                assert "error" not in got, f"{method}: {got['error']}"
                return got.get("result", {})
            self.events.append(got)

    def wait_event(self, method: str) -> dict:
        deadline = time.monotonic() + self.timeout_s
        while True:
            for i, ev in enumerate(self.events):
                if ev.get("method") == method:
                    return self.events.pop(i)
            self.events.append(self._message(deadline))

    def open(self, path: str) -> None:
        self.events.clear()
        self.call("Page.navigate", {"url": "file://" + os.path.abspath(path)}, self.session)
        self.wait_event("Page.loadEventFired")

    def _evaluate(self, js: str, context: int | None = None):
        params = {"expression": js, "awaitPromise": True, "returnByValue": True}
        if context is not None:
            params["contextId"] = context
        got = self.call("Runtime.evaluate", params, self.session)
        assert "exceptionDetails" not in got, got["exceptionDetails"]
        return got["result"].get("value")

    def eval(self, js: str):
        return self._evaluate(js)

    def frames(self) -> list[dict]:
        """Every frame of the tab below the top one: {"id", "name", "url"} (``url``: its first 200 characters)."""
        out, todo = [], list(self.call("Page.getFrameTree", session=self.session)["frameTree"].get("childFrames", []))
        while todo:
            node = todo.pop(0)
            frame = node["frame"]
            out.append({"id": frame["id"], "name": frame.get("name", ""), "url": frame["url"][:200]})
            todo += node.get("childFrames", [])
        return out

    def eval_in(self, frame_id: str, js: str):
        world = self.call("Page.createIsolatedWorld", {"frameId": frame_id}, self.session)["executionContextId"]
        return self._evaluate(js, world)
