"""Where the int8 target's disagreement with float32 comes from: the weights rounded onto the 8-bit block grid, or
the kernel's int8 activations (ONNX Runtime's MatMulNBits at accuracy level 4).

On every benchmark prompt the float32 bundle's greedy answer (prompt + answer, teacher-forced) gives the float32
target's top-1 token per answer position; against it: the torch target with its Linear weights on the int8 grid
(float32 arithmetic: the weights' share), the same with the LM head left float32, and the int8 bundle's ONNX target
(weights and int8 activations).

    .venv/bin/python lab/scripts/int8_agreement_apart.py build/bundles/smollm2-feature \
        build/bundles/smollm2-feature-int8 --out results/int8-agreement-apart.json
"""

from __future__ import annotations

import argparse
import copy
import json

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from mirror_sd.bench.machine import describe_machine
from mirror_sd.export.architectures import architecture_of
from mirror_sd.export.target_weights import on_block_grid
from mirror_sd.models.benchmark_prompts import PROMPTS
from mirror_sd.models.smollm2 import TARGET_DIR
from mirror_sd.runtime.pipeline import Pipeline


def onnx_top1(pipe: Pipeline, ids: list[int], start: int) -> np.ndarray:
    logits, _ = pipe.target.forward(ids, pipe.target.empty_cache(), logits_for=len(ids) - start)
    return np.asarray(logits).reshape(-1, np.asarray(logits).shape[-1]).argmax(-1)


def torch_top1(model, ids: list[int], start: int) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, start:]
    return logits.argmax(-1).numpy()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("float32_bundle")
    parser.add_argument("int8_bundle")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(2)
    base = Pipeline.load(args.float32_bundle)
    int8 = Pipeline.load(args.int8_bundle)
    model = AutoModelForCausalLM.from_pretrained(TARGET_DIR, torch_dtype=torch.float32).eval()
    rounded = on_block_grid(model, "int8", architecture_of(model.config)).eval()
    head_float = copy.deepcopy(rounded)
    head_float.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone(), requires_grad=False)
    arms = {"torch float32": lambda ids, s: torch_top1(model, ids, s),
            "torch int8 grid (float32 arithmetic)": lambda ids, s: torch_top1(rounded, ids, s),
            "torch int8 grid, LM head float32": lambda ids, s: torch_top1(head_float, ids, s),
            "onnx int8 (int8 activations)": lambda ids, s: onnx_top1(int8, ids, s)}
    same = {name: 0 for name in arms}
    positions = 0
    for p in PROMPTS:
        ids = base.prompt_ids(list(p.messages))
        answer = base.generate(ids, mode="ar", max_new_tokens=args.new_tokens, temperature=0.0).token_ids
        seq = ids + answer
        reference = onnx_top1(base, seq[:-1], len(ids) - 1)
        positions += len(reference)
        for name, top1 in arms.items():
            same[name] += int((top1(seq[:-1], len(ids) - 1) == reference).sum())
        print(p.name, {n: round(s / positions, 4) for n, s in same.items()}, flush=True)
    result = {"machine": describe_machine(), "positions": positions, "prompts": len(PROMPTS),
              "reference": "the float32 ONNX target's top-1 on its own greedy answers",
              "top1_agreement": {name: s / positions for name, s in same.items()}}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
