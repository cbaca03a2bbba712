"""The docs site's generated references: complete, and failing on anything undescribed.

Each page is generated from its source of truth; these tests check that every flag, setting,
metric, route and event of that source appears on its page, and that a new one without a
description is caught (``undocumented``), which also fails ``mkdocs build``.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path
from typing import Literal

import pytest
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from tidegate import protocol
from tidegate.commands.cli import build_parser
from tidegate.commands.launcher import combined_app
from tidegate.commands.reference import (
    cli_reference,
    events_reference,
    http_reference,
    metrics_reference,
    settings_reference,
)
from tidegate.commands.reference.pages import reference_pages, source_folders, undocumented
from tidegate.http.openapi import mounted
from tidegate.settings import Settings

HOOK = Path(__file__).resolve().parents[3] / "docs" / "hooks" / "generated_pages.py"


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return reference_pages()


def headings(text: str) -> set[str]:
    """Every heading's text, attribute lists ({#id}) removed."""
    return {re.sub(r"\s*\{#[^}]*\}$", "", line.lstrip("#").strip())
            for line in text.splitlines() if line.startswith("#")}


def test_nothing_lacks_a_description() -> None:
    assert undocumented() == []


def test_every_command_and_flag_is_listed(pages: dict[str, str]) -> None:
    page = pages[cli_reference.PAGE]
    names = headings(page)
    for command in cli_reference.commands():
        assert command.name in names
        section = page.split(f"## {command.name}\n", 1)[1].split("\n## ", 1)[0]
        for action in command.parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert flag in section, (command.name, flag)
    # A flag that sets a setting shows the setting's variable and default.
    worker = page.split("## tidegate worker\n", 1)[1].split("\n## ", 1)[0]
    row = next(line for line in worker.splitlines() if line.startswith("| `--max-lora-rank"))
    assert "`16`" in row and "settings.md#tidegate_max_lora_rank" in row
    # One whose default depends on the device is unset there; its help says each default.
    row = next(line for line in worker.splitlines() if line.startswith("| `--max-num-seqs"))
    assert "unset" in row and "1024 on cuda" in row and "settings.md#tidegate_max_num_seqs" in row
    # ... but a request's own flag does not (submit's --model is not TIDEGATE_MODELS).
    submit = page.split("## tidegate submit\n", 1)[1].split("\n## ", 1)[0]
    assert "settings.md" not in submit


def test_every_setting_is_listed_with_its_default(pages: dict[str, str]) -> None:
    page = pages[settings_reference.PAGE]
    for name, info in Settings.model_fields.items():
        variable = "TIDEGATE_" + name.upper()
        section = page.split(f"### {variable}\n", 1)[1].split("\n#", 1)[0]
        assert info.description and " ".join(info.description.split())[1:] in section
        default = info.get_default(call_default_factory=True)
        if default not in (None, []):
            shown = str(default).lower() if isinstance(default, bool) else str(default)
            assert f"default `{shown}`" in section, (variable, section)
    assert "Flag: `--max-num-seqs` (up, worker)" in page
    for variable in settings_reference.OTHER_ENVIRONMENT:
        assert f"`{variable}`" in page


def test_every_metric_family_is_listed(pages: dict[str, str]) -> None:
    page = pages[metrics_reference.PAGE]
    for _, _, docs in metrics_reference.PROCESSES:
        for doc in docs:
            assert f"`{doc.exposed_name}` | {doc.kind} |" in page
    assert "tidegate_queue_lag" in metrics_reference.documented_names()


def test_every_served_route_is_listed(pages: dict[str, str]) -> None:
    page = pages[http_reference.PAGE]
    served = mounted(combined_app(Settings()).routes)
    assert len(served) > 15
    names = headings(page)
    for path, method in served:
        assert any(h.startswith(f"{method.upper()} {path}") for h in names), (method, path)
    assert "### JobRequest" in page and "### ErrorBody" in page
    assert '"openapi": "3.1.0"' in pages[http_reference.OPENAPI_FILE]


