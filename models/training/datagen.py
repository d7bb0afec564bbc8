"""Distillation data: the target's own greedy answers to the training prompts (models/training/prompts.py).

The draft learns to say what the target says, so the best data is the target's own output on prompts like the
ones users send. Generation is batched transformers `generate` on the CPU (fp32, greedy), written to a JSONL file
one batch at a time, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mirror_sd.models.training.prompts import Prompt, build, build_advice, build_broad, build_code

POOLS = {"base": build, "broad": build_broad, "held-out": lambda n, seed: build(n, seed=seed, held_out=True),
         "code": build_code, "advice": build_advice}


def _load(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, tokenizer


def _answer(model, tokenizer, conversations: list[list[dict]], max_new_tokens: int) -> list[str]:
    import torch

    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    return [tokenizer.decode(row[enc.input_ids.shape[1]:], skip_special_tokens=True).strip() for row in out]


def generate(model_dir: Path, out_file: Path, n: int, batch: int = 32, max_new_tokens: int = 128,
             seed: int = 0, pool: str = "base") -> Path:
    """Append the target's answers for prompts [done, n) of a prompt pool to `out_file`: "base" or "broad"
    (training, models/training/prompts.py) or "held-out" (evaluation only: the draft's agreement on topics it never
    saw)."""
    import torch
    from tqdm import tqdm

    torch.manual_seed(seed)
    prompts = POOLS[pool](n, seed=seed)
    done_ids = {json.loads(line)["index"] for line in out_file.open()} if out_file.exists() else set()
    todo = [i for i in range(n) if i not in done_ids]
    if not todo:
        return out_file
    model, tokenizer = _load(model_dir)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    # Batches of similar prompt length waste less on padding, but a run stopped early should still hold every
    # task kind: sort by length only within blocks of 8 batches. The file keeps the generator's index.
    block = 8 * batch
    order = [i for b in range(0, len(todo), block)
             for i in sorted(todo[b:b + block], key=lambda i: len(json.dumps(prompts[i].messages)))]
    with out_file.open("a") as f, tqdm(total=n, initial=n - len(todo), desc="target answers", unit="prompt") as bar:
        for start in range(0, len(order), batch):
            idx = order[start:start + batch]
            convs = [list(prompts[i].messages) for i in idx]
            first = [j for j, c in enumerate(convs) if len(c) == 3]  # multi-turn: answer turn 1 first
            if first:
                for j, answer in zip(first, _answer(model, tokenizer, [convs[j][:1] for j in first], max_new_tokens)):
                    convs[j][1] = {"role": "assistant", "content": answer}
            for i, conv, answer in zip(idx, convs, _answer(model, tokenizer, convs, max_new_tokens)):
                f.write(json.dumps({"index": i, "kind": prompts[i].kind,
                                    "messages": conv + [{"role": "assistant", "content": answer}]}) + "\n")
            f.flush()
            bar.update(len(idx))
    return out_file


def load(path: Path) -> list[Prompt]:
    """The conversations of a data file, each ending with the target's answer."""
    return [Prompt(r["kind"], r["messages"]) for r in map(json.loads, path.open())]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("-n", type=int, default=1200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--pool", choices=tuple(POOLS), default="base")
    args = parser.parse_args(argv)
    generate(args.model, args.out, args.n, args.batch, args.max_new_tokens, pool=args.pool)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
