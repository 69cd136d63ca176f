# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3

# Python writes its bytecode (.pyc) even where the machine says not to
# (PYTHONDONTWRITEBYTECODE=1 here, and uv installs none): otherwise each process (the test
# run's 3 workers and the subprocesses its tests start, `metrale pull`, the server) compiles
# jax, transformers and the project from source again. Importing them: 12.7 s of CPU
# without .pyc files, 6.5 s with (14.9 s for the process that writes them).
export PYTHONDONTWRITEBYTECODE :=
VENV := .venv
BIN := $(VENV)/bin
PORT ?= 8000

.PHONY: serve test lint docs pull bench clean browser device-check device-wheels

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

# Debian packages the tests use, installed here when missing and this is root on Debian (CI):
# - chromium: the web page's tests drive it (playwright); without it they skip and say so;
# - libjemalloc2: the test run's malloc (below); without it, glibc's.
BROWSER := /usr/bin/chromium
JEMALLOC_GLOB := /usr/lib/*/libjemalloc.so.2

browser:
	@(test -x $(BROWSER) && ls $(JEMALLOC_GLOB) >/dev/null 2>&1) || [ "$$(id -u)" != 0 ] || \
	  ! command -v apt-get >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -qq chromium libjemalloc2 >/dev/null) || \
	  echo "make: could not install chromium and jemalloc: the web page tests will skip"

# The reference in docs/ (MkDocs, Material theme; mkdocs.yml lists every page). The strict build
# fails on a broken link or anchor between pages and on a page missing from the nav; the README
# is outside docs/, so its links into docs/ are checked here (they are what GitHub follows).
# Never --quiet: it hides the warnings that strict mode counts, and the build passes. `make test`
# sets NO_MKDOCS_2_WARNING to drop Material's end-of-life banner (see docs/dependencies.md).
SITE ?= site
define check_readme_links
grep -o '](docs/[^)#]*' README.md | cut -c3- | sort -u | while read -r page; do \
  test -f "$$page" || { echo "README.md: broken link to $$page"; exit 1; }; done
endef

docs: $(VENV)/.installed-test
	$(BIN)/mkdocs build --strict --site-dir $(SITE)
	@$(check_readme_links)

# The environment and the Debian packages install side by side (two jobs of a sub-make).
# pytest runs on jemalloc where it is installed (LD_PRELOAD, inherited by every subprocess):
# XLA's compiler allocates and frees millions of small objects, and compiling is most of the
# suite's time (test_engine, test_int4_engine and test_default_model_greedy, cold cache:
# 149 s -> 135 s, user CPU 173 s -> 155 s).
test:
	$(MAKE) --no-print-directory -j2 $(VENV)/.installed-test browser
	$(BIN)/metrale pull
	$(BIN)/metrale pull all-minilm-l6-v2
	$(BIN)/ruff check .
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir $(SITE)
	@$(check_readme_links)
	LD_PRELOAD="$$(ls $(JEMALLOC_GLOB) 2>/dev/null | head -n 1)" \
	  $(BIN)/python -m pytest -n 3 --dist loadgroup -q --durations=10

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .

bench: $(VENV)/.installed-test pull
	$(BIN)/python bench/engine.py

# ---- a lent TPU or GPU (docs/accelerators.md) -------------------------------------------------
# device-wheels (on a machine with the registries): the wheels of the runtime dependencies an
# accelerator host lacks (it brings JAX, flax, transformers, ...: bench/device_wheels.py's
# HOST_HAS), for its Python PY, into git-ignored wheels/device (64 MiB at most; checked).
# device-check (on the host, offline): installs the missing ones from there into
# build/device-site (the host's environment is left alone), then runs the check with the
# repository on PYTHONPATH. DEVICE_PYTHON: the project's venv where there is one, else python3.
PY ?= 3.12
DEVICE_WHEELS ?= wheels/device
DEVICE_SITE := build/device-site
DEVICE_PYTHON ?= $(shell test -x $(BIN)/python && echo $(BIN)/python || echo python3)
DEVICE_CHECK_ARGS ?=

device-wheels:
	$(PYTHON) -m bench.device_wheels download --python-version $(PY) --dest $(DEVICE_WHEELS)

device-check:
	$(DEVICE_PYTHON) -m bench.device_wheels install --wheels $(DEVICE_WHEELS) --target $(DEVICE_SITE)
	PYTHONPATH="$(CURDIR):$(CURDIR)/$(DEVICE_SITE)$${PYTHONPATH:+:$$PYTHONPATH}" \
	  $(DEVICE_PYTHON) -m bench.device_check $(DEVICE_CHECK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache $(SITE)
