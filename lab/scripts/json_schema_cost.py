"""What a JSON schema costs a generation on the real pair (runtime/grammar.py): the masks' time per target step and
the draft's acceptance under the schema, against the same prompts without one, every mode, in one process.

    .venv/bin/python lab/scripts/json_schema_cost.py build/bundles/smollm2-feature --out results/json-schema-cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from mirror_sd.runtime import grammar
from mirror_sd.runtime.pipeline import Pipeline

PROMPTS = [
    "Describe a cat as JSON with its name, age and color.",
    "Give me a JSON object for a book: title, author, year.",
    "Return the weather in Paris as JSON: city, temperature_c, condition.",
    "A user profile as JSON with name, email and a list of interests.",
    "Summarise this order as JSON (item, quantity, price): two apples at 0.5 each.",
    "List three planets as JSON: an object with a list named planets.",
]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "facts"],
          "properties": {"name": {"type": "string"}, "facts": {"type": "array", "items": {"type": "string"}}}}
ARMS = {"none": None, "json_object": {"type": "object"}, "schema": SCHEMA}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    spent = [0.0, 0]
    masks = grammar.GrammarState.masks

    def timed(self, *a, **k):
        started = time.perf_counter()
        try:
            return masks(self, *a, **k)
        finally:
            spent[0] += time.perf_counter() - started
            spent[1] += 1

    grammar.GrammarState.masks = timed
    pipe = Pipeline.load(Path(args.bundle))
    runs = []
    for r in range(args.rounds):
        for mode in ("ar", "sd", "mirror"):
            for arm, schema in ARMS.items():
                for prompt in PROMPTS:
                    spent[:] = [0.0, 0]
                    out = pipe.generate([{"role": "user", "content": prompt}], mode=mode,
                                        max_new_tokens=args.tokens, json_schema=schema)
                    valid = None
                    if schema is not None and out.finish_reason == "eos":
                        try:
                            json.loads(out.text)
                            valid = True
                        except ValueError:
                            valid = False
                    s = out.stats
                    runs.append({"round": r, "mode": mode, "arm": arm, "prompt": prompt, "tokens": len(out.token_ids),
                                 "finish_reason": out.finish_reason, "json_parses": valid,
                                 "wall_s": s["wall_s"], "target_steps": s["target_steps"],
                                 "proposed_tokens": s["proposed_tokens"], "accepted_tokens": s["accepted_tokens"],
                                 "mask_s": round(spent[0], 5), "mask_calls": spent[1], "text": out.text})
                    print(json.dumps({k: v for k, v in runs[-1].items() if k != "text"}), flush=True)
    summary = {}
    for mode in ("ar", "sd", "mirror"):
        for arm in ARMS:
            sel = [x for x in runs if x["mode"] == mode and x["arm"] == arm]
            summary[f"{mode} {arm}"] = {
                "median_tokens_per_s": round(statistics.median(x["tokens"] / x["wall_s"] for x in sel), 2),
                "tokens_per_step": round(sum(x["tokens"] for x in sel) / sum(x["target_steps"] for x in sel), 3),
                "acceptance": round(sum(x["accepted_tokens"] for x in sel) / max(1, sum(x["proposed_tokens"]
                                                                                      for x in sel)), 3),
                "mask_ms_per_token": round(1e3 * sum(x["mask_s"] for x in sel) / sum(x["tokens"] for x in sel), 3),
                "mask_share_of_wall": round(sum(x["mask_s"] for x in sel) / sum(x["wall_s"] for x in sel), 4),
                "ended_with_eos": sum(x["finish_reason"] == "eos" for x in sel), "runs": len(sel),
                "json_parses": sum(bool(x["json_parses"]) for x in sel)}
    texts = {}
    for x in runs:
        texts.setdefault((x["arm"], x["prompt"], x["round"]), set()).add(x["text"])
    doc = {"question": "what does a JSON schema cost a generation (the masks, the draft's acceptance)?",
           "bundle": args.bundle, "new_tokens": args.tokens, "rounds": args.rounds, "schema": SCHEMA,
           "summary": summary,
           "modes_equal_per_prompt": all(len(v) == 1 for v in texts.values()), "runs": runs}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