def test_every_event_type_is_listed(pages: dict[str, str]) -> None:
    page = pages[events_reference.PAGE]
    kinds = [events_reference._event_type(m) for m in events_reference.event_models()]
    assert set(kinds) >= {"queued", "started", "token", "done", "error", "rejected",
                          "restarted", "migrated"}
    for kind in kinds:
        assert kind in headings(page)
    for nested in ("Usage", "Timings", "Choice", "ToolCall", "FunctionCall", "TopLogprob"):
        assert nested in headings(page)
    assert "A final event." in page.split("## done\n", 1)[1].split("\n## ", 1)[0]


def test_a_flag_without_help_is_caught() -> None:
    parser = argparse.ArgumentParser(prog="tidegate")
    sub = parser.add_subparsers()
    command = sub.add_parser("serve", help="serve")
    command.add_argument("--fast", action="store_true")
    command.add_argument("--slow", action="store_true", help="go slowly")
    sub.add_parser("hidden")
    assert cli_reference.gaps(parser) == [
        "CLI argument '--fast' of 'tidegate serve' has no help",
        "CLI command 'tidegate hidden' has no help"]
    assert cli_reference.gaps(build_parser()) == []


def test_a_setting_or_variable_without_description_is_caught(tmp_path: Path) -> None:
    class Extended(Settings):
        model_config = SettingsConfigDict(env_prefix="TIDEGATE_", extra="ignore")
        shiny: int = Field(default=1)

    (tmp_path / "reader.py").write_text(
        'import os\nlevel = os.environ.get("TIDEGATE_NEW_KNOB")\n'
        'size = os.environ.get("TIDEGATE_MAX_NUM_SEQS")\n')
    assert settings_reference.gaps([tmp_path], Extended) == [
        "setting 'shiny' (TIDEGATE_SHINY) has no description",
        "environment variable TIDEGATE_NEW_KNOB is read by the code but not documented"]


def test_every_variable_the_code_names_is_documented() -> None:
    folders = source_folders()
    assert {"producer", "worker", "kernels", "streaming"} <= {f.name for f in folders}
    assert settings_reference.undocumented_variables(folders) == set()


def test_an_event_or_field_without_description_is_caught() -> None:
    class PingEvent(protocol._Event):
        type: Literal["ping"] = "ping"
        payload: str

    assert events_reference.gaps([PingEvent]) == [
        "event 'ping' has no docstring",
        "field 'payload' of PingEvent has no description"]


def test_a_route_without_summary_is_caught() -> None:
    document = {"paths": {"/v1/things": {"get": {
        "summary": " ", "parameters": [{"name": "kind", "in": "query"}],
        "responses": {"200": {"description": "the things"}, "404": {"description": ""}}}}}}
    assert http_reference.gaps(document) == [
        "route GET /v1/things has no summary",
        "route GET /v1/things: answer 404 has no description",
        "route GET /v1/things: parameter 'kind' has no description"]


def hook():  # noqa: ANN201 - the docs hook module, loaded from its file as MkDocs does
    spec = importlib.util.spec_from_file_location("generated_pages", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_keep_links_the_site_carries_and_name_the_others() -> None:
    text = ("![plot](serve.png) see [the harness](../../harness/load.py), "
            "[chaos](chaos.md#runs) and [the web](https://example.com/x).")
    out = hook()._local_links(text, "serving/serve.md", {"serving/serve.png", "serving/chaos.md"})
    assert out == ("![plot](serve.png) see the harness (`benchmarks/harness/load.py`), "
                   "[chaos](chaos.md#runs) and [the web](https://example.com/x).")


def test_a_room_index_names_each_result_with_its_opening(tmp_path: Path) -> None:
    room = tmp_path / "serving"
    room.mkdir()
    (room / "fanout.md").write_text("# Fan-out: many clients\n\n```bash\nrun it\n```\n\n"
                                    "One gateway, [N](x.md) clients.\nSecond line.\n\n"
                                    "| a | b |\n")
    index = hook()._room_index(tmp_path, "serving", "Serving")
    assert "## [Fan-out: many clients](results/serving/fanout.md)" in index
    assert "One gateway, N clients. Second line." in index
