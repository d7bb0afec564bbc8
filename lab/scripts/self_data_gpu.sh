#!/usr/bin/env bash
# Self-written prompts and the feature draft trained on them, on a GPU machine (results/self-data-gpu.json):
#   1. where QUERY_MINUTES is not 0: the target writes user queries and answers them for QUERY_MINUTES: with
#      QUERIES=self (python -m mirror_sd.models.training.self_queries) appended to the payload's answers-self.jsonl.gz, into
#      $OUT/answers-self.jsonl.gz; with QUERIES=tasks (models.task_queries: turns of the benchmark's task kinds,
#      results/task-data-gpu.json) appended to the payload's answers-tasks.jsonl.gz where it has one, into
#      $OUT/answers-tasks.jsonl.gz;
#   2. the committed feature draft trains further on every answers file, the new one included (listed NEW_REPEATS
#      times: read that many times as often), for DRAFT_MINUTES (features recomputed per batch, as
#      lab/scripts/feature_draft_gpu.sh's stages);
#      Where ARM_B_FLAGS is set, a second arm beside it on the same GPU continues the same draft on the same data
#      with those train_feature_draft flags: "--max-loop 0.4" leaves out the training records whose answers loop
#      on more than 40% of their tokens (self-written turns loop 1.3-8x more than the answers to the benchmark's
#      prompts: results/feature-draft-cpu-tasks-ab.json); ARM_B_TAPS="8 16 24" is short for ARM_B_FLAGS="--taps 8 16 24"
#      (re-tapped: at GPU scale, what the CPU's 8-minute A/B in results/feature-draft-taps*-ab.json could not
#      show); both are then measured offline on the answers files in
#      $DIAG (lab/scripts/bench_answers.py: target answers to prompts no draft trains on), and the one with more
#      tokens per step walked as sd steps goes on to stage 3;
#   3. its stream heads, which read the draft's hidden states, train further on the changed draft
#      (--continue-streams, STREAM_BATCHES batches);
#   4. where EXIT_CONVERSATIONS > 0 (not in the first recorded run), beside stages 2-3 on the same GPU: the
#      committed exit adapter continues on that many conversations of every answers file past the first EXIT_SKIP
#      (the ones its stages read), drawing the positions the committed draft misses up to 9x as often (as
#      EXIT_HARD_MORE in models/training/recipe.py), EXIT_STEPS steps of EXIT_BATCH positions or EXIT_MINUTES. On
#      the CPU, continued on the self-written answers alone it did not raise the runtime's branch hits
#      (results/exit-self-ab.json): all files at once, at GPU scale, is what is left to try.
# Runs once every part of the payload (lab/scripts/self_data_gpu_payload.sh) lies in $PARTS, from the last
# folder, which holds repo.tar.xz and this script. Writes logs, the answers file and the trained draft (tar parts of
# at most 15 MB) to $OUT, each as soon as it is done. The GPU machine has torch, transformers and numpy, and no
# package index or openvino: evaluation, export and the runtime run back on the CPU machine.
set -u  # defaults: the run in results/self-data-gpu.json
HERE=$(cd "$(dirname "$0")" && pwd)
PARTS=${PARTS:-/tmp/parts}
WORK=${WORK:-/tmp/self-data}
QUERY_MINUTES=${QUERY_MINUTES:-2.3}
QUERIES=${QUERIES:-self}
NEW_REPEATS=${NEW_REPEATS:-1}
ARM_B_TAPS=${ARM_B_TAPS:-}
ARM_B_FLAGS=${ARM_B_FLAGS:-${ARM_B_TAPS:+--taps $ARM_B_TAPS}}
DIAG=${DIAG:-$HERE/diag}
QUERY_BATCH=${QUERY_BATCH:-512}
DRAFT_MINUTES=${DRAFT_MINUTES:-3.6}
STREAM_BATCHES=${STREAM_BATCHES:-1200}
EXIT_CONVERSATIONS=${EXIT_CONVERSATIONS:-0}
EXIT_STEPS=${EXIT_STEPS:-4000}
EXIT_BATCH=${EXIT_BATCH:-1024}
EXIT_SKIP=${EXIT_SKIP:-0}
EXIT_MINUTES=${EXIT_MINUTES:-5}
EVAL=${EVAL:-600}
export PYTHONUNBUFFERED=1
mkdir -p "$WORK" && cd "$WORK" || exit 1
cat "$PARTS"/payload.part* | tar -x || exit 1
mkdir -p repo && tar -xJf "$HERE/repo.tar.xz" -C repo || exit 1
python3 -m pip install -q --no-index --no-deps --target "$WORK/site" gguf-*.whl || exit 1
export PYTHONPATH=$WORK/site:$WORK/repo/pkg
{
    nvidia-smi -L
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} > "$OUT/device.txt" 2>&1
# the same fp32 target as the CPU machine's: dequantised from the same GGUF; its weights' digest goes back to compare
# (the run recorded in results/self-data-gpu.json did this with the same code inline)
python3 -m mirror_sd.models.gguf ./*.gguf target >> "$OUT/device.txt" 2>&1 || exit 1
stamp() { echo "$(date -u +%H:%M:%S) $*" >> "$OUT/device.txt"; }
NEW=data/answers-$QUERIES.jsonl.gz
if [ "$QUERY_MINUTES" != 0 ]; then
    stamp "$QUERIES queries"
    # both append to their file and resume: the payload's file of the same name is where they start
    [ -f "$NEW" ] && cp "$NEW" "$OUT/"
    case $QUERIES in
        self) extra=() ;;
        tasks) extra=(--self-answers data/answers-self.jsonl.gz) ;;
        *) echo "QUERIES is self or tasks" >&2; exit 1 ;;
    esac
    python3 -m mirror_sd.models.training.${QUERIES/tasks/task}_queries --target target -n 1000000 --batch "$QUERY_BATCH" \
        "${extra[@]}" --max-minutes "$QUERY_MINUTES" --out "$OUT/answers-$QUERIES.jsonl.gz" > "$OUT/$QUERIES.log" 2>&1
    stamp "$QUERIES queries exit $?"
    cp "$OUT/answers-$QUERIES.jsonl.gz" data/ || exit 1
fi
# every answers file once (in name order: the in-run held-out records, the first EVAL, stay the advice file's),
# the new one NEW_REPEATS times in all
answers=(data/*.jsonl.gz)
for _ in $(seq 2 "$NEW_REPEATS"); do answers+=("$NEW"); done
pack() {
    rm -f "$OUT/$2".tar.part*
    tar -C "$1" -cf "/tmp/$2.tar" . && split -b 15000000 -d "/tmp/$2.tar" "$OUT/$2.tar.part"
}
if [ "$EXIT_CONVERSATIONS" -gt 0 ]; then  # beside the draft's stages: the GPU has room for both
    (
        stamp "exit adapter"
        python3 -m mirror_sd.models.training.train_exit --target target --data data/*.jsonl.gz --out out-E --layers 24 \
            --conversations "$EXIT_CONVERSATIONS" --skip "$EXIT_SKIP" --held-out 100 --steps "$EXIT_STEPS" \
            --batch "$EXIT_BATCH" --lr 1e-3 --minutes-per-layer "$EXIT_MINUTES" --init-from adapter \
            --hard-draft draft --hard-weight 8 > "$OUT/exit.log" 2>&1
        stamp "exit adapter exit $?"
        [ -d out-E ] && pack out-E exit-adapter
    ) &
fi
draft_arm() {  # the arm's name (D: the committed taps), then any more flags
    local name=$1 log=$OUT/draft.log
    shift
    [ "$name" = D ] || log=$OUT/draft-$name.log
    python3 -m mirror_sd.models.training.train_feature_draft --target target --answers "${answers[@]}" --work "work-$name" \
        --out "out-$name" --init-from draft --features online --budget-minutes "$DRAFT_MINUTES" --epochs 50 \
        --tokens-per-batch 16384 --lr 3e-4 --eval-records "$EVAL" "$@" > "$log" 2>&1
    stamp "draft $name exit $?"
}
# the diagnostic set's tokens per step, walked as sd steps, over every file in $DIAG (held-out records only)
walked() {
    python3 -c "
import json, sys
by_file = json.load(open(sys.argv[1]))['by_file']
runs = [next(iter(d.values())) for d in by_file.values()]
print(round(sum(r['walked_tokens_per_step'] * r['bases'] for r in runs) / sum(r['bases'] for r in runs), 4))" "$1"
}
if [ -n "$ARM_B_FLAGS" ]; then
    # arm B beside D on the one GPU: the same data and minutes, with ARM_B_FLAGS; the arm that drafts the
    # diagnostic set better goes on (both logs and their scores go back in draft.log: $OUT holds 8 files at most)
    draft_arm D &
    # shellcheck disable=SC2086  # the flags are words
    draft_arm B $ARM_B_FLAGS &
    wait
    for arm in D B; do
        [ -d "out-$arm" ] && python3 -m mirror_sd.models.training.train_feature_draft --target target --compare "out-$arm" \
            --answers "$DIAG"/*.jsonl.gz --work "diag-$arm" --eval-records 1000 --compare-out "diag-$arm.json" \
            >> "$WORK/compare.log" 2>&1
    done
    score_d=$( [ -f diag-D.json ] && walked diag-D.json || echo 0 )
    score_b=$( [ -f diag-B.json ] && walked diag-B.json || echo 0 )
    stamp "diagnostic walked tokens per step: D $score_d, B ($ARM_B_FLAGS) $score_b"
    if python3 -c "import sys; sys.exit(not float(sys.argv[2]) > float(sys.argv[1]))" "$score_d" "$score_b"; then
        stamp "arm B goes on"
        rm -rf out-D && mv out-B out-D
    fi
    { echo "== arm B ($ARM_B_FLAGS)"; cat "$OUT/draft-B.log"; echo "== diagnostic set"; cat "$WORK/compare.log" \
        diag-*.json; } >> "$OUT/draft.log" 2>&1 && rm -f "$OUT/draft-B.log"
else
    draft_arm D
fi
[ -d out-D ] && pack out-D draft
[ -d out-D ] && python3 -m mirror_sd.models.training.train_stream_heads --target target --draft out-D \
    --answers "${answers[@]}" --work work-S --out out-S --continue-streams --streams 2 --stream-vocab 4096 \
    --stream-width 576 --depths 2 --lr 1e-3 --batches "$STREAM_BATCHES" --tokens-per-batch 8192 --max-minutes 2.5 \
    > "$OUT/streams.log" 2>&1
stamp "streams exit $?"
[ -d out-S ] && pack out-S draft-streams && rm -f "$OUT"/draft.tar.part*
wait  # the exit stage
nvidia-smi --query-gpu=name,memory.used --format=csv >> "$OUT/device.txt"
stamp done
