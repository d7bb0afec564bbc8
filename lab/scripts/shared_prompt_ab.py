"""Requests that arrive together with one prompt, or one long head: the batching engine letting the later ones wait
for the first's prefill and copy its KV (BatchEngine._head_coming, the engine now) against every one prefilling its
whole prompt beside the others (the engine before: _head_coming returning None), beside OpenVINO GenAI's continuous
batching (f32, prefix caching on) on the same prompts.

Two loads, greedy ar, 16 new tokens, all requests submitted at once: "same", 4 copies of one ~700-token prompt
(a request's n choices, clients sending one prompt); "head", 8 prompts of one ~700-token system head and each its
own question. Every round takes a head of its own (nothing cached from an earlier round; our engine's cache emptied
before each of its arms), the arms rotated. Reported per load and arm: the median wall time to the last answer and
the median time to a first token, and how many answers equal the prompt's alone (Pipeline.generate).

    PYTHONPATH=lab/scripts .venv/bin/python lab/scripts/shared_prompt_ab.py build/bundles/smollm2-feature \\
        --out results/shared-prompt.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from slot_packing_ab import write_results

from mirror_sd.bench.baselines import CACHE, check_sources, genai_dir
from mirror_sd.bench.ov_genai import GenAIServing
from mirror_sd.bench.serving import serving_prompts
from mirror_sd.bench.variants import Sources
from mirror_sd.runtime import batching
from mirror_sd.runtime.backends import usable_cores
from mirror_sd.runtime.pipeline import Pipeline

NOW = batching.BatchEngine._head_coming
NEW_TOKENS = 16


def loads(pipe: Pipeline, round_: int) -> dict[str, list[list[int]]]:
    """This round's prompts: a system head of its own (its first words name the round) and the serving prompts'
    questions."""
    texts = [m["content"] for p in serving_prompts() for m in p.messages]
    questions = [p.messages[-1]["content"] for p in serving_prompts()[:8]]

    def ids(load: str, question: str) -> list[int]:
        # a head of each load's own: GenAI's prefix cache would otherwise give the second load the first one's
        head_text = f"Round {round_}, {load}. You are a helpful assistant. Use this reference text: " + " ".join(
            texts[:20])
        messages = [{"role": "system", "content": head_text}, {"role": "user", "content": question}]
        return pipe.codec.encode(pipe.codec.render_chat(messages), special=False)

    return {"same": [ids("same", questions[0])] * 4, "head": [ids("head", q) for q in questions]}


def ours(pipe: Pipeline, prompts: list[list[int]], waits: bool) -> tuple[float, list[float], list[list[int]]]:
    batching.BatchEngine._head_coming = NOW if waits else (lambda self, row: None)
    start = time.perf_counter()
    results = pipe.generate(prompts, mode="ar", max_new_tokens=NEW_TOKENS)
    wall = time.perf_counter() - start
    return wall, [r.stats.ttft_s for r in results], [list(r.token_ids) for r in results]


def genai(serving: GenAIServing, prompts: list[list[int]]) -> tuple[float, list[float], list[list[int]]]:
    replies, wall = serving.closed_loop(prompts, clients=len(prompts), max_new_tokens=NEW_TOKENS)
    return wall, [r.ttft_s for r in replies], [r.token_ids for r in replies]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    bundle = Path(args.bundle)
    pipe = Pipeline.load(bundle, huge_pages=False, max_num_seqs=8)
    sources = Sources.real_pair(bundle)
    check_sources(bundle, pipe.manifest, sources)
    eos = list(pipe.manifest.tokenizer.eos_token_ids)
    serving = GenAIServing(genai_dir(sources.target, CACHE, "target"), threads=usable_cores(), eos_token_ids=eos,
                           max_num_seqs=8, prefix_caching=True)
    arms = {"waits": lambda p: ours(pipe, p, True), "prefills_each": lambda p: ours(pipe, p, False),
            "genai_cb": lambda p: genai(serving, p)}
    warm = loads(pipe, -1)
    for arm in arms.values():
        arm(warm["same"][:1])
    runs = []
    for round_ in range(args.rounds):
        for load, batch in loads(pipe, round_).items():
            alone = [list(pipe.generate(p, mode="ar", max_new_tokens=NEW_TOKENS).token_ids) for p in batch]
            for arm in list(arms)[round_ % 3:] + list(arms)[:round_ % 3]:
                for slot in pipe.engine().table.slots:  # nothing cached from the other arms
                    slot.tokens = []
                wall, ttft, tokens = arms[arm](batch)
                runs.append({"load": load, "arm": arm, "round": round_, "requests": len(batch),
                             "prompt_tokens": [len(p) for p in batch], "wall_s": wall, "ttft_s": ttft,
                             "equal_to_alone": sum(a == b for a, b in zip(tokens, alone))})
                print(load, arm, round(wall, 2), round(statistics.median(ttft), 3), runs[-1]["equal_to_alone"],
                      flush=True)
    summary = {}
    for load in ("same", "head"):
        summary[load] = {arm: {"wall_s": statistics.median(r["wall_s"] for r in runs if r["load"] == load
                                                           and r["arm"] == arm),
                               "ttft_s": statistics.median(statistics.median(r["ttft_s"]) for r in runs
                                                           if r["load"] == load and r["arm"] == arm)}
                         for arm in arms}
    print(summary)
    write_results(args.out, __doc__.split("\n\n")[0], str(bundle), summary, runs, new_tokens=NEW_TOKENS,
                  threads=usable_cores())


if __name__ == "__main__":
    main()
