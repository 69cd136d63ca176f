# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PORT ?= 8000

.PHONY: serve test lint pull bench clean browser

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Stamp files: reinstall when pyproject.toml changes.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'
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

test: $(VENV)/.installed-test browser
	$(BIN)/metrale pull
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n 3 --dist loadgroup -q --durations=10

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .

bench: $(VENV)/.installed-test pull
	$(BIN)/python bench/engine.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
