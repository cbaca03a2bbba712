"""MkDocs hook: the pages that are generated, never written by hand.

* ``reference/*``: from the code (``tidegate.commands.reference``): the CLI's parser, the
  settings model, the metric declarations, the OpenAPI document ``tidegate up`` serves, the
  protocol's event models. An entry without a description fails the build.
* ``benchmarks/results/**``: the results files (Markdown and plots) of ``benchmarks/results/``,
  as they are in the repository; a link from them to a file the site does not carry becomes
  its path in code.
* ``benchmarks/serving.md``, ``engine.md``, ``cluster.md``: one index per room of results, each
  result's title and opening paragraph.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

from tidegate.commands.reference.http_reference import served_document
from tidegate.commands.reference.pages import reference_pages, undocumented

ROOMS = {"serving": "Serving", "engine": "Engine", "cluster": "Fleet and cluster"}
CARRIED = (".md", ".png", ".svg")
_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")


def on_files(files: Files, config: MkDocsConfig) -> Files:
    document = served_document()  # built once, for the check and the pages
    if missing := undocumented(document):
        raise PluginError("the reference lacks descriptions:\n  " + "\n  ".join(missing))
    root = Path(config.config_file_path).parent
    for path, text in reference_pages(document).items():
        files.append(File.generated(config, path, content=text))
    results = root / "benchmarks" / "results"
    carried = {p.relative_to(results).as_posix() for p in results.rglob("*")
               if p.suffix in CARRIED}
    for rel in sorted(carried):
        source = results / rel
        content: str | bytes = (_local_links(source.read_text(encoding="utf-8"), rel, carried)
                                if source.suffix == ".md" else source.read_bytes())
        files.append(File.generated(config, f"benchmarks/results/{rel}", content=content))
    for room, title in ROOMS.items():
        files.append(File.generated(config, f"benchmarks/{room}.md",
                                    content=_room_index(results, room, title)))
    return files


def _local_links(text: str, rel: str, carried: set[str]) -> str:
    """Links to files the site carries stay; the others become their repository path."""
    here = PurePosixPath(rel).parent

    def replace(match: re.Match[str]) -> str:
        bang, label, target = match.groups()
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            return match.group(0)
        path = target.split("#", 1)[0]
        resolved = _normalise(here / path)
        if resolved in carried:
            return match.group(0)
        shown = _normalise(PurePosixPath("benchmarks/results") / here / path)
        return f"{label} (`{shown}`)" if label and not bang else f"`{shown}`"

    return _LINK.sub(replace, text)


def _normalise(path: PurePosixPath) -> str:
    parts: list[str] = []
    for part in path.parts:
        if part == "..":
            if parts:
                parts.pop()
        elif part != ".":
            parts.append(part)
    return "/".join(parts)


def _room_index(results: Path, room: str, title: str) -> str:
    out = [f"# {title} results", "",
           f"Every result of `benchmarks/results/{room}/`, each with the command that made it, "
           "the machine it ran on and its figures. This page is generated from those files.", ""]
    for path in sorted((results / room).glob("*.md")):
        heading, opening = _summary(path.read_text(encoding="utf-8"))
        out += [f"## [{heading}](results/{room}/{path.name})", "", opening, ""]
    return "\n".join(out)


def _summary(text: str) -> tuple[str, str]:
    """A results file's title and its first paragraph of prose."""
    lines = text.splitlines()
    heading = next((ln[2:].strip() for ln in lines if ln.startswith("# ")), "Result")
    paragraph: list[str] = []
    in_fence = False
    for line in lines[1:]:
        if line.startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence or line.startswith(("#", "|", "!", "<")):
            if paragraph:
                break
            continue
        if line.strip():
            paragraph.append(line.strip())
        elif paragraph:
            break
    opening = " ".join(paragraph)
    opening = _LINK.sub(lambda m: m.group(2), opening)  # the links are relative to the file
    return heading, opening
