"""A local stand-in for the part of the Hugging Face Hub API that ``create_repo`` and
``upload_folder`` use (repo creation, pre-upload, commit): files come inline in the commit
("regular" upload mode), and each commit's files are kept in ``HubStandIn.files``."""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import threading

import yaml


class HubStandIn:
    def __init__(self) -> None:
        self.repos: set[str] = set()
        self.files: dict[tuple[str, str], bytes] = {}  # (repo id, path in repo) -> bytes
        self.commits: list[tuple[str, str]] = []  # (repo id, commit message)
        self.cards: list[object] = []  # each README.md front matter validated, parsed
        self.unknown: list[str] = []  # requests the stand-in does not serve
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> HubStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self):
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, code: int, doc: object) -> None:
                body = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                hub.unknown.append(f"GET {self.path}")
                self._send(404, {"error": "not served by the stand-in"})

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts == ["api", "validate-yaml"]:  # the model card's front matter must be YAML
                    text = json.loads(body)["content"]
                    try:
                        front = yaml.safe_load(text.split("---")[1]) if text.startswith("---") else None
                    except yaml.YAMLError as err:
                        return self._send(400, {"errors": [{"message": str(err)}]})
                    hub.cards.append(front)
                    return self._send(200, {"errors": [], "warnings": []})
                if parts == ["api", "repos", "create"]:
                    doc = json.loads(body)
                    repo = f"{doc['organization']}/{doc['name']}" if doc.get("organization") else doc["name"]
                    hub.repos.add(repo)
                    return self._send(200, {"url": f"{hub.endpoint}/{repo}", "name": repo})
                if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("preupload", "commit"):
                    repo = f"{parts[2]}/{parts[3]}"
                    if repo not in hub.repos:
                        return self._send(404, {"error": f"repository {repo} not found"})
                    if parts[4] == "preupload":
                        files = json.loads(body)["files"]
                        return self._send(200, {"files": [
                            {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files
                        ]})  # fmt: skip
                    return self._commit(repo, body)
                hub.unknown.append(f"POST {self.path}")
                self._send(404, {"error": "not served by the stand-in"})

            def _commit(self, repo: str, body: bytes) -> None:
                message = ""
                for line in body.decode().splitlines():
                    item = json.loads(line)
                    if item["key"] == "header":
                        message = item["value"].get("summary", "")
                    elif item["key"] == "file":
                        hub.files[(repo, item["value"]["path"])] = base64.b64decode(item["value"]["content"])
                hub.commits.append((repo, message))
                oid = hashlib.sha1(body).hexdigest()
                self._send(200, {"commitUrl": f"{hub.endpoint}/{repo}/commit/{oid}", "commitOid": oid})

        return Handler
