"""Prompts the target writes itself (Magpie): user queries sampled from its own chat template, answered greedily.

Every other pool (models/training/prompts.py) fills templates from short lists, so a draft trained on them learns the
templates: it drafts the benchmark's prompts, which it never saw, well below held-out records of its own pools
(docs/training.md). An instruction-tuned model
given its chat template up to the start of a user turn writes a user turn (Magpie, Xu et al. 2024): sampled, those
queries are as varied as what the model was tuned on. Each is then answered the way every pool is: the target's
greedy answer, fp32, to the conversation rendered by the same chat template.

    python -m mirror_sd.models.training.self_queries --target build/models/smollm2-135m-instruct -n 20000 \\
        --out models/training/data/answers-self.jsonl.gz

Records are those of models/training/answers.py (one gzip member per batch, kind "self"; an interrupted run resumes
where it stopped, indices already in the file skipped), so every trainer reads them like the other answers files. The
query sampling is seeded per batch, but sampled text is not bit-reproducible across devices or torch builds: the
token ids are what is committed, not the recipe's output. Runs on CUDA when torch sees a GPU (minutes), else on
the CPU (hours for thousands of prompts).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

from mirror_sd.errors import BadInputError
from mirror_sd.models.training import answers as answers_file

KIND = "self"
MARK = "\x00QUERY\x00"  # stands for the user turn's text while the template is rendered
MIN_QUERY_TOKENS = 4
DEFAULT_QUERY_TOKENS = 96
MAX_EMPTY_BATCHES = 20  # batches in a row with no usable query: the model does not write user turns


class SelfQueries:
    """The target, its tokenizer and chat template, on one device: samples queries, answers them greedily."""

    def __init__(self, target: Path, device: str | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        # fp32 without TF32: the answers are the fp32 target's, as the runtime verifies with
        torch.backends.cuda.matmul.allow_tf32 = False
        self.tokenizer = AutoTokenizer.from_pretrained(target)
        self.model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).to(self.device).eval()
        rendered = self.render([{"role": "user", "content": MARK}])
        if rendered.count(MARK) != 1:
            raise BadInputError(f"{target}: its chat template does not render a user turn's text once")
        # the conversation up to where the user's text begins (the system turn the template adds included)
        self.pre_query = self.encode(rendered.split(MARK)[0])
        # Not the tokenizer's eos_token_id alone: a transformers version may read the converted GGUF's as
        # <|im_start|>, which stops a turn one turn late.
        self.eos = end_of_turn(self.tokenizer)
        self.stops = [self.eos] + [t for t in [self.tokenizer.eos_token_id] if t is not None and t != self.eos]

    def render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _generate(self, prompts: list[list[int]], max_new_tokens: int, **sampling) -> list[list[int]]:
        """Each prompt's continuation up to and including the end-of-turn token (or max_new_tokens), batched with
        left padding."""
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.eos, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        with torch.no_grad():
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      max_new_tokens=max_new_tokens, eos_token_id=self.stops, pad_token_id=self.eos,
                                      **sampling)
        return [cut_at_stop(row, self.stops) for row in out[:, width:].tolist()]

    def queries(self, n: int, seed: int, temperature: float, top_p: float,
                max_tokens: int = DEFAULT_QUERY_TOKENS) -> list[str | None]:
        """`n` sampled user turns; None where one ran past max_tokens or is too short to be a question."""
        return [text.strip() if finished and tokens > MIN_QUERY_TOKENS and text.strip() else None
                for text, tokens, finished in self.sample([self.pre_query] * n, seed, temperature, top_p, max_tokens)]

    def sample(self, prefixes: list[list[int]], seed: int, temperature: float, top_p: float,
               max_tokens: int) -> list[tuple[str, int, bool]]:
        """Each prefix's sampled continuation: its text (stop token left out), how many tokens it took, and whether
        it ended its turn within max_tokens."""
        import torch

        torch.manual_seed(seed)
        out = []
        for ids in self._generate(prefixes, max_tokens, do_sample=True, temperature=temperature, top_p=top_p,
                                  top_k=0):
            finished = bool(ids) and ids[-1] in self.stops
            out.append((self.tokenizer.decode(ids[:-1] if finished else ids, skip_special_tokens=True), len(ids),
                        finished))
        return out

    def answer(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        return self._generate(prompts, max_new_tokens, do_sample=False)


def end_of_turn(tokenizer) -> int:
    """The token that ends a turn where the chat template ends it: the first after an assistant turn's text."""
    turn = tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "assistant", "content": MARK}],
                                         tokenize=False)
    after = tokenizer(turn.split(MARK)[-1], add_special_tokens=False).input_ids if turn.count(MARK) == 1 else []
    if not after:
        raise BadInputError("the chat template ends an assistant turn with no token")
    return after[0]


def cut_at_stop(ids: list[int], stops: list[int]) -> list[int]:
    """`ids` up to and including the first stop token (all of them where none occurs)."""
    ends = [i for i, t in enumerate(ids) if t in stops]
    return ids[: ends[0] + 1] if ends else ids


def excluded_queries() -> set[str]:
    """User turns a training pool must not hold: the held-out prompts' and the benchmark's."""
    from mirror_sd.models.benchmark_prompts import PROMPTS
    from mirror_sd.models.training.prompts import build

    turns = [m for p in build(800, 0, held_out=True) for m in p.messages]
    turns += [m for p in PROMPTS for m in p.messages]
    return {m["content"].strip() for m in turns if m["role"] == "user"}


# A batch's conversations as (record kind, messages ending in the user turn, or None where none was usable), drawn
# for records [index, index + want) with a seed salt that changes when the batch before was all dropped.
Draw = Callable[[int, int, int], list[tuple[str, list[dict] | None]]]


