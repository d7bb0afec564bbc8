"""A grammar's forced tokens verified as a window (runtime/proposers.py GrammarForcing) against the same generations
without them, on the real pair, every mode, in one process, arms alternating per prompt.

Workloads: an extraction schema of six fields (the keys and punctuation forced), the json_schema_cost script's
two-field schema, and tool_choice "required" over two tools (the server's calls_schema). The "off" arm replaces
GrammarForcing.propose with one that proposes nothing, so each step runs as it did before forced windows.

    .venv/bin/python lab/scripts/grammar_forcing_ab.py build/bundles/smollm2-feature --out results/grammar-forcing.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from json_schema_cost import PROMPTS as FACT_PROMPTS
from json_schema_cost import SCHEMA as FACT_SCHEMA

from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.runtime.proposers import GrammarForcing
from mirror_sd.serve.tools import Tool, calls_schema

CONTACT = {"type": "object", "additionalProperties": False,
           "required": ["name", "age", "email", "city", "country", "occupation"],
           "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
                          "city": {"type": "string"}, "country": {"type": "string"},
                          "occupation": {"type": "string"}}}
CONTACT_PROMPTS = [
    "Extract the contact as JSON: Maria Lopez, 34, maria.lopez@example.com, a nurse in Madrid, Spain.",
    "Extract the contact as JSON: Tom Becker (41) lives in Hamburg, Germany and teaches maths; tom@becker.de.",
    "Extract the contact as JSON: Aiko Tanaka, software engineer, 29 years old, Osaka, Japan, aiko.t@mail.jp.",
    "Extract the contact as JSON: Pierre Martin is a 52-year-old chef from Lyon, France (pierre@martin.fr).",
]
TOOLS = [Tool.model_validate(t) for t in (
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city", "unit"], "additionalProperties": False,
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "required": ["timezone"], "additionalProperties": False,
        "properties": {"timezone": {"type": "string"}}}}})]
TOOL_PROMPTS = [
    "What is the weather in Paris right now, in celsius?",
    "Is it warm in Chicago today? Use fahrenheit.",
    "What time is it in Tokyo?",
    "Tell me the weather in Berlin and the time in New York.",
]
WORKLOADS = {"contact": (CONTACT, CONTACT_PROMPTS), "facts": (FACT_SCHEMA, FACT_PROMPTS[:4]),
             "tool_calls": (calls_schema(TOOLS, None, True), TOOL_PROMPTS)}
MODES = ("ar", "lookup", "sd", "mirror")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    propose = GrammarForcing.propose
    pipe = Pipeline.load(Path(args.bundle))
    runs = []
    for r in range(args.rounds):
        for workload, (schema, prompts) in WORKLOADS.items():
            for mode in MODES:
                for prompt in prompts:
                    arms = ("on", "off") if r % 2 == 0 else ("off", "on")
                    for arm in arms:
                        GrammarForcing.propose = propose if arm == "on" else (lambda self, ctx, length: None)
                        out = pipe.generate([{"role": "user", "content": prompt}], mode=mode,
                                            max_new_tokens=args.tokens, json_schema=schema)
                        s = out.stats
                        runs.append({"round": r, "workload": workload, "mode": mode, "arm": arm, "prompt": prompt,
                                     "tokens": len(out.token_ids), "finish_reason": out.finish_reason,
                                     "wall_s": s["wall_s"], "target_steps": s["target_steps"],
                                     "forced_steps": s["forced_steps"],
                                     "forced_proposed_tokens": s["forced_proposed_tokens"],
                                     "forced_accepted_tokens": s["forced_accepted_tokens"], "text": out.text})
                        print(json.dumps({k: v for k, v in runs[-1].items() if k not in ("text", "prompt")}),
                              flush=True)
    GrammarForcing.propose = propose
    summary = {}
    for workload in WORKLOADS:
        for mode in MODES:
            sel = {arm: [x for x in runs if x["workload"] == workload and x["mode"] == mode and x["arm"] == arm]
                   for arm in ("on", "off")}
            ratios = [on["tokens"] / on["wall_s"] / (off["tokens"] / off["wall_s"])
                      for on, off in zip(sel["on"], sel["off"])]
            summary[f"{workload} {mode}"] = {
                **{f"median_tokens_per_s_{arm}": round(statistics.median(x["tokens"] / x["wall_s"] for x in sel[arm]),
                                                       2) for arm in sel},
                "median_ratio_on_over_off": round(statistics.median(ratios), 3),
                **{f"tokens_per_step_{arm}": round(sum(x["tokens"] for x in sel[arm])
                                                   / sum(x["target_steps"] for x in sel[arm]), 3) for arm in sel},
                "forced_tokens_accepted_share": round(
                    sum(x["forced_accepted_tokens"] for x in sel["on"])
                    / max(1, sum(x["forced_proposed_tokens"] for x in sel["on"])), 3),
                "forced_tokens_share_of_output": round(
                    sum(x["forced_accepted_tokens"] for x in sel["on"]) / sum(x["tokens"] for x in sel["on"]), 3),
                "ended_with_eos": sum(x["finish_reason"] == "eos" for x in sel["on"]), "runs": len(sel["on"])}
    texts = {}
    for x in runs:
        texts.setdefault((x["workload"], x["prompt"]), set()).add(x["text"])
    doc = {"question": "what do forced windows (a grammar's forced tokens verified as a window) give each mode?",
           "bundle": args.bundle, "new_tokens": args.tokens, "rounds": args.rounds,
           "workloads": {k: v[0] for k, v in WORKLOADS.items()}, "summary": summary,
           "every_mode_and_arm_equal_per_prompt": all(len(v) == 1 for v in texts.values()), "runs": runs}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
