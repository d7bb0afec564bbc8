"""The precision section of `make bench`: the target in each weight format of ours beside OpenVINO GenAI as a user
gets it, and the format to recommend on this machine.

Ours: the bundle (float32) and its `TARGET_WEIGHTS` siblings, `<bundle>-int8` and `<bundle>-int4` (`make models
TARGET_WEIGHTS=int8` builds them; a missing one is reported as not run), and some formats with their prompts prefilled
apart (runtime/prompt_graphs.py, arms "<format> <precision>-prefill"): on a CPU with bf16 arithmetic the float32 and
int8 targets with prompts in bf16, elsewhere the int8 and int4 targets with prompts on their weights in float32 (their
int8 activations prefill slower there), and the float32 and int8 targets with their KV cache in float16 and in uint8
codes (arms "<format> float16-kv" and "<format> uint8-kv", where the attention kernel compiles:
LoadOptions.kv_cache_precision). GenAI: LLMPipeline at its defaults (on a CPU with AMX: bf16 compute and a u8 KV cache),
on the float32 target and on the target with NNCF int8 / int4 weights (export/openvino_genai.py).
- speed: ar TTFT and decode tokens/s at each prompt length (real text, a fresh passage per repetition: the context
  section's prompts), every arm at the same threads, the order rotating per repetition, medians;
- per benchmark prompt (greedy, the whole call timed, prefill included): each format's ar and its planned mode (the
  mode and settings its plan gives), beside GenAI's plain, prompt-lookup and speculative decoding at its defaults;
  each format's planned output must equal its own ar output (exactness is with respect to the target as deployed);
- agreement of each format with float32: top-1 per position on float32's greedy answers (teacher-forced), the share
  of greedy answers that differ, and the median first divergence;
- the recommendation: the format whose planned mode ran fastest over the prompts, of those that keep float32's
  token at RECOMMEND_MIN_TOP1 of positions or more.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any, Callable

import numpy as np

from mirror_sd.bench.context import WARMUP_TOKENS, context_prompts
from mirror_sd.bench.methods import Method, MethodResult
from mirror_sd.bench.pipeline_methods import PipelineMethod
from mirror_sd.bench.summary import decode_rate, median, verdicts
from mirror_sd.errors import MirrorSDError
from mirror_sd.export.target_weights import float32_activations_copy
from mirror_sd.models.benchmark_prompts import select
from mirror_sd.partitions import Manifest
from mirror_sd.runtime import cpu_attention
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.runtime.prompt_graphs import has_bf16
from mirror_sd.runtime.target import prefill_chunks

FORMATS = ("float32", "int8", "int4")
# the formats run with their prompts prefilled at each precision too (an arm "<format> <precision>-prefill"):
# bf16 prompts where the CPU has bf16 arithmetic (int4's agreement is too low to recommend), else float32 prompts for
# the formats whose MatMuls take int8 activations
PROMPT_ARMS = {"bf16": ("float32", "int8"), "float32": ("int8", "int4")}
# the formats run with their KV cache in float16 and in uint8 codes too (arms "<format> <precision>-kv")
KV_ARMS = {"float16": ("float32", "int8"), "uint8": ("float32", "int8")}
RECOMMEND_MIN_TOP1 = 0.95  # the least top-1 agreement with float32 a recommended format keeps
GENAI_METHODS = ("ov-genai-ar", "ov-genai-pld", "ov-genai-sd")  # its single-stream methods, at its defaults
# Issue 57's bars, ratios of medians measured here: (key, what, target, higher is better)
TARGETS = (
    ("ttft_512", "our best arm's ar TTFT over GenAI's at its defaults, 512 prompt tokens", 1.0, False),
    ("ttft_2048", "our best arm's ar TTFT over GenAI's at its defaults, 2,048 prompt tokens", 1.0, False),
    ("decode_64", "our best arm's ar decode over GenAI's at its defaults, 64 prompt tokens", 1.0, True),
    ("decode_2048", "our best arm's ar decode over GenAI's at its defaults, 2,048 prompt tokens", 1.0, True),
    ("planned", "the recommended format's planned mode over GenAI's fastest method at its defaults (prompts, whole "
                "call)", 1.3, True),
    ("int8_decode_64", "int8 ar decode over GenAI with int8 weights, 64 prompt tokens", 1.0, True),
    ("int8_decode_2048", "int8 ar decode over GenAI with int8 weights, 2,048 prompt tokens", 1.0, True),
    ("int4_decode_64", "int4 ar decode over GenAI with int4 weights, 64 prompt tokens", 1.0, True),
    ("int4_decode_2048", "int4 ar decode over GenAI with int4 weights, 2,048 prompt tokens", 1.0, True),
    ("int8_top1", "int8's top-1 agreement with float32 per position", 0.98, True),
)


@dataclass(frozen=True)
class PrecisionSize:
    lengths: tuple[int, ...]  # prompt tokens of the ar speed comparison
    repeats: int  # prompts per length
    per_kind: int  # benchmark prompts per task kind, timed (planned mode, exactness)
    agreement_per_kind: int  # benchmark prompts per task kind for the agreement with float32 (untimed)
    new_tokens: int


QUICK = PrecisionSize((64, 512), repeats=1, per_kind=1, agreement_per_kind=1, new_tokens=16)
FULL = PrecisionSize((64, 512, 2048), repeats=3, per_kind=2, agreement_per_kind=10, new_tokens=64)


def sibling_bundles(bundle: Path) -> tuple[dict[str, Path], dict[str, str]]:
    """The bundle in each format that is there: itself for its own, `<bundle>-<format>` for the others; and why
    each missing one is missing."""
    bundle = Path(bundle)
    own = Manifest.load(bundle).target.weight_format
    base = bundle.with_name(bundle.name.removesuffix(f"-{own}")) if own != "float32" else bundle
    found, missing = {}, {}
    for fmt in FORMATS:
        path = base if fmt == "float32" else base.with_name(f"{base.name}-{fmt}")
        try:
            if Manifest.load(path).target.weight_format == fmt:
                found[fmt] = path
                continue
            missing[fmt] = f"{path} holds another weight format"
        except MirrorSDError:
            missing[fmt] = f"no {fmt} bundle at {path} (make models TARGET_WEIGHTS={fmt})"
    return found, missing


def run_precision(bundles: dict[str, Path], size: PrecisionSize, genai_by_format: dict[str, Method],
                  genai_methods: dict[str, Method], *, threads: int, report: Callable[[str], None],
                  not_run: dict[str, str] | None = None, progress: bool = True) -> dict[str, Any]:
    """The section as plain data (bench.json's "precision"). genai_by_format: GenAI's plain decoding at its defaults
    per weight format of its target (the speed comparison); genai_methods: its single-stream methods at its defaults
    on the float32 target (the planned-mode comparison)."""
    not_run = dict(not_run or {})
    # ar at `threads` target threads, as GenAI's arms; the planned mode with its plan's own split of the cores (the
    # same pipeline where the plan gives the target those threads)
    arms = {fmt: (path, {}) for fmt, path in bundles.items()}
    prompts = prompt_precision()
    arms.update({prefill_arm(fmt, prompts): (bundles[fmt], {"prefill_precision": prompts})
                 for fmt in PROMPT_ARMS[prompts] if fmt in bundles})
    kv_arms = {kv_arm(fmt, kv): (fmt, kv) for kv, formats in KV_ARMS.items() for fmt in formats if fmt in bundles}
    if cpu_attention.library() is not None:
        arms.update({arm: (bundles[fmt], {"kv_cache_precision": kv}) for arm, (fmt, kv) in kv_arms.items()})
    else:
        not_run.update(dict.fromkeys(kv_arms, "no C++ compiler here for the attention kernel"))
    pipes = {arm: Pipeline.load(path, target_threads=threads, enable_prefix_caching=False, **options)
             for arm, (path, options) in arms.items()}
    planned = {arm: pipe if pipe.defaults is not None and pipe.defaults.target_threads == threads
               else Pipeline.load(arms[arm][0], enable_prefix_caching=False, **arms[arm][1])
               for arm, pipe in pipes.items()}
    doc: dict[str, Any] = {"bundles": {f: str(p) for f, p in bundles.items()}, "threads": threads,
                           "lengths": list(size.lengths), "repeats": size.repeats, "new_tokens": size.new_tokens,
                           "genai": "LLMPipeline at its defaults (INFERENCE_NUM_THREADS and the LATENCY hint only)"}
    doc["speed"] = _speed(pipes, genai_by_format, size, not_run, report, progress)
    doc["prompts"] = _prompts(pipes, planned, genai_methods, size, not_run, report)
    with _float32_activations(bundles, threads) as kernels:
        doc["agreement"] = _agreement(pipes, size, kernels) if "float32" in pipes else {}
    doc["recommended"] = _recommended(doc)
    doc["not_run"] = not_run
    doc["targets"] = precision_targets(doc)
    return doc


def prompt_precision() -> str:
    """The precision this machine's arms prefill prompts at apart from the target: bf16 where the CPU has it."""
    return "bf16" if has_bf16() else "float32"


def prefill_arm(fmt: str, prompts: str) -> str:
    return f"{fmt} {prompts}-prefill"


def kv_arm(fmt: str, kv: str) -> str:
    return f"{fmt} {kv}-kv"


def _speed(pipes: dict[str, Pipeline], genai: dict[str, Method], size: PrecisionSize, not_run: dict[str, str],
           report: Callable[[str], None], progress: bool) -> dict[str, Any]:
    from tqdm import tqdm

    arms: dict[str, Method] = {f"ar {fmt}": PipelineMethod(f"ar {fmt}", pipe, "ar") for fmt, pipe in pipes.items()}
    arms.update({f"ov-genai {fmt}": method for fmt, method in genai.items()})
    main = next(iter(pipes.values()))
    lengths = [n for n in size.lengths if n + size.new_tokens <= main.context_limit]
    out: dict[str, Any] = {}
    bar = tqdm(total=len(lengths) * size.repeats * len(arms), desc="precision", file=sys.stderr, unit="run",
               disable=not progress, dynamic_ncols=True)
    try:
        for length in lengths:
            warm, *prompts = context_prompts(main, length, size.repeats + 1)
            runs: dict[str, list[MethodResult]] = {name: [] for name in arms}
            for name, method in arms.items():  # first runs at a new length allocate
                _generate(name, method.generate, warm, WARMUP_TOKENS, not_run, report)
            names = list(arms)
            for i, ids in enumerate(prompts):
                k = i % len(names)
                for name in names[k:] + names[:k]:
                    if name not in not_run:
                        result = _generate(name, arms[name].generate, ids, size.new_tokens, not_run, report)
                        if result is not None:
                            runs[name].append(result)
                    bar.update()
            out[str(length)] = {name: {"ttft_s": median(r.ttft_s for r in rs),
                                       "decode_tokens_per_s": median(decode_rate(r.token_ids, r.ttft_s, r.total_s)
                                                                     for r in rs)}
                                for name, rs in runs.items() if rs}
            report(f"precision {length} tokens: " + ", ".join(
                f"{n} {v['decode_tokens_per_s'] or 0:.1f} tok/s" for n, v in out[str(length)].items()))
    finally:
        bar.close()
    return out


def _prompts(pipes: dict[str, Pipeline], planned: dict[str, Pipeline], genai: dict[str, Method],
             size: PrecisionSize, not_run: dict[str, str], report: Callable[[str], None]) -> dict[str, Any]:
    """Every format's ar and planned mode and GenAI's methods on the benchmark prompts, the order rotating."""
    calls: dict[str, Callable[[list[int]], MethodResult]] = {}
    for fmt, pipe in pipes.items():
        calls[f"ar {fmt}"] = PipelineMethod(f"ar {fmt}", pipe, "ar").generate
        # the plan's mode, settings and threads: that pipeline's own generation config
        plan = planned[fmt]
        calls[f"planned {fmt}"] = PipelineMethod(f"planned {fmt}", plan, plan.generation_config.mode).generate
    calls.update({name: method.generate for name, method in genai.items()})
    rows: dict[str, list[float]] = {name: [] for name in calls}
    failures: list[dict[str, Any]] = []
    main = next(iter(pipes.values()))
    names = list(calls)
    prompts = select(size.per_kind)
    for i, prompt in enumerate(prompts):
        ids = main.prompt_ids(list(prompt.messages))
        tokens: dict[str, list[int]] = {}
        k = i % len(names)
        for name in names[k:] + names[:k]:
            if name in not_run:
                continue
            result = _generate(name, calls[name], ids, size.new_tokens, not_run, report)
            if result is not None:
                rows[name].append(len(result.token_ids) / result.total_s)
                tokens[name] = list(result.token_ids)
        for fmt in pipes:
            ar, planned = tokens.get(f"ar {fmt}"), tokens.get(f"planned {fmt}")
            if ar is not None and planned is not None and planned != ar:
                failures.append({"format": fmt, "prompt": prompt.name, "method": "planned",
                                 "first_difference": _first_difference(ar, planned)})
    summary = {name: statistics.median(v) for name, v in rows.items() if v}
    return {"tokens_per_s": summary, "prompts": len(prompts), "failures": failures}


@contextmanager
def _float32_activations(bundles: dict[str, Path], threads: int) -> Iterator[dict[str, Pipeline]]:
    """Per compressed format whose kernel takes int8 activations, its weights with float32 activations
    (export/target_weights.py float32_activations_copy, in a directory removed afterwards): what the agreement
    would be without the kernel's rounding of activations."""
    with ExitStack() as stack:
        pipes = {}
        for fmt, path in bundles.items():
            if Manifest.load(path).target.matmul_activations == "int8":
                scratch = Path(stack.enter_context(TemporaryDirectory(dir=path.parent, prefix=f".{path.name}-")))
                pipes[fmt] = Pipeline.load(float32_activations_copy(path, scratch / "bundle"), target_threads=threads,
                                           enable_prefix_caching=False)
        yield pipes


def _agreement(pipes: dict[str, Pipeline], size: PrecisionSize, kernels: dict[str, Pipeline]) -> dict[str, Any]:
    """Each format's top-1 per position on float32's greedy answers (teacher-forced), and how its own greedy
    answers differ from float32's, on the benchmark's prompts (untimed); for a format whose kernel rounds
    activations to int8, the top-1 of its weights with float32 activations (`kernels`) too (teacher-forced only:
    those steps are slow)."""
    tally = {fmt: {"same": 0, "positions": 0, "firsts": [], "same_f32_activations": 0} for fmt in pipes}
    prompts = select(size.agreement_per_kind)
    for prompt in prompts:
        ids = pipes["float32"].prompt_ids(list(prompt.messages))
        reference_answer = pipes["float32"].generate(ids, mode="ar", max_new_tokens=size.new_tokens).token_ids
        if len(reference_answer) < 2:
            continue
        seq = ids + list(reference_answer)
        reference = _teacher_forced_top1(pipes["float32"], seq[:-1], len(ids) - 1)
        for fmt, pipe in pipes.items():
            t = tally[fmt]
            t["same"] += int((_teacher_forced_top1(pipe, seq[:-1], len(ids) - 1) == reference).sum())
            t["positions"] += len(reference)
            if fmt in kernels:
                t["same_f32_activations"] += int(
                    (_teacher_forced_top1(kernels[fmt], seq[:-1], len(ids) - 1) == reference).sum())
            own = pipe.generate(ids, mode="ar", max_new_tokens=size.new_tokens).token_ids
            if own != reference_answer:
                t["firsts"].append(_first_difference(list(reference_answer), list(own)))

    def share(t: dict[str, Any], key: str) -> float | None:
        return t[key] / t["positions"] if t["positions"] else None

    return {fmt: {"top1_per_position": share(t, "same"),
                  # the same weights with float32 activations (None: the kernel takes float32 ones already)
                  "top1_float32_activations": share(t, "same_f32_activations") if fmt in kernels else None,
                  "positions": t["positions"], "greedy_answers_differ": len(t["firsts"]), "answers": len(prompts),
                  "median_first_divergence": statistics.median(t["firsts"]) if t["firsts"] else None}
            for fmt, t in tally.items()}


def _teacher_forced_top1(pipe: Pipeline, ids: list[int], start: int) -> np.ndarray:
    """The target's greedy token at positions [start, len(ids)) of `ids` given every token before: the prompt (up to
    start + 1) as a generation prefills it, the rest in one forward."""
    target = pipe.target
    cache = target.empty_cache()
    for lo, hi, on_prompt_graphs in prefill_chunks(0, start, target.prompt_split(start + 1)):
        _, cache = target.forward(ids[lo:hi], cache, logits_for=1, prompt=on_prompt_graphs)
    logits, _ = target.forward(ids[start:], cache, logits_for=len(ids) - start)
    logits = np.asarray(logits)
    return logits.reshape(-1, logits.shape[-1]).argmax(-1)


def _recommended(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The format whose planned mode ran fastest over the prompts, among those that keep float32's token at
    RECOMMEND_MIN_TOP1 of positions at least (a faster target that changes the text from its first tokens is not a
    default to recommend)."""
    rates = doc["prompts"]["tokens_per_s"]

    def top1(fmt: str) -> float | None:
        return doc["agreement"].get(fmt, {}).get("top1_per_position")

    planned = {k.removeprefix("planned "): v for k, v in rates.items() if k.startswith("planned ")}
    kept = {f: v for f, v in planned.items() if (top1(f) or 0.0) >= RECOMMEND_MIN_TOP1}
    if not kept:
        return None
    fmt = max(kept, key=kept.get)
    return {"format": fmt, "planned_tokens_per_s": kept[fmt], "ar_tokens_per_s": rates.get(f"ar {fmt}"),
            "top1_vs_float32": top1(fmt),
            "why": f"its planned mode ran fastest over the benchmark's prompts (prefill included) of the formats that "
                   f"keep float32's token at {RECOMMEND_MIN_TOP1:.0%} of positions or more"}


def precision_targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    speed, tokens = doc["speed"], doc["prompts"]["tokens_per_s"]

    def get(length: int, arm: str, key: str) -> float | None:
        return speed.get(str(length), {}).get(arm, {}).get(key)

    def best(length: int, key: str, higher: bool) -> float | None:
        genai = get(length, "ov-genai float32", key)
        ours = [arm for arm in speed.get(str(length), {}) if arm.startswith("ar ")]
        ratios = [get(length, arm, key) / genai for arm in ours if genai and get(length, arm, key) is not None]
        return (max if higher else min)(ratios) if ratios else None

    def same_width(fmt: str, length: int) -> float | None:
        ours, genai = get(length, f"ar {fmt}", "decode_tokens_per_s"), get(length, f"ov-genai {fmt}",
                                                                           "decode_tokens_per_s")
        return ours / genai if ours is not None and genai else None

    recommended = doc.get("recommended") or {}
    fastest_genai = max((v for k, v in tokens.items() if k in GENAI_METHODS), default=None)
    measured = {
        "ttft_512": best(512, "ttft_s", False), "ttft_2048": best(2048, "ttft_s", False),
        "decode_64": best(64, "decode_tokens_per_s", True), "decode_2048": best(2048, "decode_tokens_per_s", True),
        "planned": (recommended["planned_tokens_per_s"] / fastest_genai
                    if recommended and fastest_genai else None),
        **{f"{fmt}_decode_{n}": same_width(fmt, n) for fmt in ("int8", "int4") for n in (64, 2048)},
        "int8_top1": doc["agreement"].get("int8", {}).get("top1_per_position"),
    }
    return verdicts(TARGETS, measured)


def _generate(name: str, generate: Callable[..., MethodResult], ids: list[int], new_tokens: int,
              not_run: dict[str, str], report: Callable[[str], None]) -> MethodResult | None:
    """A greedy generation of one arm; None where it failed (named in not_run, and the arm runs no more)."""
    try:
        return generate(ids, max_new_tokens=new_tokens, temperature=0.0, seed=0)
    except Exception as e:  # a failing arm is reported, the others go on
        not_run[name] = f"{type(e).__name__}: {e}"
        report(f"precision: {name} failed: {not_run[name]}")
        return None


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


__all__ = ["FORMATS", "FULL", "PROMPT_ARMS", "QUICK", "PrecisionSize", "prefill_arm", "precision_targets",
           "prompt_precision", "run_precision", "sibling_bundles"]
