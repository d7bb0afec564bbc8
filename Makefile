# Every target runs inside .venv, which `make setup` creates (idempotent: re-run it any time).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# export options (see README)
MODEL ?=
DRAFT ?=
OUT ?=
EXIT_LAYER ?=
TOPK ?= 8
FORCE ?=

.PHONY: setup test demo export clean

setup: $(STAMP)

# torch comes first and pinned: `pip install torch==2.13.0` takes the CPU wheel on this machine's disk; a loose
# requirement would pull a multi-GB CUDA build. The project pins the same version, so nothing more is fetched.
$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test]"
	@touch $@

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

demo: setup
	$(PY) -m mirror_sd.models.demo

export: setup
	@if [ -z "$(MODEL)" ] || [ -z "$(DRAFT)" ] || [ -z "$(OUT)" ]; then \
	  echo "usage: make export MODEL=<hf id or dir> DRAFT=<hf id or dir> OUT=<dir> [EXIT_LAYER=n] [TOPK=k] [FORCE=1]" >&2; \
	  exit 2; fi
	@$(VENV)/bin/mirror-sd export --model "$(MODEL)" --draft "$(DRAFT)" --out "$(OUT)" --top-k $(TOPK) \
	  $(if $(EXIT_LAYER),--exit-layer $(EXIT_LAYER)) $(if $(FORCE),--force)

clean:
	rm -rf build
