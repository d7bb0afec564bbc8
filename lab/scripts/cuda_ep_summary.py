"""results/cuda-ep.json from the GPU machine's raw files in results/cuda-ep/ (lab/scripts/cuda_ep.py wrote them).

Every figure is read from those files: medians per length and mode, speculative outputs identical to ar per arm,
decode at the longest prompt over decode at the shortest (issue 11's flatness), and the target's 5-token step over
its 1-token step.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
RUNS = {
    "run-1": "the runtime before fixed-width steps: every target step as wide as its tokens; the float32 target was "
             "still allowed on the CUDA execution provider",
    "run-2": "fixed-width steps (8 rows on the CUDA execution provider; 'fp16-cuda-width0' turns them off); the "
             "float32 target refused on the CUDA execution provider",
}


def _arm(entry: dict) -> dict:
    lengths = entry.get("lengths", {})
    out = {k: entry[k] for k in ("target_device", "step_width", "target_threads", "draft_backend", "draft_device",
                                 "capacity") if k in entry}
    rows, same, total = {}, 0, 0
    for length, row in lengths.items():
        runs = row["runs"]
        summary = {mode: dict(s) for mode, s in row["summary"].items()}
        for mode, s in summary.items():
            if mode != "ar":
                s["identical_prompts"] = sum(a["token_ids"] == b["token_ids"] for a, b in zip(runs["ar"], runs[mode]))
                s["prompts"] = len(runs[mode])
                same, total = same + s["identical_prompts"], total + s["prompts"]
                if s.get("decode_tok_s") and summary["ar"].get("decode_tok_s"):
                    s["decode_over_ar"] = round(s["decode_tok_s"] / summary["ar"]["decode_tok_s"], 3)
                s.pop("identical_to_ar", None)
        rows[length] = {"modes": summary, **({"target_steps": row["target_steps"]} if "target_steps" in row else {})}
        stats = {mode: _mean_stat(runs[mode]) for mode in runs if mode != "ar"}
        rows[length]["tokens_per_target_step"] = {m: v for m, v in stats.items() if v is not None}
    out["lengths"] = rows
    out["speculative_outputs_identical_to_ar"] = f"{same} of {total}"
    keys = sorted(rows, key=int)
    if len(keys) > 1:
        first, last = rows[keys[0]]["modes"], rows[keys[-1]]["modes"]
        out[f"decode_{keys[-1]}_over_{keys[0]}"] = {
            mode: round(last[mode]["decode_tok_s"] / first[mode]["decode_tok_s"], 3)
            for mode in first if mode in last and first[mode].get("decode_tok_s") and last[mode].get("decode_tok_s")}
    return out


def _mean_stat(runs: list[dict]) -> float | None:
    """New tokens over target steps, over the prompts (the first token comes from prefill, not a step)."""
    steps = sum(r["stats"].get("target_steps", 0) for r in runs)
    return round(sum(r["new_tokens"] - 1 for r in runs) / steps, 3) if steps else None


def main() -> None:
    doc = {
        "question": "issue 11: ar, sd and mirror with the target on ONNX Runtime's CUDA execution provider (the "
                    "draft on OpenVINO's CPU plugin), and whether the output stays exact there",
        "script": "lab/scripts/cuda_ep.sh (payload: lab/scripts/cuda_ep_payload.sh), raw files in "
                  "results/cuda-ep/; this summary: lab/scripts/cuda_ep_summary.py",
        "runs": {},
    }
    for name, what in RUNS.items():
        raw = json.loads((HERE / "cuda-ep" / f"{name}.json").read_text())
        doc["runs"][name] = {
            "what": what, "date": raw["date"], "machine": raw["machine"], "settings": raw["settings"],
            "exports": {d: {"seconds": e.get("seconds"), "target_dtype": e.get("validation", {}).get("target_dtype")}
                        for d, e in raw["exports"].items()},
            "arms": {n: _arm(e) for n, e in raw["configs"].items() if e.get("lengths")},
            "refused": [e.strip().splitlines()[-1] for e in raw["errors"]],
            "ar_agreement_with_fp32_cpu": raw["ar_agreement_with_fp32_cpu"],
        }
    (HERE / "cuda-ep.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
