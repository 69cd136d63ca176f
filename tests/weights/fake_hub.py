"""A fake Hugging Face Hub on loopback: the routes `huggingface_hub` 2.x calls for
`snapshot_download`, `hf_hub_download`, `model_info` and `list_repo_files`, over repos the
test builds in memory. Every request is logged, so a test can count the file downloads.

Routes: `GET /api/models/{repo}[/revision/{rev}]` (the commit `sha`, `siblings`, `gated`),
`GET /api/models/{repo}/tree/{rev}` (the recursive file listing), `HEAD|GET
/{repo}/resolve/{rev}/{path}` (`X-Repo-Commit`, `ETag`, `Content-Length`, `Range`). Errors carry
the `X-Error-Code` header the library maps to its exceptions (`RepoNotFound`,
`RevisionNotFound`, `EntryNotFound`, `GatedRepo`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclasses.dataclass
class FakeRepo:
    """A repo: `commits` (sha -> {path: bytes}), `refs` (branch or tag -> sha), gated or not."""

    commits: dict[str, dict[str, bytes]] = dataclasses.field(default_factory=dict)
    refs: dict[str, str] = dataclasses.field(default_factory=dict)
    gated: bool = False

    def commit(self, files: dict[str, bytes], *refs: str) -> str:
        """Adds a commit of `files`, pointed at by `refs` (default `main`); returns its sha."""
        sha = hashlib.sha1(repr(sorted((k, hashlib.sha1(v).hexdigest())
                                       for k, v in files.items())).encode()).hexdigest()
        self.commits[sha] = dict(files)
        for ref in refs or ("main",):
            self.refs[ref] = sha
        return sha

    def commit_folder(self, folder: Path, *refs: str) -> str:
        """Commits every file under `folder` (paths relative to it)."""
        return self.commit({str(p.relative_to(folder)): p.read_bytes()
                            for p in sorted(folder.rglob("*")) if p.is_file()}, *refs)

    def sha(self, revision: str) -> str | None:
        """The commit a branch, tag or full sha names, or None."""
        return revision if revision in self.commits else self.refs.get(revision)


@dataclasses.dataclass
class FakeHub:
    """The server's state: `repos` by id, `log` of (method, repo path) requests, and
    `cut_once`: resolve paths whose next GET breaks off after half the file."""

    repos: dict[str, FakeRepo] = dataclasses.field(default_factory=dict)
    log: list[tuple[str, str, str | None]] = dataclasses.field(default_factory=list)
    cut_once: set[str] = dataclasses.field(default_factory=set)
    url: str = ""
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def repo(self, repo_id: str, gated: bool = False) -> FakeRepo:
        """The repo `repo_id`, created empty if new."""
        return self.repos.setdefault(repo_id, FakeRepo(gated=gated))

    def file_gets(self, repo_id: str | None = None) -> list[str]:
        """The paths of the file GETs (downloads) so far, of one repo or all."""
        prefix = f"/{repo_id}/resolve/" if repo_id else ""
        return [p for m, p, _ in self.log if m == "GET" and "/resolve/" in p
                and p.startswith(prefix)]


def _etag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: FakeHub

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def do_GET(self) -> None:
        self._answer(head=False)

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
              head: bool = False) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, status: int, obj: object, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(obj).encode(),
                   {"Content-Type": "application/json", **(headers or {})})

    def _error(self, status: int, code: str, message: str, head: bool = False,
               extra: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps({"error": message}).encode(),
                   {"X-Error-Code": code, "X-Error-Message": message,
                    "Content-Type": "application/json", **(extra or {})}, head=head)

    def _answer(self, head: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        with self.hub.lock:
            self.hub.log.append((self.command, path, self.headers.get("Range")))
        if path.startswith("/api/models/"):
            return self._api(path[len("/api/models/"):])
        parts = path.lstrip("/").split("/")
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]), head)
        self._error(404, "NotFound", f"no route {path}", head)

    def _api(self, rest: str) -> None:
        parts = rest.split("/")
        repo_id, tail = "/".join(parts[:2]), parts[2:]
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            return self._error(401, "RepoNotFound", "Repository not found")
        revision = tail[1] if len(tail) >= 2 else "main"
        sha = repo.sha(revision)
        if sha is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        files = repo.commits[sha]
        if tail and tail[0] == "tree":
            return self._json(200, [{"type": "file", "path": p, "size": len(d),
                                     "oid": hashlib.sha1(d).hexdigest()}
                                    for p, d in sorted(files.items())])
        self._json(200, {"id": repo_id, "sha": sha, "private": False,
                         "gated": "manual" if repo.gated else False,
                         "siblings": [{"rfilename": p} for p in sorted(files)]})

    def _resolve(self, repo_id: str, revision: str, filename: str, head: bool) -> None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            return self._error(401, "RepoNotFound", "Repository not found", head)
        if repo.gated:
            return self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. "
                               "You must have access to it and be authenticated to access it. "
                               "Please log in.", head)
        sha = repo.sha(revision)
        if sha is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", head)
        data = repo.commits[sha].get(filename)
        if data is None:
            return self._error(404, "EntryNotFound", f"{filename} does not exist", head,
                               {"X-Repo-Commit": sha})
        headers = {"X-Repo-Commit": sha, "ETag": f'"{_etag(data)}"',
                   "Accept-Ranges": "bytes"}
        start = 0
        ranged = self.headers.get("Range")
        if ranged and not head and ranged.startswith("bytes="):
            start = int(ranged[len("bytes="):].split("-")[0])
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        body = data[start:]
        key = f"{repo_id}/{filename}"
        if not head and key in self.hub.cut_once:
            self.hub.cut_once.discard(key)
            self.send_response(200)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        if head:  # HEAD answers the whole file's length
            self.send_response(200)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            return
        self._send(206 if start else 200, body, headers)


def serve_fake_hub() -> tuple[FakeHub, ThreadingHTTPServer]:
    """Starts a fake Hub on 127.0.0.1 (a free port) in a daemon thread; returns its state
    (`hub.url` is the endpoint) and the server (`shutdown()` stops it)."""
    hub = FakeHub()
    handler = type("Handler", (_Handler,), {"hub": hub})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return hub, server
