"""Beam search on the real target: ours (`Pipeline.generate(num_beams=...)` on the batching engine) beside
transformers' `generate(num_beams=...)` on the same float32 weights and OpenVINO GenAI's LLMPipeline beam search
(f32, as the benchmark pins it), on the serving benchmark's chat prompts, one prompt at a time, greedy.

Reported: each arm's wall time per prompt (median over rounds, the arms' order rotated, after a warm-up run of
each), our target runs per generated token, and per prompt whether our best beam's tokens equal
transformers' and GenAI's (and our returned beams transformers', with their scores' largest difference).

    .venv/bin/python lab/scripts/beam_search_real.py build/bundles/smollm2-feature --out results/beam-search.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from mirror_sd.bench.baselines import CACHE, check_sources, genai_dir
from mirror_sd.bench.machine import describe_machine
from mirror_sd.bench.serving import prompt_ids, serving_prompts
from mirror_sd.bench.variants import Sources
from mirror_sd.runtime.backends import usable_cores
from mirror_sd.runtime.pipeline import Pipeline


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import openvino as ov
    import openvino_genai as ov_genai
    import torch
    from transformers import AutoModelForCausalLM

    bundle = Path(args.bundle)
    threads = usable_cores()
    torch.set_num_threads(threads)
    pipe = Pipeline.load(bundle, huge_pages=False, max_num_seqs=2 * args.beams)
    eos = list(pipe.manifest.tokenizer.eos_token_ids)
    sources = Sources.real_pair(bundle)
    check_sources(bundle, pipe.manifest, sources)
    model = AutoModelForCausalLM.from_pretrained(sources.target, dtype=torch.float32).eval()
    genai = ov_genai.LLMPipeline(str(genai_dir(sources.target, CACHE, "target")), "CPU", INFERENCE_NUM_THREADS=threads,
                                 INFERENCE_PRECISION_HINT="f32", KV_CACHE_PRECISION="f32")
    cfg = ov_genai.GenerationConfig()
    cfg.max_new_tokens, cfg.num_beams, cfg.num_return_sequences = args.max_tokens, args.beams, 1
    cfg.stop_token_ids, cfg.eos_token_id = set(eos), eos[0]
    runs: dict[tuple[int, ...], float] = {}

    def ours(ids):
        batch = pipe.engine().batch
        before = batch.forwards
        result = pipe.generate(ids, num_beams=args.beams, num_return_sequences=args.beams,
                               max_new_tokens=args.max_tokens)
        runs[tuple(ids)] = (batch.forwards - before) / result.stats.target_steps
        return result

    def transformers(ids):
        with torch.inference_mode():
            return model.generate(torch.tensor([ids]), max_new_tokens=args.max_tokens, do_sample=False,
                                  num_beams=args.beams, num_return_sequences=args.beams, eos_token_id=eos,
                                  pad_token_id=eos[0], output_scores=True, return_dict_in_generate=True)

    def genai_arm(ids):
        tensor = ov.Tensor(np.array([ids], np.int64))
        return genai.generate(ov_genai.TokenizedInputs(tensor, ov.Tensor(np.ones_like(tensor.data))), cfg)

    arms = {"ours": ours, "transformers": transformers, "genai": genai_arm}
    prompts = [(p.name, prompt_ids(pipe.codec, p.messages)) for p in serving_prompts()[:args.prompts]]
    for arm in arms.values():  # warm-up: first runs load kernels and caches
        arm(prompts[-1][1])
    times: dict[tuple[str, str], list[float]] = {}
    answers: dict[tuple[str, str], object] = {}
    for round_ in range(args.rounds):
        for i, (name, ids) in enumerate(prompts):
            order = list(arms)[(i + round_) % 3:] + list(arms)[:(i + round_) % 3]  # arms rotated
            for arm in order:
                start = time.perf_counter()
                answers[name, arm] = arms[arm](ids)
                times.setdefault((name, arm), []).append(time.perf_counter() - start)
    rows = []
    for name, ids in prompts:
        out, theirs = answers[name, "transformers"], []
        for seq in out.sequences[:, len(ids):].tolist():
            end = next((i for i, t in enumerate(seq) if t in eos), None)
            theirs.append(seq if end is None else seq[:end + 1])
        row = {"name": name, "prompt_tokens": len(ids)}
        row.update({f"{arm}_s": statistics.median(times[name, arm]) for arm in arms})
        ours_result = answers[name, "ours"]
        best = ours_result.beams[0].token_ids
        row["best_equals_transformers"] = best == theirs[0]
        row["beams_equal_transformers"] = [b.token_ids for b in ours_result.beams] == theirs
        row["score_difference"] = float(np.max(np.abs(np.array([b.score for b in ours_result.beams])
                                                      - out.sequences_scores.numpy()))) \
            if row["beams_equal_transformers"] else None
        # GenAI's tokens leave out the ending token
        genai_best = list(answers[name, "genai"].tokens[0])
        row["best_equals_genai"] = [t for t in best if t not in eos] == [t for t in genai_best if t not in eos]
        row["target_runs_per_token"] = runs[tuple(ids)]
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    pipe.close()
    doc = {"what": __doc__.split("\n\n")[0], "num_beams": args.beams, "max_new_tokens": args.max_tokens,
           "threads": threads, "rounds": args.rounds, "rows": rows,
           "median_s": {arm: statistics.median(r[f"{arm}_s"] for r in rows)
                        for arm in ("ours", "transformers", "genai")},
           "best_equal_to_transformers": f"{sum(r['best_equals_transformers'] for r in rows)}/{len(rows)}",
           "beams_equal_to_transformers": f"{sum(r['beams_equal_transformers'] for r in rows)}/{len(rows)}",
           "best_equal_to_genai": f"{sum(r['best_equals_genai'] for r in rows)}/{len(rows)}",
           "machine": describe_machine()}
    Path(args.out).write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(json.dumps({k: doc[k] for k in ("median_s", "best_equal_to_transformers", "beams_equal_to_transformers",
                                           "best_equal_to_genai")}))


if __name__ == "__main__":
    main()
