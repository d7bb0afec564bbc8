"""Builds results/task-data-gpu.json from the seventeenth stage's GPU run (results/stage17-gpu/: condensed logs),
the draft's training.json and streams.json (this stage's and, at BEFORE, the sixteenth's), the task answers file,
and the runtime evaluations before (at BEFORE) and after (in the tree).

    python lab/scripts/stage17_summary.py
"""

import collections
import json
import subprocess
import sys
from pathlib import Path

from self_data_summary import device_fields, last_json, runtime
from stage16_summary import paired

BEFORE = "ba6f823"  # the last commit with the sixteenth-stage draft and its models.evaluate files
RUN = Path("results/stage17-gpu")
DRAFT = Path("models/weights/smollm2-feature-draft")
TASKS = Path("models/training/data/answers-tasks.jsonl.gz")
TRAINED = 3296  # the task records the draft stage read (the file's first call)
EVALS = {"held_out": "results/smollm2-feature-streams-eval.json",
         "bench_24_prompts": "results/smollm2-feature-streams-eval-bench.json",
         "public_humaneval": "results/smollm2-feature-streams-eval-humaneval.json"}
# the device tool's replies (wall seconds of each call; device time held after it)
CALLS = [("carry the payload's first 62 MiB (the machine's start counted here)", 0.8, 47.0),
         ("carry the next 62 MiB", 0.3, 52.8),
         ("carry the last part with the code; task-kind turns 2.4 min, the draft 3.6 min, the stream heads 900 "
          "batches (lab/scripts/self_data_gpu.sh)", 516.3, 581.1),
         ("more task-kind turns on the same warm machine, 2.9 min (the next stage's data)", 196.3, 786.0)]


def git_json(path: str, before: str = BEFORE) -> dict:
    return json.loads(subprocess.check_output(["git", "show", f"{before}:{path}"]))


def task_file(trained: int = TRAINED) -> dict:
    sys.path.insert(0, ".")
    from mirror_sd.models.training import answers

    records = answers.read(TASKS)
    out = {}
    for name, part in (("read_by_this_stage", records[:trained]), ("next_stage", records[trained:])):
        kinds, tokens = collections.Counter(), collections.Counter()
        for r in part:
            kinds[r["kind"]] += 1
            tokens[r["kind"]] += sum(end - start for start, end in r["answers"])
        out[name] = {"records": len(part), "answer_tokens": sum(tokens.values()),
                     "records_by_kind": dict(sorted(kinds.items())),
                     "answer_tokens_by_kind": dict(sorted(tokens.items()))}
    return out


def draft_stage(training: dict, before: dict, start: str, data: str, log: Path) -> dict:
    """A GPU draft stage's summary: what it read and its in-run held-out figures before and after."""
    keep = ("tokens_per_step", "acceptance", "walked_tokens_per_step")
    return {"from": start, "lr": training["lr"], "batches": training["train"]["batches"],
            "gpu_minutes": training["train"]["minutes"], "records": training["records"],
            "answer_tokens": training["answer_tokens"], "data": data,
            "in_run_held_out_first_600_records": {"before": {k: round(before["held_out"][k], 3) for k in keep},
                                                  "after": {k: round(training["held_out"][k], 3) for k in keep}},
            "log": str(log)}


def main() -> None:
    training = json.loads((DRAFT / "training.json").read_text())
    streams = json.loads((DRAFT / "streams.json").read_text())
    before_training, before_streams = (git_json(f"{DRAFT}/{n}") for n in ("training.json", "streams.json"))
    first, second = last_json(RUN / "run-tasks.log"), last_json(RUN / "run-tasks2.log")
    evals = {}
    for name, path in EVALS.items():
        if not Path(path).is_file():
            continue
        before, after = git_json(path), json.loads(Path(path).read_text())
        evals[name] = {"before": runtime(before), "after": runtime(after),
                       "sd_tokens_per_step_change_per_prompt": paired(before, after),
                       "per_kind_tokens_per_step_before_after": {
                           k: [round(before["summary"]["per_kind_mean_accepted_tokens"][k], 3), round(v, 3)]
                           for k, v in after["summary"]["per_kind_mean_accepted_tokens"].items()}}
    out = {
        "question": "user turns of the benchmark's task kinds (translation, summaries, passages with questions, word "
                    "problems, why/how questions, follow-ups), written by the target from openings given in "
                    "models/task_queries.py and answered greedily: does the feature draft, trained further with them, "
                    "draft better on the held-out and benchmark prompts?",
        "date": "2026-11-27",
        **device_fields((RUN / "run-device.txt").read_text(), ""),
        "task_turns": {
            "how": "models/task_queries.py: the chat template up to the user's text, then an opening of one of six "
                   "kinds in turn; the target samples the rest at temperature 0.8, top-p 0.95 (a passage is cut at "
                   "its last full sentence, a passage without a question gets one in a second pass, a follow-up "
                   "continues a self-written conversation whose first answer is cut to two sentences); turns that "
                   "did not end, repeats and the held-out and benchmark prompts dropped; the fp32 target's greedy "
                   "answer, at most 160 tokens, 512 conversations per batch",
            "first_call": first, "second_call": second, "file": str(TASKS), **task_file()},
        "draft_stage": draft_stage(training, before_training, "the sixteenth stage",
                                   "every answers file once, the task answers' first call twice (read twice as "
                                   "often)", RUN / "run-draft.log"),
        "stream_heads": {
            "batches": streams["train"]["batches"], "gpu_minutes": streams["train"]["minutes"],
            "stream_accuracy_before_after": [[round(a, 3) for a in before_streams["train"]["stream_accuracy"]],
                                             [round(a, 3) for a in streams["train"]["stream_accuracy"]]],
            "held_out_before_after": {k: [round(before_streams["held_out"][k], 3), round(streams["held_out"][k], 3)]
                                      for k in ("plain_tokens_per_step", "trust_tokens_per_step")},
            "log": str(RUN / "run-streams.log"),
        },
        "runtime_models_evaluate": {
            "what": "python -m mirror_sd.models.training.evaluate --bundle build/bundles/smollm2-feature --per-kind 3, "
                    "--bench --per-kind 4 and --per-kind 3 --public humaneval; 'before' is the committed files at "
                    f"{BEFORE} (the sixteenth-stage draft; full-window tokens per step are the same on any machine: "
                    "greedy, exact). Full windows at gamma 4 (mean_accepted_tokens_all: tokens per target step), one "
                    "token per forward (streaming_off), and as planned (speeds follow the machine within a run)",
            **evals,
        },
        "adopted": "yes: held-out and the benchmark's prompts up by one to one and a half paired standard errors "
                   "(the kinds the turns were written for most: translation and math held out), the public set "
                   "flat, every output identical to ar; committed so that the next GPU stage builds on it",
        "device_calls": {"budget_s": 900, "used_s": 788,
                         "calls": [{"what": w, "wall_s": s, "held_s_after": h} for w, s, h in CALLS]},
        "script": "QUERIES=tasks QUERY_MINUTES=2.4 QUERY_BATCH=512 DRAFT_MINUTES=3.6 NEW_REPEATS=2 STREAM_BATCHES=900 "
                  "lab/scripts/self_data_gpu.sh (payload: self_data_gpu_payload.sh); the second call: python3 "
                  "-m mirror_sd.models.training.task_queries --batch 512 --max-minutes 2.9 on the file of the first",
    }
    Path("results/task-data-gpu.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
