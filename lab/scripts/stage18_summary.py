"""Builds results/stage18-gpu.json from the eighteenth stage's GPU run (results/stage18-gpu/: condensed logs), the
draft's training.json and streams.json (this stage's and, at BEFORE, the seventeenth's), the task answers file, the
offline comparison on results/gpu-diag/ and the runtime evaluations before (at BEFORE) and after (in the tree).

    PYTHONPATH=results/scripts .venv/bin/python lab/scripts/stage18_summary.py
"""

import json
from pathlib import Path

from self_data_summary import device_fields, last_json, runtime
from stage16_summary import paired
from stage17_summary import draft_stage, git_json, task_file

BEFORE = "e891613"  # the last commit with the seventeenth-stage draft and its models.evaluate files
RUN = Path("results/stage18-gpu")
DRAFT = Path("models/weights/smollm2-feature-draft")
SEVENTEENTH_READ = 3296  # the task records the seventeenth stage read
EVALS = {"held_out": "results/smollm2-feature-streams-eval.json",
         "bench_24_prompts": "results/smollm2-feature-streams-eval-bench.json",
         "public_humaneval": "results/smollm2-feature-streams-eval-humaneval.json"}
# the device tool's replies (wall seconds of each call; device time held after it)
CALLS = [("carry the payload's first 62 MiB (the machine's start counted here)", 0.4, 73.3),
         ("carry the next 62 MiB: the machine had gone back between the calls, so this started a fresh one, which "
          "lacked the first part (the command failed)", 0.2, 152.3),
         ("the first part again", 0.3, 168.3), ("the second part", 0.2, 173.0),
         ("carry the last part with the code; task-kind turns 2.0 min, the draft 3.4 min, the stream heads 900 "
          "batches (lab/scripts/self_data_gpu.sh)", 520.2, 707.1)]


def main() -> None:
    training = json.loads((DRAFT / "training.json").read_text())
    streams = json.loads((DRAFT / "streams.json").read_text())
    before_training, before_streams = (git_json(f"{DRAFT}/{n}", BEFORE) for n in ("training.json", "streams.json"))
    evals = {}
    for name, path in EVALS.items():
        before, after = git_json(path, BEFORE), json.loads(Path(path).read_text())
        evals[name] = {"before": runtime(before), "after": runtime(after),
                       "sd_tokens_per_step_change_per_prompt": paired(before, after),
                       "per_kind_tokens_per_step_before_after": {
                           k: [round(before["summary"]["per_kind_mean_accepted_tokens"][k], 3), round(v, 3)]
                           for k, v in after["summary"]["per_kind_mean_accepted_tokens"].items()}}
    diag = json.loads((RUN / "diag-compare.json").read_text())
    offline = {Path(f).name: {("before" if "old" in d else "after"): {k: round(r[k], 3) for k in
                                                                      ("tokens_per_step", "walked_tokens_per_step",
                                                                       "acceptance")}
                              for d, r in by.items()} for f, by in diag["by_file"].items()}
    out = {
        "question": "does the feature draft, continued on every answers file with the task-kind turns grown by a "
                    "GPU call and all of them read (5,744 that no stage had), draft better in the runtime?",
        "date": "2026-11-27",
        **device_fields((RUN / "run-device.txt").read_text(), ""),
        "task_turns": {"call": last_json(RUN / "run-tasks.log"), "file": "models/training/data/answers-tasks.jsonl.gz",
                       **dict(zip(("read_by_the_seventeenth_stage", "new_to_this_stage"),
                                  task_file(SEVENTEENTH_READ).values()))},
        "draft_stage": draft_stage(training, before_training, "the seventeenth stage",
                                   "every answers file once, the task answers (all 9,040) twice (read twice as "
                                   "often)", RUN / "run-draft.log"),
        "stream_heads": {
            "batches": streams["train"]["batches"], "gpu_minutes": streams["train"]["minutes"],
            "held_out_before_after": {k: [round(before_streams["held_out"][k], 3), round(streams["held_out"][k], 3)]
                                      for k in ("plain_tokens_per_step", "trust_tokens_per_step")},
            "log": str(RUN / "run-streams.log"),
        },
        "offline_gpu_diag_gamma_4": {
            "what": "train_feature_draft --compare on results/gpu-diag/ (the target's answers to the benchmark's 60 "
                    "prompts and to 46 held-out prompts models.evaluate does not read), on this CPU",
            **offline},
        "runtime_models_evaluate": {
            "what": "python -m mirror_sd.models.training.evaluate --bundle build/bundles/smollm2-feature --per-kind 3, "
                    "--bench --per-kind 4 and --per-kind 3 --public humaneval; 'before' is the committed files at "
                    f"{BEFORE} (the seventeenth-stage draft; full-window tokens per step are the same on any "
                    "machine: greedy, exact)",
            **evals,
        },
        "adopted": "yes: the benchmark's prompts up by 2.6 paired standard errors (12 prompts up, 2 down), the "
                   "public HumanEval set by 1.5, the held-out prompts flat; every output identical to ar",
        "device_calls": {"budget_s": 900, "used_s": 710,
                         "calls": [{"what": w, "wall_s": s, "held_s_after": h} for w, s, h in CALLS]},
        "script": "QUERIES=tasks QUERY_MINUTES=2.0 NEW_REPEATS=2 DRAFT_MINUTES=3.4 STREAM_BATCHES=900 "
                  "lab/scripts/self_data_gpu.sh (payload: self_data_gpu_payload.sh)",
    }
    Path("results/stage18-gpu.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
