"""The target's weight formats side by side: agreement with the float32 target, and speed.

agreement: on every benchmark prompt the float32 bundle's greedy answer (prompt + answer, teacher-forced) runs
through each bundle's target in one forward; top-1 agreement per answer position with the float32 target's logits,
then each bundle's own greedy answer: whether it differs from the float32 one and where it first does.
speed (run on a quiet machine): ar decode tokens/s and TTFT at several prompt lengths, per bundle, the bundle order
alternating from repeat to repeat.

    .venv/bin/python lab/scripts/target_weights_ab.py build/bundles/smollm2-feature \
        build/bundles/smollm2-feature-int8 build/bundles/smollm2-feature-int4 --agreement --out results/x.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from mirror_sd.bench.machine import describe_machine
from mirror_sd.models.benchmark_prompts import PROMPTS
from mirror_sd.runtime.pipeline import Pipeline


def teacher_forced_top1(pipe: Pipeline, ids: list[int], start: int) -> np.ndarray:
    """The target's greedy token at every position from `start` on, over `ids` in one forward."""
    target = pipe.target
    logits, _ = target.forward(ids, target.empty_cache(), logits_for=len(ids) - start)
    return np.asarray(logits).reshape(-1, np.asarray(logits).shape[-1]).argmax(-1)


def agreement(pipes: dict[str, Pipeline], new_tokens: int) -> dict:
    base_name = next(iter(pipes))
    base = pipes[base_name]
    rows = {name: {"same": 0, "positions": 0, "texts_differ": 0, "first_divergence": []} for name in pipes}
    for p in PROMPTS:
        ids = base.prompt_ids(list(p.messages))
        answer = base.generate(ids, mode="ar", max_new_tokens=new_tokens, temperature=0.0).token_ids
        seq = ids + answer
        reference = teacher_forced_top1(base, seq[:-1], len(ids) - 1)
        for name, pipe in pipes.items():
            mine = teacher_forced_top1(pipe, seq[:-1], len(ids) - 1)
            rows[name]["same"] += int((mine == reference).sum())
            rows[name]["positions"] += len(reference)
            own = pipe.generate(ids, mode="ar", max_new_tokens=new_tokens, temperature=0.0).token_ids
            if own != answer:
                rows[name]["texts_differ"] += 1
                rows[name]["first_divergence"].append(
                    next((i for i, (a, b) in enumerate(zip(own, answer)) if a != b), min(len(own), len(answer))))
        print(p.name, {n: round(r["same"] / r["positions"], 4) for n, r in rows.items()}, flush=True)
    return {name: {"top1_per_position": r["same"] / r["positions"], "positions": r["positions"],
                   "greedy_texts_differ": r["texts_differ"], "prompts": len(PROMPTS),
                   "median_first_divergence": statistics.median(r["first_divergence"]) if r["first_divergence"]
                   else None} for name, r in rows.items()}


class GenAI:
    """OpenVINO GenAI's LLMPipeline on the converted target: at its defaults (this CPU: bf16 compute, u8 KV cache)
    or pinned to f32 as the benchmark pins it."""

    def __init__(self, target_dir: str, threads: int, defaults: bool) -> None:
        import openvino_genai as ov_genai

        from mirror_sd.bench.ov_genai import _properties

        props = {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"} if defaults else _properties(threads)
        self.pipe = ov_genai.LLMPipeline(target_dir, "CPU", **props)

    def generate(self, ids: list[int], mode: str, max_new_tokens: int, temperature: float):
        import openvino as ov
        import openvino_genai as ov_genai

        cfg = ov_genai.GenerationConfig()
        cfg.max_new_tokens, cfg.do_sample = max_new_tokens, False
        x = np.array([ids], dtype=np.int64)
        start = time.perf_counter()
        result = self.pipe.generate(ov_genai.TokenizedInputs(ov.Tensor(x), ov.Tensor(np.ones_like(x))), cfg)
        wall = time.perf_counter() - start
        m = result.perf_metrics

        class Stats:  # what speed() reads of a GenerationResult's stats
            ttft_s = m.get_ttft().mean / 1000.0
            new_tokens = len(result.tokens[0])
            wall_s = wall
        return type("Result", (), {"stats": Stats})


def speed(pipes: dict[str, Pipeline], lengths: list[int], new_tokens: int, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    out: dict = {name: {} for name in pipes}
    for length in lengths:
        samples: dict[str, dict[str, list[float]]] = {name: {"ttft_s": [], "decode_tok_s": []} for name in pipes}
        for r in range(repeats):
            ids = rng.integers(1000, 40000, size=length).tolist()  # fresh text each repeat: no cache helps
            order = list(pipes) if r % 2 == 0 else list(reversed(pipes))
            for name in order:
                stats = pipes[name].generate(ids, mode="ar", max_new_tokens=new_tokens, temperature=0.0).stats
                samples[name]["ttft_s"].append(stats.ttft_s)
                samples[name]["decode_tok_s"].append((stats.new_tokens - 1) / (stats.wall_s - stats.ttft_s))
        for name in pipes:
            out[name][str(length)] = {k: statistics.median(v) for k, v in samples[name].items()}
        print(length, {n: out[n][str(length)] for n in pipes}, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundles", nargs="+", help="the float32 bundle first")
    parser.add_argument("--agreement", action="store_true")
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--lengths", default="64,512,2048")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--genai-target", default=None, help="the target converted for GenAI: adds GenAI at its "
                                                                   "defaults and at f32 to --speed")
    parser.add_argument("--genai-weights", default="", help="comma list of int8, int4: GenAI on the target converted "
                                                             "with those NNCF weights too, at its defaults and f32")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    pipes = {Path(b).name: Pipeline.load(b, target_threads=args.threads) for b in args.bundles}
    if args.genai_target and args.speed:
        pipes["ov-genai-defaults"] = GenAI(args.genai_target, args.threads, defaults=True)
        pipes["ov-genai-f32"] = GenAI(args.genai_target, args.threads, defaults=False)
    for weights in filter(None, args.genai_weights.split(",")):
        from mirror_sd.bench.baselines import CACHE, Sources, genai_dir

        converted = str(genai_dir(Sources.real_pair(Path(args.bundles[0])).target, CACHE, "target", weights))
        pipes[f"ov-genai-{weights}-defaults"] = GenAI(converted, args.threads, defaults=True)
        pipes[f"ov-genai-{weights}-f32"] = GenAI(converted, args.threads, defaults=False)
    report = {"what": __doc__.splitlines()[0], "machine": describe_machine(), "bundles": args.bundles,
              "created": time.strftime("%Y-%m-%d %H:%M:%S")}
    if args.agreement:  # the project's bundles only
        report["agreement"] = agreement({n: p for n, p in pipes.items() if isinstance(p, Pipeline)}, args.new_tokens)
    if args.speed:
        report["speed"] = speed(pipes, [int(x) for x in args.lengths.split(",")], args.new_tokens, args.repeats)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
