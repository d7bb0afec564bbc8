"""The real pair with the target on ONNX Runtime's CUDA execution provider (results/cuda-ep.json, issue 11).

Run on a GPU machine (lab/scripts/cuda_ep.sh lays it out and calls this): exports the feature bundle twice from
the same fp32 SmolLM2 target, with the target graphs in float16 (what the CUDA EP runs fused: its
GroupQueryAttention has no float32 kernel) and in float32 (the CPU bundle as `make models` builds it), then times
ar / sd / mirror per prompt length, the draft on OpenVINO's CPU plugin (the product's pairing), in arms:
- fp16-cuda: float16 target, CUDA EP, fixed-width steps replaying CUDA graphs (the runtime's defaults there;
  `cuda_graphs` records whether they ran): every length, plus sd and mirror with every step speculating
  ("*_always"), and the target's 1- and 5-token steps at the shortest and longest length (5 over 1: what a
  verification window costs); fp16-cuda-nographs: the same with LoadOptions.cuda_graphs off;
- fp16-cuda-width0: the same with every step as wide as its tokens; fp16-cuda-noflash: with flash attention off;
- fp32-cuda: the float32 target on the CUDA EP (its attention falls back to the CPU; the runtime now refuses it,
  and the refusal is what this arm records);
- fp32-cpu: the float32 target on the same machine's CPU, the shortest and one long length, the baseline.
(run-1 in results/cuda-ep/ ran before fixed-width steps and the refusal existed: fp16-cuda unpadded, fp32-cuda
timed.)
Greedy outputs are compared with ar's on the same prompt and pipeline. Prompts are bench/context.py's (real text
cut to exactly N tokens). TTFT is prompt in -> first token out; decode tokens/s is (new tokens - 1) / (total - TTFT).
Everything is written to --out after every run, so a run cut off by its time limit still leaves what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import traceback
from pathlib import Path


def log(*parts) -> None:
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


def export(target: str, draft: str, adapter: str, plan: str, out: Path, dtype: str) -> dict:
    import shutil

    from mirror_sd.export.bundle import ExportOptions, export_bundle

    start = time.perf_counter()
    manifest = export_bundle(ExportOptions(target, draft, out, exit_layer=24, top_k=8, force=True,
                                           exit_adapter=adapter, target_dtype=dtype),
                             report=lambda line: None if line.startswith("  ") else log(f"[{dtype}]", line))
    shutil.copyfile(plan, out / "plan.json")
    return {"seconds": round(time.perf_counter() - start, 1), "validation": manifest.validation}


def _step_times(pipe, ids: list[int], repeats: int) -> dict:
    """Median seconds of the target's 1- and 5-token forwards from the same cache, taken in alternation."""
    target = pipe.target
    _, cache = target.prefill(ids, target.empty_cache())
    times = {1: [], 5: []}
    for i in range(repeats + 2):
        for n in (1, 5):
            t0 = time.perf_counter()
            target.forward(ids[-n:], cache, logits_for=n)
            if i >= 2:  # the first two are warm-up
                times[n].append(time.perf_counter() - t0)
    one, five = statistics.median(times[1]), statistics.median(times[5])
    return {"step_1_ms": round(one * 1e3, 3), "step_5_ms": round(five * 1e3, 3),
            "verify_5_over_1": round(five / one, 3)}


def _scalar_stats(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if isinstance(v, (int, float, str, bool)) and k != "trace"}


