"""What a scrape shows against the generated metrics reference: every family a process exports
must be listed there (``tidegate.commands.reference.metrics_reference``)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tidegate.commands.reference.metrics_reference import documented_names


def assert_documented(exposition: str) -> None:
    """Every family in ``exposition`` (a /metrics body) is in the metrics reference."""
    # The text format shows a counter's or histogram's _created series as a gauge of its own.
    shown = {family.name.removesuffix("_created")
             for family in text_string_to_metric_families(exposition)}
    assert shown, "the scrape shows no metric"
    undocumented = shown - documented_names()
    assert not undocumented, f"missing from the metrics reference: {sorted(undocumented)}"
