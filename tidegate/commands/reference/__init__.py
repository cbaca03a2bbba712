"""The docs site's reference pages, generated from the code they describe.

Each module renders one page from its source of truth and names what lacks a description:
``cli_reference`` (the argparse parser), ``settings_reference`` (the settings model, and the
other environment variables the code reads), ``metrics_reference`` (every process's declared
metric families), ``http_reference`` (the OpenAPI document ``tidegate up`` serves) and
``events_reference`` (the wire protocol's event models). ``reference_pages`` collects them for
the MkDocs hook (``docs/hooks/generated_pages.py``); ``undocumented`` is what
``tests/tidegate/commands/test_reference_pages.py`` requires to be empty.
"""
