"""Builds results/cpu-task-data.json: task-kind turns (models/task_queries.py) written and answered on this 2-core CPU
while no GPU was lent, appended to models/training/data/answers-tasks.jsonl.gz past the TASKS_PROMPTS records the eighteenth
stage read, for the next GPU stage to train on (lab/scripts/self_data_gpu.sh with QUERY_MINUTES=0: its minutes
go to training instead). Reads the answers file, the runs' condensed logs (results/cpu-task-data/run-*.log, the last
progress-bar state of each) and the static-cache A/B's output (results/cpu-task-data/static-cache-ab.txt).

    python lab/scripts/cpu_task_data_summary.py
"""

import collections
import gzip
import json
import re
from pathlib import Path

from mirror_sd.bench.machine import describe_machine

FILE = Path("models/training/data/answers-tasks.jsonl.gz")
LOGS = Path("results/cpu-task-data")
FIRST = 9040  # TASKS_READ in models/training/recipe.py: what the eighteenth stage read
# each run's settings, in order: a run was stopped and started again with the next setting; each begins where the
# one before ended (its log's last state)
RUNS = ["transformers' default (dynamic) KV cache, glibc malloc's defaults",
        "dynamic KV cache; MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 "
        "MALLOC_TOP_PAD_=268435456 (the first run spent half its CPU time in the kernel; these took that to ~0%); "
        "the static-cache A/B ran beside it from 01:56 UTC",
        "a static KV cache (cache_implementation=\"static\" in models/self_queries.py's generate, for this run only), "
        "the same malloc settings",
        "a later session (2026-11-28 from 04:50 UTC, no GPU lent again): the dynamic KV cache and the second run's "
        "malloc settings, nothing else running beside it",
        "a third session (2026-11-28 from 08:02 UTC, no GPU lent): the same settings, nothing else running beside it"]
# run 2 began at 01:48:31 UTC (run 1's log last written), the A/B at 01:56:12 (its job's start): states of run 2 up
# to this minute had the cores to themselves
AB_FROM_MINUTE = 7.7
COMMAND = ("python -m mirror_sd.models.training.task_queries --target build/models/smollm2-135m-instruct -n 1000000 "
           "--batch 64 --self-answers models/training/data/answers-self.jsonl.gz --max-minutes M "
           "--out models/training/data/answers-tasks.jsonl.gz")


def progress(log: Path) -> dict:
    """A run's progress-bar states (records done, elapsed minutes, answer tokens/s so far), its last state's
    records and minutes, and its closing summary where it finished."""
    text = log.read_text()
    states = [{"records_done": int(done), "minutes": round((int(h or 0) * 3600 + int(m) * 60 + int(sec)) / 60, 1),
               "answer_tokens_per_second": int(rate)}
              for done, h, m, sec, rate in re.findall(r"(\d+)/\d+ \[(?:(\d+):)?(\d+):(\d+)<.*answer_tok_per_s=(\d+)",
                                                      text)]
    out = {"records_done": states[-1]["records_done"], "minutes": states[-1]["minutes"], "states": states}
    summary = [line for line in text.splitlines() if line.startswith("{")]
    if summary:
        out["summary"] = json.loads(summary[-1])
    return out


def profile_shares(path: Path) -> dict:
    """Of a py-spy raw profile (30 s of the generation, `py-spy record -f raw`), the share of samples whose innermost
    frame is the KV cache's update and the attention kernel."""
    own, total = collections.Counter(), 0
    with gzip.open(path, "rt") as f:
        for line in f:
            stack, count = line.rsplit(" ", 1)
            frame = stack.split(";")[-1]
            total += int(count)
            if "Layer.update (transformers/cache_utils.py" in frame:
                own["cache_update"] += int(count)
            elif frame.startswith("sdpa_attention_forward"):
                own["attention"] += int(count)
    return {"samples": total, **{k: round(v / total, 3) for k, v in sorted(own.items())}}