def measure(name: str, bundle: Path, device: str, lengths: list[int], modes: list[str], repeats: int,
            new_tokens: int, threads: int | None, draft_threads: int, kernels: bool, deadline: float,
            doc: dict, save, load: dict) -> None:
    from mirror_sd import Pipeline
    from mirror_sd.bench.context import _passages, context_prompts

    entry = doc["configs"].setdefault(name, {"bundle": bundle.name, "requested_device": device, "lengths": {}})
    # KV buffers as long as the longest prompt needs: the float32 target under the CUDA EP copies them whole
    # the draft on OpenVINO (the product's pairing; the committed plan, measured on a 2-core CPU, picks ONNX Runtime)
    pipe = Pipeline.load(bundle, target_device=device, target_threads=threads, draft_threads=draft_threads,
                         draft_backend="openvino", huge_pages=False, max_context=max(lengths) + new_tokens + 64,
                         **load)
    entry.update(capacity=pipe.target.capacity, step_width=getattr(pipe.target, "step_width", None),
                 target_device=pipe.target.device, providers=list(pipe.target.providers),
                 cuda_graphs=getattr(pipe.target, "cuda_graphs", None),
                 target_threads=pipe.target_threads, draft_threads=pipe.draft_threads,
                 draft_backend=getattr(pipe.draft, "backend", None), draft_device=getattr(pipe.draft, "device", None))
    log(name, "target on", pipe.target.device, "draft on", entry["draft_device"])
    text = pipe.codec.encode(_passages(), special=False)
    for length in lengths:
        if time.time() > deadline:
            entry["cut_off_before"] = length
            log(name, "out of time before", length)
            break
        prompts = context_prompts(pipe, length, repeats + 1, text)
        row = entry["lengths"].setdefault(str(length), {"runs": {}})
        for mode in modes:  # warm-up at this length
            pipe.generate(prompts[0], **_mode(mode), max_new_tokens=8)
        for r in range(repeats):
            order = modes[r % len(modes):] + modes[:r % len(modes)]
            for mode in order:
                first: list[float] = []

                def streamer(_token, _text, first=first) -> None:
                    if not first:
                        first.append(time.perf_counter())

                t0 = time.perf_counter()
                res = pipe.generate(prompts[1 + r], **_mode(mode), max_new_tokens=new_tokens, streamer=streamer)
                total = time.perf_counter() - t0
                ttft = first[0] - t0
                n = len(res.token_ids)
                row["runs"].setdefault(mode, []).append({
                    "prompt": r, "ttft_s": round(ttft, 4), "total_s": round(total, 4), "new_tokens": n,
                    "decode_tok_s": round((n - 1) / (total - ttft), 2) if n > 1 and total > ttft else None,
                    "token_ids": res.token_ids, "stats": _scalar_stats(res.stats)})
        summary = {}
        for mode, runs in row["runs"].items():
            rates = [x["decode_tok_s"] for x in runs if x["decode_tok_s"]]
            summary[mode] = {"ttft_ms": round(statistics.median(x["ttft_s"] for x in runs) * 1e3, 2),
                             "decode_tok_s": round(statistics.median(rates), 2) if rates else None}
            if mode != "ar" and "ar" in row["runs"]:
                summary[mode]["identical_to_ar"] = all(
                    a["token_ids"] == b["token_ids"] for a, b in zip(row["runs"]["ar"], runs))
        row["summary"] = summary
        if kernels and length in (lengths[0], lengths[-1]):
            row["target_steps"] = _step_times(pipe, prompts[0], 30)
        log(name, length, json.dumps(summary), json.dumps(row.get("target_steps", {})))
        save()


