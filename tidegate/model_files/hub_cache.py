"""Hub models on this machine: fetched through ``huggingface_hub`` into its standard cache
(``HF_HUB_CACHE``, else ``HF_HOME``/hub, else ~/.cache/huggingface/hub), so a model that
transformers, vLLM or ``huggingface-cli`` downloaded is used without a download, and
``HF_HUB_OFFLINE=1`` serves from the cache alone.

Only the files a spec needs are fetched (``hub_spec.choose_files``), with huggingface_hub's
progress bar, its resumable ``.incomplete`` files and its per-file locks (two workers starting
together download each file once). Every failure is a ``HubSpecError`` of one line: no such
repository, gated, no such revision, no network, nothing loadable, too little disk.
The environment is read at each call, not at import, so one process can serve several caches.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tidegate.log_redactor import REDACTOR
from tidegate.model_files.hub_spec import (
    INDEX_FILE,
    HubSpec,
    HubSpecError,
    Need,
    Selection,
    choose_files,
    quant_label,
    shards_of_index,
)

DEFAULT_ENDPOINT = "https://huggingface.co"
# The API reads a GGUF's tokenizer from its header alone: the first bytes of the file, fetched
# with range requests growing 4x from this until the header parses (a 150k-token vocabulary's
# header is ~8 MB: 6 requests), kept beside the Hub's cache.
HEADER_START_BYTES = 16 << 10
HEADER_MAX_BYTES = 1 << 30
HEADERS_DIR = "tidegate-gguf-headers"
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
_TRUE = {"1", "ON", "YES", "TRUE"}


@dataclass(frozen=True, slots=True)
class HubModel:
    """A spec's files, present in the cache."""

    spec: HubSpec
    commit: str
    snapshot: Path  # <cache>/models--org--name/snapshots/<commit>
    selection: Selection
    header: Path | None = None  # a GGUF's header alone (the API's need), else None

    @property
    def path(self) -> Path:
        """What the loaders read: the snapshot directory, the .gguf file in it, or its header."""
        gguf = self.selection.gguf
        if self.header is not None:
            return self.header
        return self.snapshot / gguf if gguf is not None else self.snapshot


@dataclass(frozen=True, slots=True)
class CachedModel:
    """One revision of a model repository in the cache (``tidegate models``)."""

    repo_id: str
    revision: str  # its branch or tag names and short commit: "main (1a2b3c4)"
    format: str  # "safetensors", "gguf Q4_0, Q8_0", "tokenizer only" or "other"
    size_bytes: int
    path: Path


def cache_dir() -> Path:
    """huggingface_hub's model cache, from the environment as it is now."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE


def fetch_model(spec: HubSpec, need: Need = "weights") -> HubModel:
    """The spec's files in the cache, downloading what is missing (unless offline)."""
    if offline():
        return _from_cache(spec, need, "HF_HUB_OFFLINE=1 forbids a download; run `tidegate pull "
                           f"{spec.text}` where the Hub is reachable, or unset HF_HUB_OFFLINE")
    try:
        commit, files = _listing(spec)
    except Exception as exc:
        if not _unreachable(exc):
            raise _hub_error(spec, exc) from None
        return _from_cache(spec, need, f"cannot reach the Hub at {endpoint()} ({_reason(exc)}); "
                           f"check the network, or set HF_HUB_OFFLINE=1 to use only the cache")
    selection = choose_files(spec, files, need)
    try:
        if need == "tokenizer" and selection.gguf is not None:
            return _gguf_header(spec, commit, selection)
        return _download(spec, commit, files, selection)
    except HubSpecError:
        raise
    except Exception as exc:
        raise _hub_error(spec, exc) from None


def cached_models() -> list[CachedModel]:
    """Every model revision in the cache, by repository then revision."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(cache_dir())
    except CacheNotFound:
        return []
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: (not r.refs, sorted(r.refs))):
            names = ", ".join(sorted(rev.refs))
            revision = f"{names} ({rev.commit_hash[:7]})" if names else rev.commit_hash[:7]
            out.append(CachedModel(repo.repo_id, revision, _format(rev.files), rev.size_on_disk,
                                   Path(rev.snapshot_path)))
    return out


# ---------------------------------------------------------------- the Hub


def _listing(spec: HubSpec) -> tuple[str, dict[str, int]]:
    """The revision's commit and its files with their sizes (one request)."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint(), token=_token())
    info = api.model_info(spec.repo_id, revision=spec.revision, files_metadata=True)
    if info.sha is None:
        raise HubSpecError(f"model {spec.text!r}: {endpoint()} answered without a commit; is "
                           f"HF_ENDPOINT a Hugging Face Hub?")
    return info.sha, {s.rfilename: int(s.size or 0) for s in info.siblings or []}