def main() -> None:
    with gzip.open(FILE, "rt") as f:
        records = [json.loads(line) for line in f if line.strip()]
    new = [r for r in records if r["index"] >= FIRST]
    if [r["index"] for r in records] != list(range(len(records))):
        raise SystemExit(f"{FILE}: record indices are not 0..n-1")
    runs, first = [], FIRST
    for n, settings in enumerate(RUNS, 1):
        run = progress(LOGS / f"run-{n}.log")
        end = run["records_done"]
        tokens = sum(b - a for r in new if first <= r["index"] < end for a, b in r["answers"])
        runs.append({"records": [first, end], "settings": settings, "answer_tokens": tokens, **run,
                     "answer_tokens_per_second": round(tokens / (run["minutes"] * 60), 1)})
        first = end
    if first != len(records):
        raise SystemExit(f"the runs' logs end at record {first}, the file at {len(records)}")
    alone = [s["answer_tokens_per_second"] for s in runs[1]["states"] if s["minutes"] < AB_FROM_MINUTE]
    for run in runs:  # the states are in the logs
        del run["states"]
    by_kind = collections.Counter(r["kind"] for r in new)
    tokens_by_kind = collections.Counter()
    for r in new:
        tokens_by_kind[r["kind"]] += sum(b - a for a, b in r["answers"])
    machine = describe_machine()
    shares = {cache: profile_shares(LOGS / f"profile-{cache}-cache.txt.gz") for cache in ("dynamic", "static")}
    ab = [line.split() for line in (LOGS / "static-cache-ab.txt").read_text().splitlines() if line.strip()]
    doc = {
        "question": "with no GPU lent, can this CPU write the next GPU stage's task-kind turns, so that stage spends "
                    "its device minutes on training (stage 18 spent 145 of its 520 s writing 2,476 turns)?",
        "device": f"{machine['cpu']}, {machine['cores_usable']} cores; torch on the CPU, fp32 (the answers are the "
                  "fp32 target's greedy ones)",
        "command": COMMAND,
        "file": str(FILE),
        "records_before": FIRST,
        "records_after": len(records),
        "new_records": len(new),
        "new_answer_tokens": sum(tokens_by_kind.values()),
        "new_records_by_kind": dict(sorted(by_kind.items())),
        "new_answer_tokens_by_kind": dict(sorted(tokens_by_kind.items())),
        "runs": runs,
        "static_cache_ab": {
            "script": "lab/scripts/static_cache_ab.py (32 rows of 300 tokens, 96 greedy tokens)",
            "seconds": {impl: float(sec) for impl, sec, *_ in ab},
            "note": "run beside the generation (both shared the 2 cores): the ratio, not the seconds, is the "
                    "figure; the same 3 chat conversations gave token-identical 60-token greedy answers with "
                    "either cache",
            "in_the_generation": f"no gain: the third run wrote {runs[2]['answer_tokens_per_second']} answer "
                                 f"tokens/s against {runs[0]['answer_tokens_per_second']} in the first and "
                                 f"{min(alone)}-{max(alone)} in the second's states before the A/B: the cache's "
                                 "concatenation went, and attention, which reads the whole static length at every "
                                 "step, took more of the time (profiles); the module keeps transformers' default "
                                 "cache",
            "profiles": {"files": "results/cpu-task-data/profile-{dynamic,static}-cache.txt.gz (py-spy record -f "
                                  "raw, 30 s of the second and of the third run)",
                         "share_of_samples": shares},
        },
        "next_gpu_stage": "QUERIES=tasks QUERY_MINUTES=0 NEW_REPEATS=2 DRAFT_MINUTES=5.5 STREAM_BATCHES=900 "
                          "EXIT_CONVERSATIONS=300 EXIT_SKIP=1700 lab/scripts/self_data_gpu.sh: every task turn "
                          "listed twice, these unread by any draft (EXIT_SKIP 1700: the CPU exit stage EXIT_TASKS "
                          "read conversations 1,500-1,680 of each answers file)",
    }
    out = Path("results/cpu-task-data.json")
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}: {len(new)} new records, {doc['new_answer_tokens']} answer tokens")


if __name__ == "__main__":
    main()
