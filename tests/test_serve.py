"""`actcache serve`: real HTTP requests to a real server on a free local port serve the files
under RUNS_DIR (an explorer's index and a data chunk), and nothing else: no traversal out of it,
no symbolic link out of it, no listing; a missing folder or a port in use is one line, exit 2."""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import threading
import urllib.request

import pytest

from actcache import cli
from actcache.serve import make_server, page_urls


@pytest.fixture
def served(tmp_path):
    runs = tmp_path / "runs"
    ex = runs / "HASH" / "sae1" / "visuals" / "explorer"
    (ex / "data").mkdir(parents=True)
    (ex / "index.html").write_text("<!DOCTYPE html><title>explorer</title>")
    (ex / "data" / "meta.js").write_text('actcache_chunk("meta", {"format": 1});\n')
    (runs / "HASH" / "visuals").mkdir()
    (runs / "HASH" / "visuals" / "index.html").write_text("sweep")
    (runs / "HASH" / "visuals" / "sweep.json").write_text("{}")
    (tmp_path / "secret.txt").write_text("not served")
    os.symlink(tmp_path / "secret.txt", ex / "link.txt")
    server = make_server(str(runs), "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield runs, server
    server.shutdown()
    server.server_close()


def get(server, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_serves_the_explorers_files_and_lists_their_urls(served):
    runs, server = served
    host, port = server.server_address[:2]
    assert page_urls(str(runs), server) == [
        f"http://{host}:{port}/HASH/sae1/visuals/explorer/index.html",
        f"http://{host}:{port}/HASH/visuals/index.html",
    ]
    assert get(server, "/HASH/sae1/visuals/explorer/index.html") == (200, b"<!DOCTYPE html><title>explorer</title>")
    status, body = get(server, "/HASH/sae1/visuals/explorer/data/meta.js")
    assert status == 200 and body.startswith(b'actcache_chunk("meta"')


@pytest.mark.parametrize("path", ["/../secret.txt", "/HASH/../../secret.txt", "/%2e%2e/secret.txt",
                                  "/HASH/sae1/visuals/explorer/link.txt", "/HASH/", "/"])  # fmt: skip
def test_nothing_outside_runs_dir_and_no_listing(served, path):
    _, server = served
    status, body = get(server, path)
    assert status == 404 and b"not served" not in body


def test_missing_folder_and_port_in_use_are_one_line_exit_2(tmp_path, capsys):
    assert cli.main(["serve", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such folder" in err and "Traceback" not in err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert cli.main(["serve", str(tmp_path), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"port {port} on 127.0.0.1 is in use; pass another with --port P." in err


def test_the_command_prints_each_explorers_url_and_serves_it(served):
    runs, _ = served
    proc = subprocess.Popen([sys.executable, "-m", "actcache.cli", "serve", str(runs), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        first = proc.stdout.readline().strip()
        assert first.startswith("http://127.0.0.1:") and first.endswith("/HASH/sae1/visuals/explorer/index.html")
        with urllib.request.urlopen(first, timeout=10) as r:
            assert r.status == 200 and b"explorer" in r.read()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