def _download(spec: HubSpec, commit: str, files: dict[str, int],
              selection: Selection) -> HubModel:
    from huggingface_hub import hf_hub_download, snapshot_download

    common: dict[str, Any] = dict(cache_dir=str(cache_dir()), endpoint=endpoint(),
                                  token=_token())
    wanted = list(selection.files)
    if INDEX_FILE in wanted:  # the index names the shards to fetch
        index = Path(hf_hub_download(spec.repo_id, INDEX_FILE, revision=commit, **common))
        wanted += _shards(index, spec, files)
    _check_disk(spec, wanted, files, _snapshot(spec, commit))
    folder = snapshot_download(spec.repo_id, revision=spec.revision or "main",
                               allow_patterns=[glob.escape(f) for f in wanted], **common)
    return HubModel(spec, Path(str(folder)).name, Path(str(folder)), selection)


def _gguf_header(spec: HubSpec, commit: str, selection: Selection) -> HubModel:
    """A GGUF's metadata (tokenizer, context length) without its tensors: the whole file if the
    cache holds it, else a prefix that holds the header, fetched by range requests."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    from tidegate.model_files.gguf_file import GGUFTruncatedError, read_gguf_header

    assert selection.gguf is not None
    snapshot = _snapshot(spec, commit)
    found = _header_or_file(spec, commit, snapshot, selection)
    if found is not None:
        return found
    url = hf_hub_url(spec.repo_id, selection.gguf, revision=commit, endpoint=endpoint())
    headers = build_hf_headers(token=_token())
    target = _header_path(spec, commit, selection.gguf)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.incomplete")
    data, want = b"", HEADER_START_BYTES
    try:
        while True:
            headers["Range"] = f"bytes={len(data)}-{want - 1}"
            answer = get_session().get(url, headers=headers, follow_redirects=True,
                                       timeout=60)
            hf_raise_for_status(answer)
            data = answer.content if answer.status_code == 200 else data + answer.content
            partial.write_bytes(data)
            try:
                read_gguf_header(partial, arrays=True, tensors=False)
                break
            except GGUFTruncatedError:
                if len(data) < want or want >= HEADER_MAX_BYTES:  # the file ended: it is cut
                    raise
                want *= 4
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    ref = _headers(spec) / "refs" / (spec.revision or "main")  # for offline starts
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(commit)
    return HubModel(spec, commit, snapshot, selection, target)


def _header_or_file(spec: HubSpec, commit: str, snapshot: Path,
                    selection: Selection) -> HubModel | None:
    assert selection.gguf is not None
    if (snapshot / selection.gguf).is_file():
        return HubModel(spec, commit, snapshot, selection)
    header = _header_path(spec, commit, selection.gguf)
    return HubModel(spec, commit, snapshot, selection, header) if header.is_file() else None


def _header_path(spec: HubSpec, commit: str, gguf: str) -> Path:
    return _headers(spec) / commit / gguf


def _shards(index: Path, spec: HubSpec, files: dict[str, int]) -> list[str]:
    try:
        data = json.loads(index.read_text())
    except (OSError, ValueError) as exc:
        raise HubSpecError(f"model {spec.text!r}: cannot read {INDEX_FILE}: {exc}") from None
    shards = shards_of_index(data if isinstance(data, dict) else {},
                             f"model {spec.text!r}: {INDEX_FILE}")
    absent = [s for s in shards if s not in files]
    if absent:
        raise HubSpecError(f"model {spec.text!r}: {INDEX_FILE} names shards the repository "
                           f"does not hold ({', '.join(absent[:3])})")
    return shards


def _check_disk(spec: HubSpec, wanted: list[str], files: dict[str, int], snapshot: Path) -> None:
    """Refuse before downloading what the cache's disk cannot hold (huggingface_hub only
    warns, then fails midway with a partial file)."""
    missing = sum(files.get(f, 0) for f in wanted if not (snapshot / f).exists())
    if not missing:
        return
    where = cache_dir()
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if missing > free:
        raise HubSpecError(f"model {spec.text!r}: needs {human_size(missing)} in {where}, which has "
                           f"{human_size(free)} free; free space or point HF_HUB_CACHE elsewhere")


# ---------------------------------------------------------------- the cache alone


def _from_cache(spec: HubSpec, need: Need, why: str) -> HubModel:
    """The spec served from the cache as it is: the revision's commit from refs/, the files
    from the cached tree listing (else what the snapshot holds; for the API, a GGUF's header
    too)."""
    revision = spec.revision or "main"
    commit = revision if _COMMIT_RE.match(revision) else (
        _read(_storage(spec) / "refs" / revision)
        or (_read(_headers(spec) / "refs" / revision) if need == "tokenizer" else None))
    snapshot = _snapshot(spec, commit) if commit else None
    headers = list(_present(_headers(spec) / commit)) if commit and need == "tokenizer" else []
    if snapshot is None or commit is None or not (snapshot.is_dir() or headers):
        what = spec.repo_id if spec.revision is None else f"{spec.repo_id}@{spec.revision}"
        raise HubSpecError(f"model {spec.text!r}: {what} is not in the cache {cache_dir()} and "
                           f"{why}")
    files = (_cached_tree(spec, commit) or dict.fromkeys(_present(snapshot), 0)) | dict.fromkeys(
        headers, 0)
    selection = choose_files(spec, files, need)
    if need == "tokenizer" and selection.gguf is not None:
        found = _header_or_file(spec, commit, snapshot, selection)
        if found is not None:
            return found
    wanted = list(selection.files)
    if INDEX_FILE in wanted and (snapshot / INDEX_FILE).is_file():
        wanted += _shards(snapshot / INDEX_FILE, spec, files)
    absent = [f for f in wanted if not (snapshot / f).is_file()]
    if absent:
        raise HubSpecError(f"model {spec.text!r}: the cache {cache_dir()} holds only part of it "
                           f"(missing {', '.join(absent[:3])}) and {why}")
    return HubModel(spec, commit, snapshot, selection)


def _cached_tree(spec: HubSpec, commit: str) -> dict[str, int] | None:
    try:
        from huggingface_hub import get_cached_repo_tree
        from huggingface_hub.errors import CachedRepoTreeNotFoundError
    except ImportError:  # older huggingface_hub: no tree listing on disk
        return None
    try:
        tree = get_cached_repo_tree(spec.repo_id, revision=commit, cache_dir=str(cache_dir()))
    except CachedRepoTreeNotFoundError:
        return None
    return {f.path: int(f.size or 0) for f in tree}


def _present(folder: Path) -> Iterator[str]:
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not path.name.endswith(".incomplete"):
            yield path.relative_to(folder).as_posix()


def _folder(spec: HubSpec) -> str:
    """The repository's folder name, as huggingface_hub names it in its cache."""
    return f"models--{spec.repo_id.replace('/', '--')}"


