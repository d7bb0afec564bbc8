"""Train the streaming draft by distillation from the target, on two CPU cores.

Data: the target's own greedy answers to the training prompts (models/training/datagen.py) — the tokens the draft must
propose for the target to accept them — plus some Python standard-library source for code. Loss: the Speculative
Streaming loss, CE(next) + sum_j alpha_j CE(t + 1 + j), weighted 1.0 on the target's answer tokens and lower on
prompt text and library code (language in general, but not what the target would say).

Cheap by construction: a reduced vocabulary of the most frequent target tokens (the 576 x 49152 LM head alone
would cost a fifth of the target per token), embeddings initialised from the target's own embedding matrix
projected to the draft's width (its principal components), and a small 4-layer body.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from mirror_sd.models.streaming_draft import StreamingDraft, StreamingDraftConfig

ANSWER_WEIGHT, PROMPT_WEIGHT, CODE_WEIGHT = 1.0, 0.2, 0.3


@dataclass(frozen=True)
class StreamingDraftTraining:
    """How the streaming draft trains (`train`). The data files, the draft continued and the held-out file are
    `train`'s arguments; the defaults are the command's."""

    vocab_size: int = 8192  # a new draft's vocabulary: the most frequent target ids (a continued draft keeps its own)
    steps: int = 600
    budget_minutes: float = 20.0  # the schedule runs over whichever ends first, the steps or this time; then it stops
    seq_len: int = 128  # tokens per training window, packed across conversations (the draft's attention window)
    batch: int = 16  # windows per step
    lr: float = 3e-3  # peak; warm-up over 30 steps, then cosine to 0
    seed: int = 0  # the split, the batches and a new draft's initialisation
    # StreamingDraftConfig fields other than its defaults, for a new draft (tests build a tiny one)
    architecture: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch < 1 or self.seq_len < 2 or self.budget_minutes <= 0:
            raise ValueError(f"steps {self.steps}, batch {self.batch}, seq_len {self.seq_len}, budget_minutes "
                             f"{self.budget_minutes}: positive (seq_len at least 2)")


@dataclass(frozen=True)
class Example:
    ids: np.ndarray  # [T] target token ids
    weights: np.ndarray  # [T] loss weight of predicting ids[t] (from position t - 1)


def conversation_examples(data_file: Path | Sequence[Path], tokenizer) -> list[Example]:
    """Each conversation of one or more data files as token ids; weights mark the target's answer tokens (the
    last assistant turn)."""
    out = []
    files = [data_file] if isinstance(data_file, (str, Path)) else list(data_file)
    for record in (json.loads(line) for f in files for line in Path(f).open()):
        messages = record["messages"]
        prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages, tokenize=False)
        p_ids = tokenizer(prompt, add_special_tokens=False).input_ids
        f_ids = tokenizer(full, add_special_tokens=False).input_ids
        if f_ids[: len(p_ids)] != p_ids:  # the template must extend the prompt; skip anything odd
            continue
        weights = np.full(len(f_ids), PROMPT_WEIGHT, np.float32)
        weights[len(p_ids):] = ANSWER_WEIGHT
        out.append(Example(np.asarray(f_ids, np.int64), weights))
    return out


def code_examples(tokenizer, max_tokens: int, seed: int = 0) -> list[Example]:
    """Chunks of Python standard-library source (every machine has it), up to `max_tokens` tokens."""
    import json as json_module

    root = Path(inspect.getfile(json_module)).parent.parent
    files = sorted(root.glob("*.py"))
    random.Random(seed).shuffle(files)
    out, total = [], 0
    for f in files:
        ids = tokenizer(f.read_text(errors="ignore")[:6000], add_special_tokens=False).input_ids
        out.append(Example(np.asarray(ids, np.int64), np.full(len(ids), CODE_WEIGHT, np.float32)))
        total += len(ids)
        if total >= max_tokens:
            break
    return out


def build_vocab(examples: list[Example], size: int, always: list[int]) -> list[int]:
    """The `size` most frequent target ids (weighted by loss weight), special tokens always included."""
    counts: dict[int, float] = {}
    for ex in examples:
        for t, w in zip(ex.ids.tolist(), ex.weights.tolist()):
            counts[t] = counts.get(t, 0.0) + w
    ranked = [t for t in sorted(counts, key=lambda t: -counts[t]) if t not in always]
    return list(dict.fromkeys(always + ranked))[:size]


def init_from_target(draft: StreamingDraft, target_embeddings: torch.Tensor) -> None:
    """Draft embeddings = the target's embedding rows of its vocabulary, projected onto their top principal
    directions (scaled to a unit-ish norm): similar tokens start close, as they are in the target."""
    rows = target_embeddings[draft.vocab_ids].float()
    rows = rows - rows.mean(0, keepdim=True)
    _, _, v = torch.linalg.svd(rows, full_matrices=False)
    projected = rows @ v[: draft.config.hidden_size].T
    projected = projected / projected.norm(dim=-1, keepdim=True).mean() * math.sqrt(draft.config.hidden_size) * 0.02
    with torch.no_grad():
        emb = draft.lm.model.embed_tokens.weight
        emb[: draft.config.draft_vocab] = projected
        emb[draft.config.draft_vocab] = 0.0


def batches(examples: list[Example], seq_len: int, batch: int, rng: random.Random):
    """Endless shuffled batches of `seq_len`-token windows (packed across examples)."""
    ids = np.concatenate([e.ids for e in examples])
    weights = np.concatenate([e.weights for e in examples])
    starts = list(range(0, len(ids) - seq_len - 1, seq_len // 2))
    while True:
        rng.shuffle(starts)
        for i in range(0, len(starts) - batch + 1, batch):
            sel = starts[i: i + batch]
            yield (torch.from_numpy(np.stack([ids[s: s + seq_len] for s in sel])),
                   torch.from_numpy(np.stack([weights[s: s + seq_len] for s in sel])))


def weighted_ce(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=-100, reduction="none")
    w = weights.reshape(-1) * (labels.reshape(-1) != -100)
    return (loss * w).sum() / w.sum().clamp(min=1.0)


STREAM_STRIDE = 4  # streams train on every 4th position: each costs a full (reduced) LM head per position


def loss_fn(draft: StreamingDraft, ids: torch.Tensor, weights: torch.Tensor,
            stream_stride: int = STREAM_STRIDE) -> tuple[torch.Tensor, list[float]]:
    logits, labels, streams, stream_labels, pos = draft.forward_train(ids, stream_stride)
    main = weighted_ce(logits, labels, weights[:, 1:])
    total, parts = main, [main.item()]
    for j, s_logits in enumerate(streams):  # stream j at position p predicts token p + 2 + j
        part = weighted_ce(s_logits, stream_labels[..., j], weights[:, 2 + j + pos])
        total = total + draft.config.stream_weights[j] * part
        parts.append(part.item())
    return total, parts


@torch.no_grad()
def evaluate(draft: StreamingDraft, examples: list[Example]) -> dict[str, float]:
    """On answer tokens: how often the main stream's argmax is the target's token (a proxy for acceptance), and
    how often each stream's guess equals the target's token j+2 ahead given the true tokens before it."""
    draft.eval()
    hits = total = 0
    stream_hits = np.zeros(draft.config.streams)
    stream_total = np.zeros(draft.config.streams)
    for ex in examples:
        ids = torch.from_numpy(ex.ids[None])
        logits, labels, streams, stream_labels, pos = draft.forward_train(ids)
        answer = torch.from_numpy(ex.weights[1:] == ANSWER_WEIGHT)[None]
        pred = draft.vocab_ids[logits.argmax(-1)]
        hits += int(((pred == ids[:, 1:]) & answer).sum())
        total += int(answer.sum())
        for j, s in enumerate(streams):  # judged where the predicted token is an answer token
            ans_s = torch.from_numpy(ex.weights[2 + j + pos.numpy()] == ANSWER_WEIGHT)[None]
            truth = ids[:, 2 + j + pos]
            stream_hits[j] += int(((draft.vocab_ids[s.argmax(-1)] == truth) & ans_s).sum())
            stream_total[j] += int(ans_s.sum())
    draft.train()
    return {"next_token_agreement": hits / max(1, total),
            **{f"stream{j + 1}_agreement": float(h / max(1, n))
               for j, (h, n) in enumerate(zip(stream_hits, stream_total))}}


def train(target_dir: Path, data_file: Path | Sequence[Path], out_dir: Path,
          config: StreamingDraftTraining = StreamingDraftTraining(), *, init_from: Path | None = None,
          eval_file: Path | None = None, report=print) -> dict:
    """Distil a streaming draft; `init_from` continues a saved draft (its architecture and vocabulary) instead of
    starting fresh, `eval_file` (target answers to held-out-topic prompts) adds held_out_topic_* metrics."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    c = config
    seed, seq_len, steps, lr = c.seed, c.seq_len, c.steps, c.lr
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    convs = conversation_examples(data_file, tokenizer)
    rng.shuffle(convs)
    held_out, convs = convs[: max(8, len(convs) // 20)], convs[max(8, len(convs) // 20):]
    code = code_examples(tokenizer, max_tokens=sum(len(e.ids) for e in convs) // 4, seed=seed)
    if init_from is not None:
        draft = StreamingDraft.load(init_from)
        draft.config.attention_window = seq_len  # what this training shows it
        vocab = list(draft.config.vocab_ids)
    else:
        special = sorted({tokenizer.convert_tokens_to_ids(t) for t in tokenizer.all_special_tokens})
        vocab = build_vocab(convs + code, c.vocab_size, special)
        target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
        tc = target.config
        shape = StreamingDraftConfig(target_vocab_size=tc.vocab_size, vocab_ids=vocab,
                                     rope_theta=tc.rope_parameters["rope_theta"]
                                     if getattr(tc, "rope_parameters", None) else getattr(tc, "rope_theta", 10000.0),
                                     bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                     attention_window=seq_len, **c.architecture)
        draft = StreamingDraft(shape)
        init_from_target(draft, target.get_input_embeddings().weight.detach())
        del target
    answer_tokens = sum(int((e.weights == ANSWER_WEIGHT).sum()) for e in convs)
    covered = sum(int(np.isin(e.ids[e.weights == ANSWER_WEIGHT], vocab).sum()) for e in convs)
    report(f"draft: {sum(p.numel() for p in draft.parameters()) / 1e6:.1f}M parameters, vocabulary {len(vocab)} "
           f"covers {covered / max(1, answer_tokens):.1%} of {answer_tokens} answer tokens; "
           f"{len(convs)} conversations + {len(code)} code chunks")

    optimizer = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    data = batches(convs + code, seq_len, c.batch, rng)
    start, budget = time.monotonic(), c.budget_minutes * 60
    deadline = start + budget

    def schedule(step: int) -> float:
        """Warm-up, then cosine decay over whichever runs out first, the steps or the time budget."""
        progress = min(1.0, max(step / steps, (time.monotonic() - start) / budget))
        return min(1.0, (step + 1) / 30) * 0.5 * (1 + math.cos(math.pi * progress))

    draft.train()
    with tqdm(total=steps, desc="training draft", unit="step") as bar:
        for step in range(steps):
            for group in optimizer.param_groups:
                group["lr"] = lr * schedule(step)
            ids, weights = next(data)
            loss, parts = loss_fn(draft, ids, weights)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            optimizer.step()
            bar.set_postfix(loss=f"{parts[0]:.3f}", streams="/".join(f"{p:.2f}" for p in parts[1:]))
            bar.update(1)
            if time.monotonic() > deadline:
                report(f"time budget reached after {step + 1} steps")
                break
    metrics = evaluate(draft, held_out)
    if eval_file is not None:
        topics = evaluate(draft, conversation_examples(eval_file, tokenizer))
        metrics.update({f"held_out_topic_{k}": v for k, v in topics.items()})
    report("held-out answer tokens: " + ", ".join(f"{k} {v:.1%}" for k, v in metrics.items()))
    draft.eval()
    draft.save(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "training.json").write_text(json.dumps({"steps": step + 1, "seed": seed, "metrics": metrics,
                                                       "conversations": len(convs),
                                                       "continued_from": str(init_from) if init_from else None,
                                                       "config": asdict(c)},
                                                      indent=1) + "\n")
    return metrics


def main(argv: list[str] | None = None) -> int:
    d = StreamingDraftTraining()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True, nargs="+", help="one or more datagen files")
    parser.add_argument("--init-from", type=Path, default=None, help="continue training this saved draft")
    parser.add_argument("--eval", type=Path, default=None, help="target answers to held-out-topic prompts")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--max-minutes", type=float, default=d.budget_minutes,
                        help="the time budget: the schedule fits it, training stops there")
    parser.add_argument("--vocab-size", type=int, default=d.vocab_size)
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--seed", type=int, default=d.seed)
    args = parser.parse_args(argv)
    try:
        config = StreamingDraftTraining(vocab_size=args.vocab_size, steps=args.steps, budget_minutes=args.max_minutes,
                                        lr=args.lr, seed=args.seed)
    except ValueError as e:
        parser.error(str(e))
    torch.set_num_threads(2)
    train(args.target, args.data, args.out, config, init_from=args.init_from, eval_file=args.eval)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
