# `make demo` and `make test` each set up .venv first; nothing else is needed on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# System packages the tests use (installed with apt-get when running as root).
SYSTEM_PACKAGES := git buildah skopeo docker-registry busybox-static tesseract-ocr tesseract-ocr-eng fonts-dejavu-core postgresql

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@scripts/install-system-packages.sh $(SYSTEM_PACKAGES)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
	@# torch is pinned here: a CPU build from this machine's disk (a looser pin pulls multi-GB CUDA wheels).
	$(BIN)/python -m pip install --quiet "torch==2.13.0" -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" ; test $${PIPESTATUS[0]} -eq 0
	@touch $(STAMP)

demo: setup
	$(BIN)/omni run configs/demo.yaml

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -ra --durations=15

lint: setup
	$(BIN)/ruff check .

bench: setup
	@# the scripts only: bench/learning_{preference,flow}.py are modules that bench/learning.py runs
	@for script in $$(grep -l '^if __name__ == "__main__":' bench/*.py); do echo "== $$script"; $(BIN)/python $$script --quick || exit 1; done

clean:
	rm -rf $(VENV) .omni