def _storage(spec: HubSpec) -> Path:
    return cache_dir() / _folder(spec)


def _snapshot(spec: HubSpec, commit: str) -> Path:
    return _storage(spec) / "snapshots" / commit


def _headers(spec: HubSpec) -> Path:
    """Where the API's GGUF headers lie (``<commit>/<file>``, ``refs/<revision>``): beside the
    Hub's cache, not in it, since huggingface_hub's cache scan reads every folder there."""
    return cache_dir().parent / HEADERS_DIR / _folder(spec)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


# ---------------------------------------------------------------- errors and formats


def _hub_error(spec: HubSpec, exc: BaseException) -> HubSpecError:
    """huggingface_hub's exception as one line naming the spec and what to do."""
    from huggingface_hub import errors

    where = f"model {spec.text!r}"
    if isinstance(exc, errors.GatedRepoError):
        if _token():
            return HubSpecError(f"{where}: {spec.repo_id} is gated and the token in HF_TOKEN "
                                f"has no access; accept its terms at {endpoint()}/{spec.repo_id}")
        return HubSpecError(f"{where}: {spec.repo_id} is gated; accept its terms at "
                            f"{endpoint()}/{spec.repo_id} and set HF_TOKEN to a token with access")
    if isinstance(exc, errors.RevisionNotFoundError):
        return HubSpecError(f"{where}: {spec.repo_id} has no revision {spec.revision!r} (a "
                            f"branch, tag or commit)")
    if isinstance(exc, errors.RepositoryNotFoundError):
        private = "" if _token() else "; if it is private, set HF_TOKEN"
        return HubSpecError(f"{where}: no repository {spec.repo_id} on {endpoint()} and no "
                            f"local path of that name{private}")
    if isinstance(exc, errors.RemoteEntryNotFoundError):
        return HubSpecError(f"{where}: a file of {spec.repo_id} went missing on the Hub "
                            f"({_reason(exc)}); try again")
    if _unreachable(exc):
        return HubSpecError(f"{where}: the download from {endpoint()} failed ({_reason(exc)}); "
                            f"run it again to resume, or set HF_HUB_OFFLINE=1 to use the cache")
    return HubSpecError(f"{where}: {type(exc).__name__}: {_reason(exc)}")


def _unreachable(exc: BaseException) -> bool:
    """A connection that failed or timed out (httpx's, httpx2's or the OS's), anywhere in the
    exception's chain."""
    seen: BaseException | None = exc
    while seen is not None:
        names = {cls.__name__ for cls in type(seen).__mro__}
        # (OfflineModeIsEnabled is a ConnectionError: huggingface_hub's offline switch as
        # read when it was imported.)
        if names & {"TransportError", "TimeoutException", "ConnectionError", "TimeoutError"}:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:200] or type(exc).__name__


def _token() -> str | None:
    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") or None
    if token:  # whatever huggingface_hub or an error message logs, the token is not shown
        REDACTOR.add_secret(token)
    return token


def _format(files: Any) -> str:
    names = [f.file_name for f in files]
    paths = [str(f.file_path) for f in files]
    ggufs = sorted({quant_label(p) or Path(p).stem for p in paths if p.endswith(".gguf")})
    if ggufs:
        return "gguf " + ", ".join(ggufs)
    if any(n.endswith(".safetensors") for n in names):
        return "safetensors"
    if "tokenizer.json" in names:
        return "tokenizer only"
    return "other"


def human_size(n: float) -> str:
    """Bytes in decimal units, as ``ollama list`` and the Hub show them."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