def append_answers(gen: SelfQueries, out: Path, n: int, batch: int, draw: Draw, *, desc: str, max_new_tokens: int,
                   max_minutes: float | None, report, no_turn: str) -> dict:
    """Append records [done, n) to `out`, a batch at a time: the conversations `draw` gives, less unusable, repeated
    and excluded user turns, each with the target's greedy answer. Stops resumably after max_minutes; raises
    BadInputError with `no_turn` after MAX_EMPTY_BATCHES batches in a row with no usable turn."""
    from tqdm import tqdm

    answers_file._truncate_partial(out)
    existing = answers_file.read(out)
    # no user turn twice, and none that a training pool may not hold (the held-out and benchmark prompts)
    taken = excluded_queries() | {r.get("query", "") for r in existing}
    index = max((r["index"] for r in existing), default=-1) + 1
    out.parent.mkdir(parents=True, exist_ok=True)
    start, tokens, dropped, retry = time.monotonic(), 0, 0, 0
    with out.open("ab") as f, tqdm(total=n, initial=min(index, n), desc=desc, unit="prompt", file=sys.stderr) as bar:
        while index < n:
            if max_minutes is not None and time.monotonic() - start > max_minutes * 60:
                report(f"time budget reached at {index} of {n} prompts: run again to go on")
                break
            want = min(batch, n - index)
            convs = []
            # a batch whose turns were all dropped draws again with another seed, not the same one forever
            for kind, conv in draw(index, want, 1_000_003 * retry):
                if conv is None or conv[-1]["content"].strip() in taken:
                    continue
                taken.add(conv[-1]["content"].strip())
                convs.append((kind, conv))
            dropped += want - len(convs)
            if not convs:
                retry += 1
                if retry == MAX_EMPTY_BATCHES:
                    raise BadInputError(f"no usable user turn in {retry} batches in a row: {no_turn}")
                continue
            retry = 0
            prompt_ids = [gen.encode(gen.render(conv)) for _, conv in convs]
            records = []
            for (kind, conv), ids, ans in zip(convs, prompt_ids, gen.answer(prompt_ids, max_new_tokens)):
                records.append({"index": index, "kind": kind, "query": conv[-1]["content"], "ids": ids + ans,
                                "answers": [[len(ids), len(ids) + len(ans)]]})
                index += 1
                tokens += len(ans)
            answers_file.write_member(f, records)  # one complete member per batch
            bar.update(len(records))
            bar.set_postfix(answer_tok_per_s=f"{tokens / (time.monotonic() - start):.0f}", dropped=dropped)
    return {"device": gen.device, "records": index, "new_answer_tokens": tokens, "dropped": dropped,
            "seconds": round(time.monotonic() - start, 1)}


def generate(target: Path, out: Path, n: int, *, batch: int = 256, seed: int = 0, temperature: float = 1.0,
             top_p: float = 0.95, max_new_tokens: int = answers_file.DEFAULT_MAX_NEW, max_minutes: float | None = None,
             device: str | None = None, report=print) -> dict:
    """Append records [done, n) to `out`: for each batch, sample queries (seed + first index), drop unfinished,
    repeated and excluded ones, answer the rest. Stops resumably after max_minutes."""
    if n <= 0 or batch <= 0:
        raise BadInputError("-n and --batch must be positive")
    gen = SelfQueries(target, device)

    def draw(index: int, want: int, salt: int) -> list[tuple[str, list[dict] | None]]:
        return [(KIND, None if q is None else [{"role": "user", "content": q}])
                for q in gen.queries(want, seed + index + salt, temperature, top_p)]

    summary = append_answers(gen, out, n, batch, draw, desc="self queries", max_new_tokens=max_new_tokens,
                             max_minutes=max_minutes, report=report,
                             no_turn=f"{target} ended no user turn within {DEFAULT_QUERY_TOKENS} tokens, or all were "
                                     "repeats")
    summary["dropped_queries"] = summary.pop("dropped")
    return summary


def cli(description: str, temperature: float) -> argparse.ArgumentParser:
    """The options every self-written pool's command takes (this module's and models.task_queries')."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--target", type=Path, default=Path("build/models/smollm2-135m-instruct"),
                   help="the target's HF directory")
    p.add_argument("-n", type=int, default=20000, help="records [0, n)")
    p.add_argument("--out", type=Path, required=True, help="gzip JSON-lines file (appended to; resumes)")
    p.add_argument("--batch", type=int, default=256, help="conversations per batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=temperature, help="user-turn sampling temperature")
    p.add_argument("--top-p", type=float, default=0.95, help="user-turn sampling nucleus")
    p.add_argument("--max-new-tokens", type=int, default=answers_file.DEFAULT_MAX_NEW, help="answer length cap")
    p.add_argument("--max-minutes", type=float, default=None, help="stop (resumably) after this long")
    return p


def run_cli(args: argparse.Namespace, generate_with, **more) -> int:
    """`generate_with(target, out, n, ...)` on the parsed options: its summary printed as JSON, or a typed error and
    exit status 2, nothing written."""
    try:
        if not (args.target / "config.json").is_file():
            raise BadInputError(f"{args.target}: not a transformers model directory (no config.json)")
        if not 0 < args.top_p <= 1 or args.temperature <= 0:
            raise BadInputError("--temperature must be positive and --top-p in (0, 1]")
        summary = generate_with(args.target, args.out, args.n, batch=args.batch, seed=args.seed,
                                temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                                max_minutes=args.max_minutes, **more)
    except BadInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(cli(__doc__.splitlines()[0], 1.0).parse_args(argv), generate)


if __name__ == "__main__":
    sys.exit(main())
