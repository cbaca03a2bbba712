"""What a Hugging Face Hub model spec names and which of a repository's files serve it.

A spec is ``org/name``, ``org/name@revision`` (a branch, tag or commit), ``org/name:QUANT``
(the GGUF file of that quantization, as llama.cpp's ``-hf`` picks it) or ``org/name/file.gguf``
(a revision may come before the quantization or the file: ``org/name@v2:Q8_0``). Which files a
model needs is decided here from the repository's file list alone, so the choice is plain
Python, tested exactly; ``tidegate/model_files/hub_cache.py`` fetches them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

# The Hub's repository names: letters, digits, '-', '_', '.', at most 96 characters.
_PART_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_QUANT_RE = re.compile(r"^[A-Za-z0-9_]{1,32}$")
# A quantization label at the end of a GGUF file's stem: Q4_K_M, IQ4_XS, Q8_0, F16, BF16.
_LABEL_RE = re.compile(r"(?:^|[-._/])(I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32)$")
_SPLIT_RE = re.compile(r"-\d{5}-of-\d{5}\.gguf$")
# llama.cpp's `-hf org/repo` without a quantization takes Q4_K_M, else the repo's first file.
DEFAULT_QUANT = "Q4_K_M"
# Tokenizer and generation files a model directory may hold; the ones a repo has are fetched.
TOKENIZER_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                   "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
INDEX_FILE = "model.safetensors.index.json"
# Sidecar of GPTQ/AWQ checkpoints (worker/models/loaders/quantized/quantized_safetensors.py).
QUANT_CONFIG_FILE = "quantize_config.json"
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".ckpt", ".h5",
                    ".msgpack", ".onnx", ".npz")

Need = Literal["weights", "tokenizer"]


class HubSpecError(ValueError):
    """A spec or repository that cannot be served; the message is one line naming the spec."""


@dataclass(frozen=True, slots=True)
class HubSpec:
    """A parsed Hub spec; ``text`` is what the user wrote."""

    text: str
    repo_id: str  # org/name
    revision: str | None  # None: the repository's default branch
    quant: str | None  # a GGUF quantization label, upper case
    filename: str | None  # a .gguf file's path in the repository

    @property
    def name(self) -> str:
        """A short name for /v1/models and logs: the repository's name, with its quantization."""
        base = self.repo_id.split("/", 1)[1]
        if self.filename is not None:
            return self.filename.rsplit("/", 1)[-1].removesuffix(".gguf")
        return f"{base}-{self.quant}" if self.quant else base


@dataclass(frozen=True, slots=True)
class Selection:
    """The files of a repository that serve one spec, and how the model loads from them."""

    kind: Literal["hf", "gguf"]  # a Hugging Face directory (the snapshot) or one .gguf file
    files: tuple[str, ...]  # repository paths to fetch
    gguf: str | None = None  # the .gguf file's path when kind == "gguf"


def parse_hub_spec(spec: str) -> HubSpec | None:
    """The Hub spec ``spec`` names, or None when it does not look like one (a path, a preset).

    Raises ``HubSpecError`` for a spec that is shaped like a Hub id but malformed.
    """
    if not spec or spec[0] in "./~" or any(c.isspace() for c in spec) or "\\" in spec:
        return None
    head, sep, quant = spec.rpartition(":")
    if not sep:
        head, quant = spec, ""
    elif "/" in quant:  # a ':' inside a path or a revision is not a quantization
        return None
    parts = head.split("/")
    if len(parts) < 2 or not parts[0] or not parts[1]:
        return None
    org, name = parts[0], parts[1]
    revision, filename = None, None
    rest = parts[2:]
    if "@" in name:
        name, revision = name.split("@", 1)
        if rest and not rest[-1].endswith(".gguf"):  # a revision with '/': refs/pr/1
            revision, rest = "/".join([revision, *rest]), []
        if not revision:
            raise HubSpecError(f"model {spec!r}: an empty revision after '@'")
    if rest:
        filename = "/".join(rest)
        if not filename.endswith(".gguf") or any(not p for p in rest):
            return None  # a/b/c that is not a file of a repo: a local path that is not there
    if not (_PART_RE.match(org) and _PART_RE.match(name)):
        return None
    if sep and not _QUANT_RE.match(quant):
        raise HubSpecError(f"model {spec!r}: {quant!r} is not a quantization label (Q4_K_M, "
                           f"Q8_0, F16, ...)")
    if sep and filename:
        raise HubSpecError(f"model {spec!r}: give a quantization or a .gguf file, not both")
    return HubSpec(spec, f"{org}/{name}", revision, quant.upper() or None, filename)


