"""A Hugging Face Hub of the tests' own: a real HTTP server that answers the endpoints
``huggingface_hub`` calls (model info, tree listing, file resolve with ranges), as the Hub
answers them (its X-Error-Code headers for missing repositories, revisions and files, 401 for
a gated repository without a token), so tidegate is tested through huggingface_hub itself with
``HF_ENDPOINT`` pointed here. It counts what it serves: a test sees which files were fetched,
how often, and from which byte.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

TOKEN = "hf_emulator_token"


@dataclass
class Repo:
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> path -> data
    gated: bool = False
    # Sizes the listing states instead of the data's (a repository too big for the disk).
    stated_sizes: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Served:
    """One request for a file's bytes."""

    repo_id: str
    path: str
    start: int  # the Range's first byte (0 without one)
    sent: int  # bytes written


class HubEmulator:
    """``with HubEmulator() as hub: hub.add(...); env HF_ENDPOINT=hub.url``."""

    def __init__(self, port: int = 0) -> None:
        self.repos: dict[str, Repo] = {}
        self.served: list[Served] = []
        self.requests: Counter[str] = Counter()  # "GET /api/models/..." -> count
        # (repo, path) -> bytes after which each GET of it is cut off (the connection closes
        # early), and how many GETs to cut.
        self.cuts: dict[tuple[str, str], tuple[int, int]] = {}
        # (repo, path) -> an event each GET of it waits for before sending (overlapping
        # downloads).
        self.holds: dict[tuple[str, str], threading.Event] = {}
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", port), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> HubEmulator:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def add(self, repo_id: str, files: Mapping[str, bytes | Path], *, revision: str = "main",
            gated: bool = False) -> str:
        """A commit holding ``files`` (a Path: a file's bytes, or a directory's files) as
        ``revision`` of ``repo_id``; returns the commit's hash."""
        data = dict(_read(files))
        commit = hashlib.sha1(repr(sorted((p, hashlib.sha256(d).hexdigest())
                                          for p, d in data.items())).encode()
                              + revision.encode()).hexdigest()
        repo = self.repos.setdefault(repo_id, Repo())
        repo.commits[commit] = data
        repo.refs[revision] = commit
        repo.gated = repo.gated or gated
        return commit

    def downloads(self, repo_id: str | None = None) -> Counter[str]:
        """File path -> GETs of its bytes (of ``repo_id``, else all as "repo/path")."""
        with self._lock:
            return Counter(s.path if repo_id else f"{s.repo_id}/{s.path}" for s in self.served
                           if repo_id is None or s.repo_id == repo_id)

    # ------------------------------------------------------------ answers

    def resolve(self, repo_id: str, revision: str) -> tuple[Repo, str] | tuple[int, str]:
        repo = self.repos.get(repo_id)
        if repo is None:
            return 401, "RepoNotFound"
        commit = revision if revision in repo.commits else repo.refs.get(revision)
        if commit is None:
            return 404, "RevisionNotFound"
        return repo, commit

    def info(self, repo_id: str, repo: Repo, commit: str) -> dict:
        files = repo.commits[commit]
        return {"id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                "gated": "manual" if repo.gated else False, "disabled": False,
                "siblings": [{"rfilename": p, "size": repo.stated_sizes.get(p, len(d)),
                              "blobId": _git_oid(d)} for p, d in sorted(files.items())]}

    def tree(self, repo: Repo, commit: str, under: str, recursive: bool) -> list[dict]:
        prefix = f"{under}/" if under else ""
        entries: dict[str, dict] = {}
        for path, data in sorted(repo.commits[commit].items()):
            if not path.startswith(prefix):
                continue
            rest = path[len(prefix):]
            if "/" in rest and not recursive:
                folder = prefix + rest.split("/", 1)[0]
                entries[folder] = {"type": "directory", "path": folder, "oid": "0" * 40,
                                   "size": 0}
                continue
            entries[path] = {"type": "file", "path": path, "oid": _git_oid(data),
                             "size": repo.stated_sizes.get(path, len(data))}
        return list(entries.values())

    def record(self, served: Served) -> None:
        with self._lock:
            self.served.append(served)

    def cut(self, repo_id: str, path: str) -> int | None:
        """Bytes after which this GET is cut, or None."""
        with self._lock:
            after, times = self.cuts.get((repo_id, path), (0, 0))
            if times <= 0:
                return None
            self.cuts[(repo_id, path)] = (after, times - 1)
            return after


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a client a test killed: expected
            super().handle_error(request, client_address)


