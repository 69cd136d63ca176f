# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PORT ?= 8000

.PHONY: serve test lint pull bench clean browser

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Installs go through uv, which resolves and unpacks in parallel: a cold install of the test
# environment took 17 s against pip's 77 s here. uv reads no pip configuration, so it is given
# pip's find-links (where a machine may keep wheels, such as a local CPU build of torch); pip
# does the install where uv cannot be had or fails.
PIP_FIND_LINKS ?= $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
define install
$(BIN)/python -m pip install --quiet 'uv>=0.5' && \
  UV_FIND_LINKS='$(PIP_FIND_LINKS)' $(BIN)/uv pip install --quiet --python $(BIN)/python $(1) \
  || $(BIN)/python -m pip install --quiet $(1)
endef

# Stamp files: reinstall when pyproject.toml changes.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(call install,-e .)
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(call install,-e '.[test]')
	touch $@ $(VENV)/.installed

pull: $(VENV)/.installed
	$(BIN)/metrale pull

serve: pull
	$(BIN)/metrale serve --model default --port $(PORT)

# The web page's tests drive Debian's chromium (playwright); installed here when missing and
# this is root on Debian (CI), else those tests skip and say so.
BROWSER := /usr/bin/chromium

browser:
	@test -x $(BROWSER) || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium \
	   >/dev/null) || echo "make: could not install chromium: the web page tests will skip"

# The environment and the browser install side by side (two jobs of a sub-make).
test:
	$(MAKE) --no-print-directory -j2 $(VENV)/.installed-test browser
	$(BIN)/metrale pull
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n 3 --dist loadgroup -q --durations=10

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .

bench: $(VENV)/.installed-test pull
	$(BIN)/python bench/engine.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