def quant_label(path: str) -> str | None:
    """The quantization a GGUF file's name states (``...-Q4_K_M.gguf`` -> ``Q4_K_M``)."""
    stem = _SPLIT_RE.sub("", path).removesuffix(".gguf")
    found = _LABEL_RE.search(stem.upper())
    return found.group(1) if found else None


def choose_files(spec: HubSpec, files: Mapping[str, int], need: Need = "weights") -> Selection:
    """The files of a repository (path -> size) that serve ``spec``, fetching only what ``need``
    asks: the tokenizer and config for the API, everything for a worker.

    Safetensors shards listed by an index are resolved by ``shards_of_index`` once the index is
    read; here an index stands for its shards. Raises ``HubSpecError`` naming what is missing.
    """
    if spec.filename is not None:
        if spec.filename not in files:
            raise HubSpecError(f"model {spec.text!r}: no file {spec.filename!r} in "
                               f"{spec.repo_id} (its GGUF files: {_list(_ggufs(files))})")
        return _gguf(spec, spec.filename)
    ggufs = _ggufs(files)
    if spec.quant is not None:
        if not ggufs:
            raise HubSpecError(f"model {spec.text!r}: {spec.repo_id} has no .gguf files, so "
                               f"no {spec.quant} (give {spec.repo_id} for its safetensors)")
        matches = [f for f in ggufs if quant_label(f) == spec.quant]
        if not matches:
            labels = sorted({quant_label(f) or f for f in ggufs})
            raise HubSpecError(f"model {spec.text!r}: {spec.repo_id} has no {spec.quant} file "
                               f"(it has: {', '.join(labels)})")
        return _gguf(spec, _first_whole(spec, matches))
    safetensors = [f for f in files if f.endswith(".safetensors") and "/" not in f]
    if safetensors and "config.json" in files:
        return _hf_dir(spec, files, safetensors, need)
    if ggufs:
        default = [f for f in ggufs if quant_label(f) == DEFAULT_QUANT]
        return _gguf(spec, _first_whole(spec, default or ggufs))
    found = sorted(f for f in files if f.endswith(_WEIGHT_SUFFIXES))
    what = f"found {_list(found)}" if found else "found no weight files"
    raise HubSpecError(f"model {spec.text!r}: {spec.repo_id} has no weights tidegate can load "
                       f"({what}; it loads *.safetensors with config.json, or a .gguf)")


def shards_of_index(index: Mapping[str, object], where: str) -> list[str]:
    """The shard files a safetensors index's ``weight_map`` names."""
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise HubSpecError(f"{where}: no weight_map")
    return sorted({str(shard) for shard in weight_map.values()})


def _hf_dir(spec: HubSpec, files: Mapping[str, int], safetensors: list[str],
            need: Need) -> Selection:
    if "tokenizer.json" not in files:
        raise HubSpecError(f"model {spec.text!r}: {spec.repo_id} has no tokenizer.json "
                           f"(tidegate reads the fast tokenizer's file)")
    wanted = [f for f in (*TOKENIZER_FILES, QUANT_CONFIG_FILE) if f in files]
    if need == "weights":
        # With an index, only its shards (a repo may also hold consolidated.safetensors in
        # another layout): the index is fetched first and stands for them here.
        wanted += [INDEX_FILE] if INDEX_FILE in files else sorted(safetensors)
    return Selection("hf", tuple(wanted))


def _gguf(spec: HubSpec, path: str) -> Selection:
    if _SPLIT_RE.search(path):
        raise HubSpecError(f"model {spec.text!r}: {path} is one part of a split GGUF, which "
                           f"tidegate does not read; merge the parts with llama-gguf-split "
                           f"--merge and give the merged file")
    return Selection("gguf", (path,), path)


def _first_whole(spec: HubSpec, candidates: list[str]) -> str:
    """The first file that is not part of a split GGUF, else the first part (refused later)."""
    whole = [f for f in sorted(candidates) if not _SPLIT_RE.search(f)]
    return (whole or sorted(candidates))[0]


def _ggufs(files: Mapping[str, int]) -> list[str]:
    # Vision projectors (mmproj-*.gguf) sit beside the language model in many repos.
    return sorted(f for f in files
                  if f.endswith(".gguf") and "mmproj" not in f.rsplit("/", 1)[-1].lower())


def _list(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    more = f", and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
