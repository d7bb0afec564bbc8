"""Many clients at once on the GPU (issues 56 and 59): the batching engine with the float16 target on ONNX Runtime's
CUDA execution provider, beside transformers' batched generate on the same GPU with the same float16 weights.

- solo: every request's prompt alone through the pipeline (greedy ar): what each answer under batching must equal;
- engine: the serving section's prompts (bench/serving.py: the same requests per client count as `make bench`'s full
  size), closed loop at 1 / 4 / 16 / 64 clients through the engine in process (the GPU machine has no web stack),
  series ar and planned (the bundle's plan; at batch > 1 both take the same batched steps): aggregate tokens/s,
  p50 / p99 latency and TTFT, and every answer against its solo one (the first difference and the solo logits'
  top-2 margin there: float16 kernels tile by rows, so a batched row may round otherwise);
- transformers: `generate` (greedy, its default sdpa attention and dynamic cache) on batches of `clients` prompts,
  left-padded, each batch to the end of its longest answer (static batching: what a plain script gets), the same
  requests;
- transformers_single (issue 59, item 4: ours at batch 1 is cuda_ep.py's): one request at a time on bench/context.py's
  prompts of 64 and 2,048 tokens, `generate` as above, with its static cache and torch.compile (--compile; the
  first call per length compiles, untimed), and assisted generation with the plain form of the streaming draft
  (--assistant, bench/plain_draft.py; a constant window of --gamma, no early stop, as bench/hf_baselines.py):
  TTFT and decode tokens/s (new tokens - 1) / (total - TTFT), answers against our solo ar on the same prompt.
Every side runs one warm-up generation first (CUDA's first kernels load and tune).
Each section is written to --out as it ends; a run cut off by its time limit leaves what it measured.

    python3 gpu_serving.py --bundle bundle-float16 --hf target --out $OUT/gpu-serving.json          # GPU machine
    .venv/bin/python lab/scripts/gpu_serving.py --bundle build/bundles/smollm2-feature \\
        --hf build/models/smollm2-135m-instruct --device cpu --clients 1,4 --max-tokens 8 --out /tmp/dry.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import traceback
from pathlib import Path


def log(*parts) -> None:
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


def requests_for(clients: int, count: int | None) -> list[int]:
    from mirror_sd.bench import serving

    indices = serving.point_prompts(serving.FULL, clients)
    return indices[:count] if count else indices


def margin(pipe, prompt: list[int], answer: list[int], at: int) -> float:
    """The solo target's top-2 logit gap at the answer's position `at` (how near a tie the tokens split)."""
    import numpy as np

    target = pipe.target
    logits, _ = target.forward(prompt + answer[:at], target.empty_cache(), logits_for=1)
    top = np.sort(np.asarray(logits, np.float32).reshape(-1))[-2:]
    return float(top[1] - top[0])


def engine_points(pipe, ids: list[list[int]], expected: list[list[int]], clients_list: list[int],
                  max_tokens: int, count: int | None, deadline: float, doc: dict, save) -> None:
    from mirror_sd.bench import serving

    engine = pipe.engine()
    first = min(ids)
    for mode in ("ar", None):  # warm-up, each series once
        engine.submit(*pipe.check(ids[first], max_new_tokens=8, **({"mode": mode} if mode else {}))).wait()
    for clients in clients_list:
        for series in ("ar", "planned"):
            if time.time() > deadline:
                doc["errors"].append(f"engine {series} at {clients} clients: not run, out of time")
                return
            indices = requests_for(clients, count)
            mode = {} if series == "planned" else {"mode": "ar"}

            def work(i: int, indices=indices, mode=mode) -> dict:
                start = time.perf_counter()
                first = None
                request = engine.submit(*pipe.check(ids[indices[i]], max_new_tokens=max_tokens, temperature=0.0,
                                                    **mode))
                tokens = []
                for chunk in request:
                    first = first or time.perf_counter()
                    tokens.append(chunk.token_id)
                return {"prompt": indices[i], "tokens": len(tokens), "token_ids": tokens, "error": None,
                        "ttft_s": (first or time.perf_counter()) - start, "latency_s": time.perf_counter() - start,
                        "mean_batch": request.result.stats.mean_batch_size}

            runs, wall = serving.closed_loop(work, len(indices), clients)
            differ = []
            for r in runs:
                want = expected[r["prompt"]]
                if r["token_ids"] != want:
                    at = next((k for k, (a, b) in enumerate(zip(want, r["token_ids"])) if a != b),
                              min(len(want), len(r["token_ids"])))
                    differ.append({"prompt": r["prompt"], "first_difference": at,
                                   "solo_top2_margin": margin(pipe, ids[r["prompt"]], want, at)
                                   if at < len(want) else None})
            point = serving.summarise(clients, [{k: v for k, v in r.items() if k != "token_ids"} for r in runs], wall)
            point["mean_batch"] = statistics.mean(r["mean_batch"] for r in runs)
            point["differ_from_solo"] = differ
            doc["engine"].setdefault(series, {})[str(clients)] = point
            log("engine", series, clients, "clients", round(point["tokens_per_s"], 1), "tokens/s, p50",
                round(point["latency_s"]["p50"], 3), "s,", len(differ), "differ from solo")
            save()
    engine.close()


def transformers_points(hf_dir: Path, device: str, ids: list[list[int]], expected: list[list[int]], eos: list[int],
                        clients_list: list[int], max_tokens: int, count: int | None, deadline: float, doc: dict,
                        save) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.float16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device).eval()
    doc["transformers"]["settings"] = {"dtype": str(dtype), "attn_implementation": model.config._attn_implementation,
                                       "device": device}
    pad = eos[0]
    with torch.no_grad():  # warm-up
        model.generate(input_ids=torch.tensor([ids[min(ids)]], device=device), max_new_tokens=8, do_sample=False,
                       pad_token_id=pad)
    for clients in clients_list:
        if time.time() > deadline:
            doc["errors"].append(f"transformers at {clients} clients: not run, out of time")
            return
        indices = requests_for(clients, count)
        tokens, latencies, answers = 0, [], {}
        start = time.perf_counter()
        for b in range(0, len(indices), clients):
            batch = [ids[i] for i in indices[b:b + clients]]
            width = max(map(len, batch))
            input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in batch], device=device)
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch], device=device)
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_tokens,
                                     do_sample=False, eos_token_id=eos, pad_token_id=pad)
            if device == "cuda":
                torch.cuda.synchronize()
            latencies += [time.perf_counter() - t0] * len(batch)
            for i, row in zip(indices[b:b + clients], out[:, width:].tolist()):
                answer = []
                for t in row:
                    answer.append(t)
                    if t in eos:
                        break
                answers[i] = answer
                tokens += len(answer)
        wall = time.perf_counter() - start
        doc["transformers"][str(clients)] = {
            "requests": len(indices), "completion_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "latency_s": {"p50": statistics.median(latencies)},
            "answers_equal_to_our_solo": sum(answers[i] == expected[i] for i in indices)}
        log("transformers", clients, "clients", round(tokens / wall, 1), "tokens/s")
        save()


def transformers_single(pipe, hf_dir: Path, device: str, lengths: list[int], prompts_per_length: int,
                        max_tokens: int, compile_: bool, assistant_dir: Path | None, gamma: int, deadline: float,
                        doc: dict, save) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from mirror_sd.bench.context import context_prompts
    from mirror_sd.bench.hf_baselines import _FirstTokenClock, _ForwardCounter

    dtype = torch.float16 if device == "cuda" else torch.float32
    eos = list(pipe.manifest.tokenizer.eos_token_ids)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device).eval()
    configs: dict[str, dict] = {"generate": {}}
    if assistant_dir is not None:
        assistant = AutoModelForCausalLM.from_pretrained(assistant_dir, dtype=dtype).to(device).eval()
        cfg = assistant.generation_config  # transformers reads the window settings from here
        cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule = gamma, "constant"
        cfg.assistant_confidence_threshold = 0.0
        configs["assisted"] = {"assistant_model": assistant}
    if compile_:
        configs["static_compiled"] = {"cache_implementation": "static"}
    out = doc["transformers_single"]
    for length in lengths:
        prompts = context_prompts(pipe, length, prompts_per_length + 1)
        solo_ar = [pipe.generate(x, mode="ar", max_new_tokens=max_tokens, temperature=0.0).token_ids
                   for x in prompts[1:]]
        for name, extra in configs.items():
            if time.time() > deadline:
                doc["errors"].append(f"transformers_single {name} at {length}: not run, out of time")
                continue
            forward = model.forward
            try:
                if name == "static_compiled":
                    model.forward = torch.compile(forward, mode="reduce-overhead", fullgraph=True)
                runs = []
                for k, ids in enumerate(prompts):  # the first: warm-up (and the compile), untimed
                    x = torch.tensor([ids], device=device)
                    clock, calls = _FirstTokenClock(), _ForwardCounter(model)
                    start = time.perf_counter()
                    with torch.inference_mode():
                        new = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                                             do_sample=False, eos_token_id=eos, pad_token_id=eos[0], streamer=clock,
                                             **extra)[0, len(ids):].tolist()
                    if device == "cuda":
                        torch.cuda.synchronize()
                    total = time.perf_counter() - start
                    calls.remove()
                    if k:
                        ttft = (clock.first or start + total) - start
                        runs.append({"ttft_s": ttft, "total_s": total, "new_tokens": len(new),
                                     "decode_tok_s": (len(new) - 1) / (total - ttft) if total > ttft else None,
                                     "target_forwards": calls.calls, "equal_to_our_ar": new == solo_ar[k - 1]})
                rates = [r["decode_tok_s"] for r in runs if r["decode_tok_s"]]
                out.setdefault(name, {})[str(length)] = {
                    "runs": runs, "ttft_ms": statistics.median(r["ttft_s"] for r in runs) * 1e3,
                    "decode_tok_s": statistics.median(rates) if rates else None}
                log("transformers_single", name, length, round(out[name][str(length)]["decode_tok_s"] or 0, 1),
                    "tokens/s")
            except Exception:
                doc["errors"].append(f"transformers_single {name} at {length}: {traceback.format_exc()}")
                log(doc["errors"][-1])
            finally:
                model.forward = forward
            save()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", type=Path, required=True, help="the float16 bundle (float32 for a CPU dry run)")
    p.add_argument("--hf", type=Path, required=True, help="the same target as a Hugging Face directory")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--clients", default="1,4,16,64")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=None, help="at most this many requests per point (dry runs)")
    p.add_argument("--minutes", type=float, default=4.0, help="start no new point after this")
    p.add_argument("--sections", default="engine,transformers,transformers_single")
    p.add_argument("--lengths", default="64,2048", help="transformers_single's prompt lengths")
    p.add_argument("--prompts", type=int, default=3, help="transformers_single's prompts per length")
    p.add_argument("--compile", action="store_true", help="transformers_single: static cache + torch.compile too")
    p.add_argument("--assistant", type=Path, default=None, help="transformers_single: the plain draft's directory")
    p.add_argument("--gamma", type=int, default=6, help="the assistant's window")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    deadline = time.time() + args.minutes * 60
    doc = {"question": "many clients at once on the GPU: the batching engine against transformers' batched generate",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "settings": vars(args) | {
               "bundle": str(args.bundle), "hf": str(args.hf), "out": str(args.out), "assistant": str(args.assistant)},
           "machine": {"python": platform.python_version()}, "solo": {}, "engine": {}, "transformers": {},
           "transformers_single": {}, "errors": []}

    def save() -> None:
        tmp = args.out.with_suffix(".partial")
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(args.out)

    try:
        import onnxruntime as ort
        import torch

        doc["machine"].update(onnxruntime=ort.__version__, torch=torch.__version__,
                              gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    except Exception as e:  # a description of the machine is not worth stopping for
        doc["errors"].append(f"machine: {e!r}")
    from mirror_sd import Pipeline
    from mirror_sd.bench import serving

    clients_list = [int(c) for c in args.clients.split(",")]
    pipe = Pipeline.load(args.bundle, target_device=args.device, draft_backend="openvino", huge_pages=False,
                         max_num_seqs=max(clients_list), max_context=serving.FULL.max_context)
    doc["pipeline"] = {"target_device": pipe.target.device, "draft_device": getattr(pipe.draft, "device", None),
                       "step_width": getattr(pipe.target, "step_width", None), "mode": pipe.generation_config.mode}
    prompts = serving.serving_prompts()
    wanted = sorted({i for c in clients_list for i in requests_for(c, args.requests)})
    ids = {i: serving.prompt_ids(pipe.codec, prompts[i].messages) for i in wanted}
    start = time.perf_counter()
    references = serving.solo_references(pipe, [prompts[i] for i in wanted], args.max_tokens)
    expected = {i: e.token_ids for i, e in zip(wanted, references)}
    doc["solo"] = {"requests": len(wanted), "seconds": time.perf_counter() - start,
                   "token_ids": {str(i): t for i, t in expected.items()}}
    log("solo", len(wanted), "requests in", round(doc["solo"]["seconds"], 1), "s")
    save()
    eos = list(pipe.manifest.tokenizer.eos_token_ids)
    runs = {
        "engine": lambda: engine_points(pipe, ids, expected, clients_list, args.max_tokens, args.requests, deadline,
                                        doc, save),
        "transformers": lambda: transformers_points(args.hf, args.device, ids, expected, eos, clients_list,
                                                    args.max_tokens, args.requests, deadline, doc, save),
        "transformers_single": lambda: transformers_single(
            pipe, args.hf, args.device, [int(x) for x in args.lengths.split(",")], args.prompts, args.max_tokens,
            args.compile, args.assistant, args.gamma, deadline, doc, save),
    }
    for name in args.sections.split(","):
        try:  # a section that fails is recorded; the next one still runs
            runs[name]()
        except Exception:
            doc["errors"].append(f"{name}: {traceback.format_exc()}")
            log(doc["errors"][-1])
        save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
