"""A local stand-in for the Hugging Face hub: the endpoints `ninfer pull` (through huggingface_hub)
calls, with switchable faults and a log of every request.

  GET  /api/models/{repo}[/revision/{rev}]   model info; siblings carry size, blobId and, for LFS
                                             files, lfs {size, sha256, pointerSize} (as with ?blobs=True)
  GET  /{repo}/resolve/{rev}/{path}          regular files: 200 with ETag (git blob id), X-Repo-Commit;
                                             LFS files: 302 to /cdn/{sha256} with X-Linked-Etag / X-Linked-Size
  GET  /cdn/{sha256}                         LFS content
Any other path answers 404 (huggingface_hub 2.x also asks for /api/agent-harnesses).
Content answers honour `Range: bytes=N-` (206 + Content-Range, 416 past the end). Errors carry
X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo) as the hub's do.

Faults (`hub.faults`): the next N requests fail with 5xx; the next N long content bodies stop
early although Content-Length promised more; named files are served with one byte flipped; a delay
between chunks makes streams slow enough to interrupt.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

CHUNK = 16 * 1024
LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    sha = hashlib.sha256(data).hexdigest()
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {len(data)}\n".encode()


@dataclass
class Faults:
    fail_next: int = 0  # answer the next N requests (to the endpoints above) with fail_status
    fail_status: int = 503
    truncate_next: int = 0  # the next N content bodies longer than truncate_after stop there
    truncate_after: int = 100_000
    corrupt: set[str] = field(default_factory=set)  # files served with one byte flipped
    chunk_delay: float = 0.0  # seconds slept between 16 KiB chunks


@dataclass
class LoggedRequest:
    method: str
    path: str
    range: str | None
    status: int = 0
    body_bytes: int = 0  # content bytes actually written
    file: str | None = None  # the repo file a content request served


@dataclass
class Repo:
    repo_id: str
    commits: dict[str, dict[str, bytes]]  # commit -> {path: content}
    refs: dict[str, str]  # branch -> commit
    lfs: set[str]
    token: str | None  # required as "Authorization: Bearer {token}" to download (a gated repo)


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.faults = Faults()
        self.log: list[LoggedRequest] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    # ---- content ------------------------------------------------------------------------------

    def add_repo(self, repo_id: str, files: dict[str, bytes], lfs: set[str] | None = None,
                 token: str | None = None) -> str:
        """Publish a repository (branch main); returns its commit hash."""
        lfs = set(lfs) if lfs is not None else {n for n in files if n.endswith(LFS_SUFFIXES)}
        self.repos[repo_id] = Repo(repo_id, {}, {}, lfs, token)
        return self.push(repo_id, files)

    def push(self, repo_id: str, files: dict[str, bytes]) -> str:
        """A new commit on main with these files; older commits stay resolvable."""
        repo = self.repos[repo_id]
        digest = hashlib.sha1(repo_id.encode() + str(len(repo.commits)).encode())
        for name in sorted(files):
            digest.update(name.encode() + files[name])
        commit = digest.hexdigest()
        repo.commits[commit] = dict(files)
        repo.refs["main"] = commit
        return commit

    def sibling(self, repo: Repo, name: str, data: bytes) -> dict:
        if name in repo.lfs:
            pointer = lfs_pointer(data)
            return {"rfilename": name, "size": len(data), "blobId": git_blob_id(pointer),
                    "lfs": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": len(pointer)}}
        return {"rfilename": name, "size": len(data), "blobId": git_blob_id(data)}

    def requests_for(self, name: str) -> list[LoggedRequest]:
        """Content requests (resolve of a regular file, CDN for LFS) that served `name`."""
        return [r for r in self.log if r.file == name]

    # ---- server -------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> "FakeHub":
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        assert self._server is not None
        self._server.shutdown()
        self._server.server_close()

    def take_fault(self, name: str) -> bool:
        """Consume one unit of a counted fault."""
        with self._lock:
            left = getattr(self.faults, name)
            if left > 0:
                setattr(self.faults, name, left - 1)
                return True
            return False


def _make_handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep pytest output clean
            pass

        def do_HEAD(self) -> None:
            self.handle_request(send_body=False)

        def do_GET(self) -> None:
            self.handle_request(send_body=True)

        # -- dispatch ---------------------------------------------------------------------------

        def handle_request(self, send_body: bool) -> None:
            path = urlsplit(self.path).path
            self.entry = LoggedRequest(self.command, path, self.headers.get("Range"))
            with hub._lock:
                hub.log.append(self.entry)
            self.send_body = send_body
            parts = [unquote(p) for p in path.strip("/").split("/")]
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                route = lambda: self.model_info(parts[2:])  # noqa: E731
            elif len(parts) >= 5 and parts[2] == "resolve":
                route = lambda: self.resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]))  # noqa: E731
            elif len(parts) == 2 and parts[0] == "cdn":
                route = lambda: self.cdn(parts[1])  # noqa: E731
            else:  # other hub APIs huggingface_hub may call on its own: absent here, and fault-free
                return self.error(404, None, "no such endpoint")
            if hub.take_fault("fail_next"):
                return self.error(hub.faults.fail_status, None, "flaky server")
            route()

        def find(self, repo_id: str, revision: str) -> tuple[Repo, str] | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self.error(404, "RepoNotFound", "Repository not found")
                return None
            commit = repo.refs.get(revision, revision)
            if commit not in repo.commits:
                self.error(404, "RevisionNotFound", "Invalid rev id")
                return None
            return repo, commit

        def model_info(self, parts: list[str]) -> None:
            repo_id = "/".join(parts[:2])
            revision = parts[3] if len(parts) >= 4 and parts[2] == "revision" else "main"
            found = self.find(repo_id, revision)
            if found is None:
                return
            repo, commit = found
            files = repo.commits[commit]
            body = json.dumps({
                "id": repo.repo_id, "sha": commit, "private": False, "gated": "auto" if repo.token else False,
                "siblings": [hub.sibling(repo, name, data) for name, data in sorted(files.items())],
            }).encode()
            self.entry.status = 200
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.write_body(body)

        def resolve(self, repo_id: str, revision: str, name: str) -> None:
            found = self.find(repo_id, revision)
            if found is None:
                return
            repo, commit = found
            if repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}":
                return self.error(401, "GatedRepo", "Access to this model is restricted")
            data = repo.commits[commit].get(name)
            if data is None:
                return self.error(404, "EntryNotFound", "Entry not found")
            if name in repo.lfs:
                sha = hashlib.sha256(data).hexdigest()
                self.entry.status = 302
                self.send_response(302)
                self.send_header("Location", f"/cdn/{sha}")
                self.send_header("X-Repo-Commit", commit)
                self.send_header("ETag", f'"{git_blob_id(lfs_pointer(data))}"')
                self.send_header("X-Linked-Etag", f'"{sha}"')
                self.send_header("X-Linked-Size", str(len(data)))
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.content(name, data, {"X-Repo-Commit": commit, "ETag": f'"{git_blob_id(data)}"'})

        def cdn(self, sha: str) -> None:
            for repo in hub.repos.values():
                for files in repo.commits.values():
                    for name, data in files.items():
                        if name in repo.lfs and hashlib.sha256(data).hexdigest() == sha:
                            return self.content(name, data, {"ETag": f'"{sha}"'})
            self.error(404, None, "no such object")

        # -- responses --------------------------------------------------------------------------

        def content(self, name: str, data: bytes, headers: dict[str, str]) -> None:
            self.entry.file = name
            if name in hub.faults.corrupt:
                middle = len(data) // 2
                data = data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:]
            start = 0
            ranged = self.headers.get("Range", "")
            if ranged.startswith("bytes="):
                start = int(ranged[len("bytes="):].split("-")[0])
                if start >= len(data):
                    self.entry.status = 416
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
            body = data[start:]
            self.entry.status = 206 if ranged else 200
            self.send_response(self.entry.status)
            if ranged:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if len(body) > hub.faults.truncate_after and hub.take_fault("truncate_next"):
                body = body[:hub.faults.truncate_after]
                self.close_connection = True
            self.write_body(body)

        def write_body(self, body: bytes) -> None:
            if not self.send_body:
                return
            try:
                for offset in range(0, len(body), CHUNK):
                    if hub.faults.chunk_delay:
                        time.sleep(hub.faults.chunk_delay)
                    chunk = body[offset:offset + CHUNK]
                    self.wfile.write(chunk)
                    self.entry.body_bytes += len(chunk)
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):  # the client went away (a cancelled pull)
                self.close_connection = True

        def error(self, status: int, code: str | None, message: str) -> None:
            body = json.dumps({"error": message}).encode()
            self.entry.status = status
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.write_body(body)

    return Handler