def _mode(mode: str) -> dict:
    """ "sd_always" / "mirror_always": every step speculates (the speculation gate off)."""
    if mode.endswith("_always"):
        return {"mode": mode[:-len("_always")], "adaptive_speculation": False}
    return {"mode": mode}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--adapter", required=True)
    p.add_argument("--plan", required=True)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--minutes", type=float, default=6.0, help="stop starting new lengths after this")
    p.add_argument("--lengths", default="64,512,2048,4096")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--export", choices=["float16", "float32"], help="export this bundle only, then stop")
    p.add_argument("--configs", default="fp16-cuda,fp16-cuda-nographs,fp32-cpu,fp16-cuda-width0,fp32-cuda,"
                                        "fp16-cuda-noflash")
    args = p.parse_args()
    deadline = time.time() + args.minutes * 60
    import onnxruntime as ort

    doc = {"question": "ar / sd / mirror with the target on ONNX Runtime's CUDA execution provider",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                       "onnxruntime": ort.__version__, "available_providers": ort.get_available_providers()},
           "settings": {"new_tokens": args.new_tokens, "repeats": args.repeats, "prompts": "bench/context.py"},
           "exports": {}, "configs": {}, "errors": []}
    try:
        import torch  # loads the CUDA libraries ONNX Runtime's CUDA provider links against (cuBLAS, cuDNN)

        doc["machine"].update(torch=torch.__version__, gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available()
                              else None)
        import openvino

        doc["machine"]["openvino"] = openvino.__version__
        doc["machine"]["cpu"] = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                                      if line.startswith("model name")), platform.processor())
    except Exception as e:  # a description of the machine is not worth stopping for
        doc["errors"].append(f"machine: {e!r}")

    def save() -> None:
        tmp = args.out.with_suffix(".partial")
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(args.out)

    lengths = [int(x) for x in args.lengths.split(",")]
    bundles = {"float16": args.work / "bundle-float16", "float32": args.work / "bundle-float32"}
    if args.export:  # one bundle, then stop: the shell runs the two exports side by side
        record = args.work / f"export-{args.export}.json"
        try:
            done = export(args.target, args.draft, args.adapter, args.plan, bundles[args.export], args.export)
        except Exception:
            done = {"error": traceback.format_exc()}
            log(done["error"])
        record.write_text(json.dumps(done, indent=1))
        return 0
    for dtype in bundles:
        record = args.work / f"export-{dtype}.json"
        doc["exports"][dtype] = json.loads(record.read_text()) if record.is_file() else {"error": "no export record"}
    save()
    every = ["ar", "sd", "mirror", "sd_always", "mirror_always"]
    # name: bundle, device, lengths, modes, prompts per length, target threads, kernel timings, Pipeline.load extras,
    # environment (ONNX Runtime reads its kernel switches when a session is made)
    configs = {
        "fp16-cuda-width0": (bundles["float16"], "cuda", lengths, every, args.repeats, None, True,
                             {"target_step_width": 0}, {}),
        "fp16-cuda": (bundles["float16"], "cuda", lengths, every, args.repeats, None, True, {}, {}),
        "fp16-cuda-nographs": (bundles["float16"], "cuda", lengths, every, args.repeats, None, True,
                               {"cuda_graphs": False}, {}),
        "fp32-cuda": (bundles["float32"], "cuda", [lengths[0]], ["ar"], 1, 4, False, {}, {}),
        "fp32-cpu": (bundles["float32"], "cpu", [lengths[0], lengths[-2]], ["ar", "sd", "mirror"], 2, 8, True, {}, {}),
        "fp16-cuda-noflash": (bundles["float16"], "cuda", lengths, every, args.repeats, None, False, {},
                              {"ORT_DISABLE_FLASH_ATTENTION": "1"}),
    }
    for name in args.configs.split(","):
        bundle, device, lens, modes, repeats, threads, kernels, load, env = configs[name]
        if time.time() > deadline:
            doc["errors"].append(f"{name}: not run, out of time")
            break
        os.environ.update(env)
        try:
            measure(name, bundle, device, lens, modes, repeats, args.new_tokens, threads, 4, kernels, deadline, doc,
                    save, load)
        except Exception:
            doc["errors"].append(f"{name}: {traceback.format_exc()}")
            log(doc["errors"][-1])
        for key in env:
            del os.environ[key]
        save()
    doc["ar_agreement_with_fp32_cpu"] = _agreement(doc)
    save()
    return 0


def _agreement(doc: dict) -> dict:
    """Per config and length: how many of ar's new tokens equal the float32 CPU target's before the first
    difference, over the prompts both ran (the same prompts: context_prompts is deterministic)."""
    ref = doc["configs"].get("fp32-cpu", {}).get("lengths", {})
    out = {}
    for name, entry in doc["configs"].items():
        for length, row in entry.get("lengths", {}).items():
            theirs = ref.get(length, {}).get("runs", {}).get("ar", [])
            ours = row.get("runs", {}).get("ar", [])
            pairs = [(a["token_ids"], b["token_ids"]) for a in ours for b in theirs if a["prompt"] == b["prompt"]]
            if not pairs or name == "fp32-cpu":
                continue
            common = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))) for a, b in pairs]
            out[f"{name}@{length}"] = {"prompts": len(pairs), "identical": sum(a == b for a, b in pairs),
                                       "tokens_before_first_difference": common}
    return out


if __name__ == "__main__":
    raise SystemExit(main())
