# `make demo` and `make test` each set up .venv first; nothing else is needed on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The verl backend's own environment (omni_core/backends/verl): the tests run verl's trainer and Hydra
# configs in it, as the Ray Job's `python`. The project's .venv never imports verl. No MLflow: verl's jobs
# log through verl's file logger, which the driver relays into MLflow (omni_core/backends/jobs/metrics.py).
VERL_VENV := .venv-verl
VERL_STAMP := $(VERL_VENV)/.installed
VERL_REQUIREMENTS := "verl[verl-core]==0.9.1"
# Every other package at the version the tests last passed with (`make lock` writes them): pyproject and
# verl name ranges, and a freshly set-up machine gave the seeded verl e2e other numbers (its GRPO gain
# -0.07 instead of +0.009; package versions are one cause the locks remove, the CPU's own kernels another
# they cannot).
VENV_LOCK := constraints/venv.txt
VERL_LOCK := constraints/verl.txt
# uv installs everything but torch, at the locks' versions, from its cache (hard links): `make setup` on a
# clean clone with warm caches took 26 s against pip's 38 s (pip unpacks every wheel again; with uv's
# cache cold, 33 s). uv does not byte-compile (as pip's --no-compile: compiling all 28k modules of .venv
# took 68 CPU s; the tests import about a quarter of them, compiled on first use).
# torch is pinned: a CPU build that pip takes from this machine's disk (pip's find-links, which uv does
# not read; a looser pin pulls multi-GB CUDA wheels). pip installs it (and uv) first, and uv's calls keep
# it pinned, so nothing pulls the CUDA torch verl's extras name.
UV := "uv==0.13.9"
# $(call pip_torch_and_uv,VENV) and $(call uv_install,VENV,LOCK) REQUIREMENTS...
pip_torch_and_uv = $(1)/bin/python -m pip install --quiet --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true; \
	$(1)/bin/python -m pip install --quiet --no-compile "torch==2.13.0" $(UV) 2>&1 | grep -v "^WARNING: Location" ; test $${PIPESTATUS[0]} -eq 0
uv_install = $(1)/bin/uv pip install --quiet --python $(1)/bin/python -c $(2) "torch==2.13.0"
# System packages the tests use (installed with apt-get when running as root).
SYSTEM_PACKAGES := git buildah skopeo docker-registry busybox-static tesseract-ocr tesseract-ocr-eng fonts-dejavu-core postgresql chromium

.PHONY: setup environments demo test lint bench lock clean docs docs-serve docs-reference docs-screenshots

# The two environments are independent: they are set up side by side (each pip mostly busy on one core
# of the 2-core CI machine), each one's output printed together when it is done.
setup:
	@$(MAKE) --no-print-directory -j2 --output-sync=target environments

environments: $(STAMP) $(VERL_STAMP)
	@:

$(STAMP): pyproject.toml Makefile $(VENV_LOCK)
	@scripts/install-system-packages.sh $(SYSTEM_PACKAGES)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(call pip_torch_and_uv,$(VENV))
	$(call uv_install,$(VENV),$(VENV_LOCK)) -e ".[dev]"
	@touch $(STAMP)

$(VERL_STAMP): Makefile $(VERL_LOCK)
	@test -x $(VERL_VENV)/bin/python || $(PYTHON) -m venv $(VERL_VENV)
	$(call pip_torch_and_uv,$(VERL_VENV))
	$(call uv_install,$(VERL_VENV),$(VERL_LOCK)) $(VERL_REQUIREMENTS)
	@touch $(VERL_STAMP)

demo: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/omni run configs/demo.yaml

# The modules run on TEST_WORKERS pytest-xdist workers, each module whole on one worker, the longest
# first (pyproject's addopts, tests/module_order.py). 3 on the CI machine's 2 cores: a module spends much
# of its time in one process at a time (a Ray actor, a verl job's actors, a Prefect or MLflow server
# starting up, importing torch): the verl and TRL modules side by side on two workers kept 1.57 of the
# 2 cores busy. With three, a fresh-clone `make test` on a quiet 2-core machine took 1552 s (the CPUs 1%
# idle, peak memory 12.3 GiB); with two it had taken 1965 s on a commit of a day before (the same
# modules, a few steps more).
TEST_WORKERS ?= 3

# env -u PYTHONDONTWRITEBYTECODE: the environments are installed --no-compile, counting on each module
# being compiled once, on first use; with that variable set (it was, on the shared dev machine) nothing
# is ever written and every process (each test worker, `omni` command, Ray worker, Prefect and moto
# server) compiles torch, MLflow, Prefect and Ray from source again (measured: `import torch, mlflow,
# prefect, ray, transformers` 12-13.5 CPU s without .pyc files, 7.7 CPU s with them).
test: setup
	$(BIN)/ruff check .
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -n $(TEST_WORKERS) -ra --durations=15

lint: setup
	$(BIN)/ruff check .

# The docs site (mkdocs.yml; MkDocs and Material are in the dev extra). --strict: a broken link or
# anchor, a missing page or a page left out of a section's nav fails the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# docs/reference/{config,cli,metrics}.md from the config models, the CLI and the algorithms' records
# (tests/test_docs_site.py fails while they are stale)
docs-reference: $(STAMP)
	$(BIN)/python scripts/gen_docs_reference.py

# The site's pictures (docs/images/): the demo and configs/flow_grpo.yaml run in .omni-screenshots/, then
# headless Chromium photographs MLflow and the Prefect UI (scripts/docs_screenshots.py; chromium is one of
# SYSTEM_PACKAGES). QUICK=1: fewer training steps.
docs-screenshots: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python scripts/docs_screenshots.py $(if $(QUICK),--quick)

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr 127.0.0.1:8000

# The benchmarks' own dependencies (pyproject's `bench` extra), on top of setup's.
BENCH_STAMP := $(VENV)/.installed-bench

$(BENCH_STAMP): $(STAMP)
	$(BIN)/uv pip install --quiet --python $(BIN)/python -c $(VENV_LOCK) "torch==2.13.0" -e ".[dev,bench]"
	@touch $(BENCH_STAMP)

bench: setup $(BENCH_STAMP)
	@# the scripts only: bench/learning_{preference,flow}.py are modules that bench/learning.py runs
	@for script in $$(grep -l '^if __name__ == "__main__":' bench/*.py); do echo "== $$script"; $(BIN)/python $$script --quick || exit 1; done

# What the two environments hold, written as the locks. To move to newer releases: empty a lock
# (`: > constraints/venv.txt`), `make clean test`, then `make lock` (torch stays pinned above).
write_lock = { echo "\# $(1)'s resolved versions (make lock); torch is pinned in the Makefile"; \
	$(1)/bin/python -m pip freeze --exclude-editable | grep -v -e '^torch==' -e '^uv=='; } > $(2)

lock:
	@$(call write_lock,$(VENV),$(VENV_LOCK))
	@$(call write_lock,$(VERL_VENV),$(VERL_LOCK))

clean:
	rm -rf $(VENV) $(VERL_VENV) .omni site .omni-screenshots
