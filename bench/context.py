"""The context-length benchmark: time to first token and decode speed against prompt length, side by side.

Prompts are real text: passages of Python's own documentation (the pydoc topics that ship with CPython) under a
request to summarise them, in the bundle's chat template, cut to exactly N prompt tokens. Every repetition takes
another passage, so no method reuses a cached prompt (OpenVINO GenAI's LLMPipeline caches prompt prefixes by
default; the runtime here does not).

Per length, after one short warm-up run of every method on a prompt of that length (first runs at a new length
allocate; WARMUP_TOKENS new tokens, enough for sd and mirror to run their draft and their gates' first tries there
rather than in the first timed run), interleaved with the order rotating per repetition:
- ar at 1 and at 2 target threads ("ar" is the faster at that length, as OpenVINO GenAI ar is its faster of 1 and 2);
- sd at ar's best target threads overall (its draft and target never run together), mirror at the bundle plan's;
- ar with the target on OpenVINO (runtime/portable.py), the CPU-only backend;
- OpenVINO GenAI ar (LLMPipeline, the same fp32 target and fp32 KV cache) at 1 and 2 threads.
TTFT is prompt in -> first token out; decode tokens/s is (new tokens - 1) / (total - TTFT), medians over the
repetitions. Greedy outputs are compared with ar's at the same prompt.

The target's kernels, per length, on the ar pipeline: a verification step of 5 tokens over a step of 1 (the
target alone, from the same cache), and the split target (prefix + suffix, two sessions) over one graph holding
both (bench/unsplit.py), both medians of repeated steps taken in alternation.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from mirror_sd.bench.methods import Method, MethodResult
from mirror_sd.bench.pipeline_methods import PipelineMethod
from mirror_sd.bench.summary import decode_rate, median, verdicts
from mirror_sd.runtime.pipeline import Pipeline

NEW_TOKENS = 32
WARMUP_TOKENS = 8
QUESTION = "\n\nSummarise the passage above in detail."
# Issue 11's bars, each a ratio of medians measured here: (key, what, target, higher is better)
TARGETS = (
    ("ttft_vs_genai", "TTFT over OpenVINO GenAI ar's (worst length)", 1.2, False),
    ("ar_decode_vs_genai_64", "ar decode tokens/s over OpenVINO GenAI ar's at 64 prompt tokens", 1.0, True),
    ("ar_decode_vs_genai_2048", "ar decode tokens/s over OpenVINO GenAI ar's at 2048 prompt tokens", 0.9, True),
    ("flat_ar", "ar decode at the longest prompt over ar decode at 64", 0.75, True),
    ("flat_sd", "sd decode at the longest prompt over sd decode at 64", 0.75, True),
    ("flat_mirror", "mirror decode at the longest prompt over mirror decode at 64", 0.75, True),
    ("verify_5_over_1", "a 5-token target step over a 1-token step (shortest prompt)", 1.25, False),
    ("split_over_unsplit", "prefix + suffix over one unsplit graph (worst length, 1-token steps)", 1.05, False),
)


@dataclass(frozen=True)
class ContextSize:
    lengths: tuple[int, ...]
    repeats: int  # prompts per length (each method runs each once)
    kernel_repeats: int  # timed target steps per kernel measurement


QUICK = ContextSize((64, 512), repeats=1, kernel_repeats=5)
FULL = ContextSize((64, 512, 2048, 4096), repeats=3, kernel_repeats=40)


def _passages() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def context_prompts(pipe: Pipeline, length: int, count: int, text: list[int] | None = None) -> list[list[int]]:
    """`count` prompts of exactly `length` tokens: chat template, a passage, the question; passage i starts where
    passage i - 1 ended (the documentation is some 200,000 tokens long: nothing repeats). text: the passages'
    token ids, when the caller has them already."""
    codec = pipe.codec
    wrapped = (codec.render_chat([{"role": "user", "content": "\x00"}]) if pipe.codec.chat_template
               else "\x00")
    head, tail = wrapped.split("\x00")
    head_ids, tail_ids = codec.encode(head, special=False), codec.encode(QUESTION + tail, special=False)
    room = length - len(head_ids) - len(tail_ids)
    if room < 1:
        raise ValueError(f"a {length}-token prompt leaves no room for a passage")
    text = text if text is not None else codec.encode(_passages(), special=False)
    if count * room > len(text):
        raise ValueError(f"{count} passages of {room} tokens are more than the documentation holds")
    return [head_ids + text[i * room:(i + 1) * room] + tail_ids for i in range(count)]


def _decode_rate(r: MethodResult) -> float | None:
    return decode_rate(r.token_ids, r.ttft_s, r.total_s)


def _best(rows: dict[str, dict[str, Any]], names: list[str]) -> tuple[str | None, dict[str, Any] | None]:
    """The method among `names` with the highest median decode rate at this length (its TTFT goes with it)."""
    found = [(rows[n]["decode_tokens_per_s"] or 0.0, n) for n in names if n in rows]
    if not found:
        return None, None
    name = max(found)[1]
    return name, rows[name]


def time_kernels(pipe: Pipeline, ids: list[int], unsplit, repeats: int) -> dict[str, Any]:
    """Median seconds of 1- and 5-token target steps from the prompt's cache, split and (if given) unsplit; the
    measurements alternate, so drift on a shared machine falls on all of them alike."""
    target = pipe.target
    _, cache = target.prefill(ids, target.empty_cache())
    calls: dict[str, Callable[[], object]] = {
        f"step_{t}_s": (lambda t=t: target.forward(ids[-t:], cache, logits_for=t)) for t in (1, 5)}
    if unsplit is not None:
        unsplit.prefill(ids)
        calls.update({f"unsplit_step_{t}_s": (lambda t=t: unsplit.step(ids[-t:], len(ids))) for t in (1, 5)})
    times: dict[str, list[float]] = {name: [] for name in calls}
    for i in range(repeats + 1):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            if i:  # the first round warms up
                times[name].append(time.perf_counter() - start)
    out: dict[str, Any] = {name: statistics.median(t) for name, t in times.items()}
    out["verify_5_over_1"] = out["step_5_s"] / out["step_1_s"]
    if unsplit is not None:
        out["split_over_unsplit"] = out["step_1_s"] / out["unsplit_step_1_s"]
        out["split_over_unsplit_5"] = out["step_5_s"] / out["unsplit_step_5_s"]
    return out


def run_context(bundle: Path, size: ContextSize, main: Pipeline, ar_pipes: dict[int, Pipeline],
                genai: dict[int, Method], methods: list[str], report: Callable[[str], None],
                progress: bool = True, cache: Path | None = None, sd_pipe: Pipeline | None = None
                ) -> dict[str, Any]:
    """The whole context benchmark as plain data (bench.json's "context"). sd_pipe: the pipeline sd runs on
    (default: main)."""
    from tqdm import tqdm

    from mirror_sd.bench.unsplit import open_unsplit

    runners: list[Method] = [PipelineMethod(f"ar@{n}t", p, "ar") for n, p in sorted(ar_pipes.items())]
    sd_pipe = sd_pipe or main
    runners += [PipelineMethod(m, sd_pipe if m == "sd" else main, m) for m in ("sd", "mirror") if m in methods]
    not_run: dict[str, str] = {}
    try:
        ov = Pipeline.load(bundle, target_backend="openvino", target_threads=max(ar_pipes),
                           draft_threads=main.draft_threads)
        runners.append(PipelineMethod("ar-openvino", ov, "ar"))
    except Exception as e:  # a backend that cannot open is reported, the rest runs
        not_run["ar-openvino"] = f"{type(e).__name__}: {e}"
    runners += [_Renamed(f"ov-genai-ar@{n}t", m) for n, m in sorted(genai.items())]
    try:
        unsplit = open_unsplit(bundle, main.manifest, ar_pipes[max(ar_pipes)].target, cache)
    except Exception as e:  # the unsplit baseline is reported as not run, the rest runs
        unsplit, not_run["unsplit"] = None, f"{type(e).__name__}: {e}"

    lengths = [n for n in size.lengths if n + NEW_TOKENS <= main.context_limit]
    doc: dict[str, Any] = {"lengths": lengths, "new_tokens": NEW_TOKENS, "repeats": size.repeats,
                           "methods": [r.name for r in runners], "not_run": not_run, "per_length": {},
                           "threads": {"sd_mirror": [main.target_threads, main.draft_threads],
                                       "sd": [sd_pipe.target_threads, sd_pipe.draft_threads],
                                       "ar": sorted(ar_pipes), "ov_genai_ar": sorted(genai)}}
    text = main.codec.encode(_passages(), special=False)
    bar = tqdm(total=len(lengths) * size.repeats * len(runners), desc="context lengths", file=sys.stderr,
               unit="run", disable=not progress, dynamic_ncols=True)
    try:
        for length in lengths:
            warm, *prompts = context_prompts(main, length, size.repeats + 1, text)
            for method in runners:  # first runs at a new length allocate (ORT's arena, OpenVINO's shapes)
                if method.name not in not_run:
                    try:
                        method.generate(warm, max_new_tokens=WARMUP_TOKENS, temperature=0.0, seed=0)
                    except Exception as e:  # a method whose warm-up fails is reported, the others go on
                        not_run[method.name] = f"{type(e).__name__}: {e}"
            runs: dict[str, list[MethodResult]] = {r.name: [] for r in runners}
            for i, ids in enumerate(prompts):
                k = i % len(runners)
                for method in runners[k:] + runners[:k]:
                    if method.name not in not_run:
                        try:
                            runs[method.name].append(method.generate(ids, max_new_tokens=NEW_TOKENS,
                                                                     temperature=0.0, seed=0))
                        except Exception as e:  # a failing method is reported, the others go on
                            not_run[method.name] = f"{type(e).__name__}: {e}"
                            report(f"context {length}: {method.name} failed: {e}")
                    bar.update()
            doc["per_length"][str(length)] = _length_doc(runs, prompts)
            doc["per_length"][str(length)]["kernels"] = time_kernels(ar_pipes[max(ar_pipes)], prompts[0], unsplit,
                                                                     size.kernel_repeats)
    finally:
        bar.close()
        if unsplit is not None:
            unsplit.close()
    doc["targets"] = context_targets(doc)
    return doc


class _Renamed:
    """A baseline under a name that says its thread count."""

    def __init__(self, name: str, method: Method) -> None:
        self.name, self.method = name, method

    def generate(self, prompt_ids, **kw) -> MethodResult:
        return self.method.generate(prompt_ids, **kw)

    def close(self) -> None:
        pass


def _length_doc(runs: dict[str, list[MethodResult]], prompts: list[list[int]]) -> dict[str, Any]:
    rows = {}
    for name, results in runs.items():
        if not results:
            continue
        rows[name] = {"ttft_s": median(r.ttft_s for r in results),
                      "decode_tokens_per_s": median(_decode_rate(r) for r in results),
                      "new_tokens": [len(r.token_ids) for r in results],
                      "mean_accepted_tokens": median(r.stats.get("mean_accepted_tokens") for r in results),
                      "draft_context_steps": sum(r.stats.get("draft_context_steps", 0) for r in results)}
    ar_name, ar = _best(rows, ["ar@1t", "ar@2t"])
    genai_name, genai = _best(rows, ["ov-genai-ar@1t", "ov-genai-ar@2t"])
    if ar is not None:
        rows["ar"] = {**ar, "from": ar_name}
    if genai is not None:
        rows["ov-genai-ar"] = {**genai, "from": genai_name}
    # greedy identity: every method's tokens against ar's (ar@2t when both ran) on the same prompt
    # (None: not compared, where either side has no run of some prompt)
    reference = runs.get(ar_name or "", [])
    identical = {name: (None if not reference or len(results) != len(reference) else
                        all(a.token_ids == b.token_ids for a, b in zip(reference, results)))
                 for name, results in runs.items() if name.startswith(("ar", "sd", "mirror"))}
    return {"prompt_tokens": len(prompts[0]), "methods": rows, "identical_to_ar": identical}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def context_targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    per = doc["per_length"]
    lengths = [int(n) for n in per]
    if not lengths:
        return []
    short, longest = str(min(lengths)), str(max(lengths))
    # the bars are written for 64 and 2048 prompt tokens; a run without those lengths reports them unmeasured

    def get(length: str, method: str, key: str) -> float | None:
        return per.get(length, {}).get("methods", {}).get(method, {}).get(key)

    ttft = [_ratio(get(n, "ar", "ttft_s"), get(n, "ov-genai-ar", "ttft_s")) for n in per]
    measured = {
        "ttft_vs_genai": max((r for r in ttft if r is not None), default=None),
        "ar_decode_vs_genai_64": _ratio(get("64", "ar", "decode_tokens_per_s"),
                                        get("64", "ov-genai-ar", "decode_tokens_per_s")),
        "ar_decode_vs_genai_2048": _ratio(get("2048", "ar", "decode_tokens_per_s"),
                                          get("2048", "ov-genai-ar", "decode_tokens_per_s")),
        "verify_5_over_1": per[short].get("kernels", {}).get("verify_5_over_1"),
        "split_over_unsplit": max((per[n].get("kernels", {}).get("split_over_unsplit") or 0.0 for n in per),
                                  default=None) or None,
    }
    for mode in ("ar", "sd", "mirror"):
        measured[f"flat_{mode}"] = (_ratio(get(longest, mode, "decode_tokens_per_s"),
                                           get(short, mode, "decode_tokens_per_s"))
                                    if longest != short else None)
    return verdicts(TARGETS, measured)
