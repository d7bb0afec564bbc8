"""Builds results/stage16-gpu.json from the sixteenth stage's GPU run (results/stage16-gpu/: logs, the exit stage's
coverage, the runtime evaluations with the adapter before), the committed draft's training.json and streams.json,
and the runtime evaluations before (at BEFORE) and after (in the tree).

    python lab/scripts/stage16_summary.py
"""

import json
import statistics
import subprocess
from pathlib import Path

from self_data_summary import device_fields, runtime

BEFORE = "b222475"  # the last commit with the fifteenth-stage draft and adapter's models.evaluate files
RUN = Path("results/stage16-gpu")
DRAFT = Path("models/weights/smollm2-feature-draft")
EVALS = {"held_out": ("results/smollm2-feature-streams-eval.json", RUN / "eval-heldout-old-adapter.json"),
         "bench_24_prompts": ("results/smollm2-feature-streams-eval-bench.json", RUN / "eval-bench-old-adapter.json")}
# the device tool's replies (wall seconds of each call; device time held after it)
CALLS = [("carry the payload's first 62 MiB (the machine's start counted here)", 0.3, 42.9),
         ("carry the next 62 MiB", 0.2, 50.9),
         ("carry the last part with the code; the draft 4.3 min, the stream heads 1.2 min, the exit stage beside "
          "them (it died at once: train_exit imported optimum, which the GPU machine lacks)", 449.6, 513.1),
         ("the exit stage again: the machine had been released after its 30 s idle window, a fresh one had no "
          "payload", 0.2, 585.1),
         ("carry the first part again", 0.3, 604.1),
         ("carry the next part again", 0.3, 607.4),
         ("the last part; the exit stage alone (a stand-in optimum module on that machine's path; the tree now "
          "imports without it)", 221.5, 837.7)]


def paired(before: dict, after: dict) -> dict:
    """Per-prompt change of sd's full-window tokens per step between two models.evaluate results of the same prompts:
    mean, its standard error, prompts up / down."""
    d = [a["sd"]["mean_accepted_tokens"] - b["sd"]["mean_accepted_tokens"]
         for b, a in zip(before["rows"], after["rows"], strict=True)]
    return {"mean": round(statistics.mean(d), 3), "standard_error": round(statistics.stdev(d) / len(d) ** 0.5, 3),
            "prompts_up": sum(x > 0 for x in d), "prompts_down": sum(x < 0 for x in d)}


def exit_stage() -> dict:
    cov = json.loads((RUN / "exit-coverage.json").read_text())
    per_file = {}
    for name, r in cov["layers"]["24"].items():
        m = r["draft_misses"]
        per_file[name] = {"held_out_positions": r["positions"], "draft_miss_positions": m["positions"],
                          "top1_all_before_after": [round(r["initial"]["1"], 3), round(r["adapter"]["1"], 3)],
                          "top4_at_misses_before_after": [round(m["initial"]["4"], 3), round(m["adapter"]["4"], 3)]}
    return {"how": "models.train_exit --init-from the committed adapter --hard-draft the fifteenth-stage draft "
                   "--hard-weight 8 --conversations 300 --skip 1200 --held-out 60 --steps 4000 --batch 1024 --lr 1e-3 "
                   "over every answers file", "positions": cov["positions"], "per_file": per_file,
            "log": str(RUN / "run-exit.log")}


def main() -> None:
    training = json.loads((DRAFT / "training.json").read_text())
    streams = json.loads((DRAFT / "streams.json").read_text())
    device = (RUN / "run-device.txt").read_text()
    evals = {}
    for name, (path, old_adapter) in EVALS.items():
        before = json.loads(subprocess.check_output(["git", "show", f"{BEFORE}:{path}"]))
        after = json.loads(Path(path).read_text())
        evals[name] = {"before": runtime(before), "new_draft_old_adapter": runtime(json.loads(old_adapter.read_text())),
                       "after": runtime(after), "sd_tokens_per_step_change_per_prompt": paired(before, after)}
    keep = ("tokens_per_step", "acceptance", "walked_tokens_per_step")
    out = {
        "question": "the fifteenth stage's recipe again with the 5,210 self-written records no draft had read, and "
                    "the exit adapter continued at GPU scale on every answers file beside it: do the draft and the "
                    "rejected-step branch hits move?",
        "date": "2026-11-27",
        **device_fields(device, ", on both GPU machines"),
        "draft_stage": {
            "from": "the fifteenth stage", "lr": training["lr"], "batches": training["train"]["batches"],
            "gpu_minutes": training["train"]["minutes"], "records": training["records"],
            "answer_tokens": training["answer_tokens"],
            "in_run_held_out_first_600_records": {
                "before": {k: round(training["fifteenth_stage"]["held_out"][k], 3) for k in keep},
                "after": {k: round(training["held_out"][k], 3) for k in keep}},
            "log": str(RUN / "run-draft.log"),
        },
        "stream_heads": {
            "batches": streams["train"]["batches"], "gpu_minutes": streams["train"]["minutes"],
            "stream_accuracy_before_after": [[round(a, 3) for a in streams["before"]["train"]["stream_accuracy"]],
                                             [round(a, 3) for a in streams["train"]["stream_accuracy"]]],
            "held_out_before_after": {k: [round(streams["before"]["held_out"][k], 3), round(streams["held_out"][k], 3)]
                                      for k in ("plain_tokens_per_step", "trust_tokens_per_step")},
            "log": str(RUN / "run-streams.log"),
        },
        "exit_stage": exit_stage(),
        "runtime_models_evaluate": {
            "what": "python -m mirror_sd.models.training.evaluate --per-kind 3, and --bench --per-kind 4, on bundles exported "
                    "with the new draft and the new adapter (after: byte-identical to build/bundles/smollm2-feature) "
                    "and with the new draft and the adapter before (new_draft_old_adapter); 'before' is the "
                    f"committed files at {BEFORE}. Full windows at gamma 4 (mean_accepted_tokens_all: tokens per "
                    "target step), one token per forward (streaming_off), and as planned",
            **evals,
        },
        "adopted": "both, though the runtime's changes are within noise: the draft on its paired in-run gain over "
                   "113,134 held-out bases and the adapter on its held-out coverage at the draft's misses (up in "
                   "every file), so that GPU stages build on each other",
        "device_calls": {"budget_s": 900, "used_s": 846,
                         "calls": [{"what": w, "wall_s": s, "held_s_after": h} for w, s, h in CALLS]},
        "script": "lab/scripts/self_data_gpu.sh QUERY_MINUTES=0 DRAFT_MINUTES=4.3 EXIT_CONVERSATIONS=800 "
                  "EXIT_SKIP=1200 EXIT_MINUTES=2 (payload: self_data_gpu_payload.sh); the exit stage's second run "
                  "by hand with the flags above",
    }
    Path("results/stage16-gpu.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