def _handler(hub: HubEmulator) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet: tests read hub's counters
            pass

        def do_GET(self) -> None:
            self._answer(body=True)

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def _answer(self, body: bool) -> None:
            url = urlsplit(self.path)
            parts = [unquote(p) for p in url.path.strip("/").split("/")]
            with hub._lock:
                hub.requests[f"{self.command} {url.path}"] += 1
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                self._api(parts[2] + "/" + parts[3], parts[4:], url.query)
            elif len(parts) >= 5 and parts[2] == "resolve":
                self._file(parts[0] + "/" + parts[1], parts[3], "/".join(parts[4:]), body)
            else:
                self._error(404, "", "not an emulated endpoint")

        def _api(self, repo_id: str, rest: list[str], query: str) -> None:
            revision = "main"
            if rest[:1] == ["revision"] and len(rest) >= 2:
                revision = rest[1]
            elif rest[:1] == ["tree"] and len(rest) >= 2:
                revision = rest[1]
            found = hub.resolve(repo_id, revision)
            if isinstance(found[0], int):
                self._error(found[0], str(found[1]), f"{found[1]}: {repo_id}@{revision}")
                return
            repo, commit = found  # type: ignore[misc]
            if rest[:1] == ["tree"]:
                recursive = "recursive=true" in query.lower()
                self._json(hub.tree(repo, commit, "/".join(rest[2:]), recursive))
            else:
                self._json(hub.info(repo_id, repo, commit))

        def _file(self, repo_id: str, revision: str, path: str, body: bool) -> None:
            found = hub.resolve(repo_id, revision)
            if isinstance(found[0], int):
                self._error(found[0], str(found[1]), f"{found[1]}: {repo_id}@{revision}")
                return
            repo, commit = found  # type: ignore[misc]
            if repo.gated and self.headers.get("Authorization") != f"Bearer {TOKEN}":
                self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You "
                            f"must have access to it and be authenticated to access it.")
                return
            data = repo.commits[commit].get(path)
            if data is None:
                self._error(404, "EntryNotFound", f"{path} does not exist", commit=commit)
                return
            start, end = 0, len(data)  # end: exclusive
            ranged = self.headers.get("Range", "")
            if ranged.startswith("bytes="):
                first, _, last = ranged[6:].partition("-")
                start = int(first or 0)
                end = min(end, int(last) + 1) if last else end
            whole = (start, end) == (0, len(data))
            self.send_response(200 if whole else 206)
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(end - start))
            if not whole:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            self.end_headers()
            if not body:
                return
            hold = hub.holds.get((repo_id, path))
            if hold is not None:
                hold.wait(60)
            cut = hub.cut(repo_id, path)
            chunk = data[start:end] if cut is None else data[start:min(end, start + cut)]
            try:
                self.wfile.write(chunk)
            except OSError:  # the client went away (a test killed it)
                self.close_connection = True
                return
            hub.record(Served(repo_id, path, start, len(chunk)))
            if cut is not None:
                self.wfile.flush()
                self.close_connection = True

        def _json(self, value: object) -> None:
            raw = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(raw)

        def _error(self, status: int, code: str, message: str, commit: str | None = None) -> None:
            raw = json.dumps({"error": message}).encode()
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            if commit:
                self.send_header("X-Repo-Commit", commit)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(raw)

    return Handler


def _read(files: Mapping[str, bytes | Path]) -> Iterator[tuple[str, bytes]]:
    for name, value in files.items():
        if isinstance(value, bytes):
            yield name, value
        elif value.is_dir():
            for path in sorted(value.rglob("*")):
                if path.is_file():
                    yield f"{name}/{path.relative_to(value).as_posix()}".lstrip("/"), \
                        path.read_bytes()
        else:
            yield name, value.read_bytes()


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
