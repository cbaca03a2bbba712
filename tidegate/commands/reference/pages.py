"""Every generated reference page by its path in the docs site, and what lacks a description."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from tidegate.commands.reference import (
    cli_reference,
    events_reference,
    http_reference,
    metrics_reference,
    settings_reference,
)

# The packages whose TIDEGATE_* names must be documented: every role, installed as one.
PACKAGES = ("tidegate", "tidegate.producer", "tidegate.worker", "tidegate.kernels",
            "tidegate.streaming")


def source_folders() -> list[Path]:
    """Where the packages' sources are, installed or editable, without importing them."""
    folders = []
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.submodule_search_locations is not None, name
        folders += [Path(p) for p in spec.submodule_search_locations]
    return folders


def reference_pages(document: dict | None = None) -> dict[str, str]:
    """Docs path -> Markdown (or JSON) text (``document``: the served OpenAPI, if built)."""
    document = document or http_reference.served_document()
    makers: dict[str, Callable[[], str]] = {
        cli_reference.PAGE: cli_reference.page,
        settings_reference.PAGE: settings_reference.page,
        http_reference.PAGE: lambda: http_reference.page(document),
        http_reference.OPENAPI_FILE: lambda: http_reference.openapi_json(document),
        events_reference.PAGE: events_reference.page,
        metrics_reference.PAGE: metrics_reference.page,
    }
    return {path: make() for path, make in makers.items()}


def undocumented(document: dict | None = None) -> list[str]:
    """Every flag, setting, environment variable, metric, route and event without a
    description: empty, or the docs are incomplete."""
    return [*cli_reference.gaps(), *settings_reference.gaps(source_folders()),
            *metrics_reference.gaps(), *http_reference.gaps(document), *events_reference.gaps()]
