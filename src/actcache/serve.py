"""`actcache serve RUNS_DIR`: the explorers and pages under a folder over local HTTP, read-only.

    server = make_server(runs_dir, "127.0.0.1", 8000)   # ServeError: missing folder, port in use
    for url in page_urls(runs_dir, server): print(url)
    server.serve_forever()

For a browser whose file:// limits bite (the explorer itself opens from disk). Only GET and HEAD
of regular files whose real path (symbolic links resolved) lies under RUNS_DIR are answered;
everything else, directory listings included, is a 404. Standard library only.
"""

from __future__ import annotations

import errno
import functools
import http.server
import os

from actcache.errors import ActCacheError
from actcache.rundir import EXPLORER_DIR, PAGE_FILE, SWEEP_FILE, VISUALS_DIR


class ServeError(ActCacheError):
    """`actcache serve` cannot start."""


class _Handler(http.server.SimpleHTTPRequestHandler):
    root = ""

    def send_head(self):
        got = os.path.realpath(self.translate_path(self.path))
        if not (got.startswith(self.root + os.sep) and os.path.isfile(got)):
            self.send_error(404, "not a file under the served folder")
            return None
        return super().send_head()

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        pass


def make_server(runs_dir: str, host: str = "127.0.0.1", port: int = 8000) -> http.server.ThreadingHTTPServer:
    """A server of ``runs_dir``'s files (not yet serving; port 0 picks a free one)."""
    if not os.path.isdir(runs_dir):
        raise ServeError(f"{runs_dir}: no such folder; pass the runs_to folder holding the SAE runs.")
    root = os.path.realpath(runs_dir)
    handler = type("Handler", (_Handler,), {"root": root})
    try:
        return http.server.ThreadingHTTPServer((host, port), functools.partial(handler, directory=root))
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise ServeError(f"port {port} on {host} is in use; pass another with --port P.") from None
        raise ServeError(f"cannot listen on {host}:{port}: {err.strerror}; pass another --host or --port.") from None


def page_urls(runs_dir: str, server) -> list[str]:
    """The URL of every explorer and sweep page under ``runs_dir``, sorted."""
    host, port = server.server_address[:2]
    root = os.path.realpath(runs_dir)
    found = []
    for d, subdirs, files in os.walk(root):
        subdirs.sort()
        rel = os.path.relpath(d, root).replace(os.sep, "/")
        is_explorer = d.endswith(os.sep + os.path.join(VISUALS_DIR, EXPLORER_DIR))
        is_sweep = os.path.basename(d) == VISUALS_DIR and os.path.isfile(os.path.join(d, SWEEP_FILE))
        if PAGE_FILE in files and (is_explorer or is_sweep):
            found.append(f"http://{host}:{port}/{'' if rel == '.' else rel + '/'}{PAGE_FILE}")
        if is_explorer:
            subdirs[:] = []  # its data/ and img/ hold no pages
    return sorted(found)
