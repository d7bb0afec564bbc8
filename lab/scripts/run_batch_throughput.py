"""`mirror-sd run-batch` beside OpenVINO GenAI's continuous batching, both offline in one process each: the same
chat prompts (the serving benchmark's, as ids through the bundle's template), all submitted at once, greedy, fp32.

Ours is the CLI as a user runs it (its own process, the bundle's plan, the prefix cache on); its tokens/s is the
run's own (the summary line: the load left out). GenAI's is ContinuousBatchingPipeline driven as bench/serving.py
drives it, with every request submitted at the start. Rounds alternate the two.

    .venv/bin/python lab/scripts/run_batch_throughput.py build/bundles/smollm2-feature --out results/run-batch.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mirror_sd.bench.baselines import CACHE, check_sources, genai_dir
from mirror_sd.bench.machine import describe_machine
from mirror_sd.bench.ov_genai import GenAIServing
from mirror_sd.bench.serving import prompt_ids, serving_prompts
from mirror_sd.bench.variants import Sources
from mirror_sd.runtime.backends import usable_cores
from mirror_sd.runtime.pipeline import Pipeline

SUMMARY = re.compile(r"(\d+) tokens in ([\d.]+) s \(([\d.]+) tokens/s; generations at once: (\d+) at most\)")


def ours(bundle: Path, requests: list[dict], max_num_seqs: int, work: Path) -> dict:
    inp, out = work / "in.jsonl", work / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in requests))
    done = subprocess.run([sys.executable, "-m", "mirror_sd.cli", "run-batch", str(bundle), "-i", str(inp), "-o",
                           str(out), "--model-name", "bench", "--max-num-seqs", str(max_num_seqs)],
                          capture_output=True, text=True, check=True)
    tokens, seconds, rate, most = SUMMARY.search(done.stderr).groups()
    texts = [json.loads(line)["response"]["body"]["choices"][0]["message"]["content"]
             for line in out.read_text().splitlines()]
    return {"tokens": int(tokens), "wall_s": float(seconds), "tokens_per_s": float(rate), "most_running": int(most),
            "texts": texts}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    bundle = Path(args.bundle)
    prompts = serving_prompts()[:args.requests]
    pipe = Pipeline.load(bundle, huge_pages=False)
    ids = [prompt_ids(pipe.codec, p.messages) for p in prompts]
    eos, manifest, codec = list(pipe.manifest.tokenizer.eos_token_ids), pipe.manifest, pipe.codec
    pipe.close()
    sources = Sources.real_pair(bundle)
    check_sources(bundle, manifest, sources)
    genai = GenAIServing(genai_dir(sources.target, CACHE, "target"), threads=usable_cores(), eos_token_ids=eos,
                         max_num_seqs=args.requests)
    requests = [{"custom_id": p.name, "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": "bench", "messages": list(p.messages), "max_tokens": args.max_tokens,
                          "temperature": 0}} for p in prompts]
    rounds = []
    with tempfile.TemporaryDirectory() as work:
        for r in range(args.rounds):
            arms = ["ours", "genai"] if r % 2 == 0 else ["genai", "ours"]
            row = {}
            for arm in arms:
                if arm == "ours":
                    row["ours"] = ours(bundle, requests, args.requests, Path(work))
                else:
                    replies, wall = genai.closed_loop(ids, len(ids), args.max_tokens)
                    tokens = sum(len(x.token_ids) for x in replies)
                    row["genai"] = {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
                                    "texts": [codec.decode(x.token_ids) for x in replies]}
                print(f"round {r} {arm}: {row[arm]['tokens_per_s']:.1f} tokens/s", file=sys.stderr, flush=True)
            rounds.append(row)
    last = rounds[-1]
    same = sum(a.strip() == b.strip() for a, b in zip(last["ours"]["texts"], last["genai"]["texts"]))
    doc = {"what": __doc__.split("\n\n")[0], "requests": args.requests, "max_tokens": args.max_tokens,
           "rounds": [{arm: {k: v for k, v in row[arm].items() if k != "texts"} for arm in row} for row in rounds],
           "median_tokens_per_s": {arm: statistics.median(row[arm]["tokens_per_s"] for row in rounds)
                                   for arm in ("ours", "genai")},
           "texts_equal_to_genai": f"{same}/{len(prompts)}", "machine": describe_machine()}
    doc["ours_over_genai"] = doc["median_tokens_per_s"]["ours"] / doc["median_tokens_per_s"]["genai"]
    Path(args.out).write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(json.dumps({k: doc[k] for k in ("median_tokens_per_s", "ours_over_genai", "texts_equal_to_genai")}))


if __name__ == "__main__":
    main()
