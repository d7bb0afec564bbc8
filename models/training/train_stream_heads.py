"""Stream heads for a trained feature draft: more than one drafted token per forward.

    python -m mirror_sd.models.training.train_stream_heads --target build/models/smollm2-135m-instruct \\
        --draft models/weights/smollm2-feature-draft --answers models/training/data/answers-broad.jsonl.gz \\
        --work build/stream-heads --out models/weights/smollm2-feature-draft

The draft itself is frozen: only its new `StreamHead`s train (models/feature_draft.py), so they read the hidden
states the committed draft gives at run time. Each batch runs the target's layers up to the draft's deepest tap (the
exported prefix graph on ONNX Runtime on CPU, torch on CUDA), then the draft's training-time test `depths` steps deep
without gradients (a stream head reads the draft's hidden state wherever a window may end: after its first token,
or after tokens it drafted on its own features), then the stream heads teacher-forced: stream j is fed the text's
token j - 1 places past the main stream's and predicts the one after it, cross-entropy over the first
`stream_vocab` rows of the draft's head. At run time a stream is used only where every token before it was right,
so the text's tokens are what it is fed there.

A checkpoint is written every few minutes; a stopped run resumes from it with the same arguments. The last stage
measures, on held-out records and from every answer position, what sd commits per target step at gamma 4 with the
window's last tokens taken from the streams ("trust") against the draft alone, and the draft tokens per forward.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from mirror_sd.errors import BadInputError
from mirror_sd.models.feature_draft import FeatureDraft
from mirror_sd.models.training import train_feature_draft as tfd
from mirror_sd.partitions.manifest import TAPS

STREAMS_SUMMARY = "streams.json"  # the stream heads' training summary, beside the draft's weights
STREAM_DECAY = 0.8  # loss weight of stream j: STREAM_DECAY ** j (a later stream counts only if earlier ones land)


@dataclass(frozen=True)
class StreamHeadsTraining:
    """How the stream heads train (`run`). The draft, the answers files and their prompt ranges are `run`'s
    arguments; the defaults are the command's."""

    streams: int = 2  # heads: tokens drafted per forward past the main one
    stream_vocab: int = 4096  # the head rows the streams predict over, the most frequent first (0: all)
    stream_width: int = 0  # a head's inner width (0: twice the draft's hidden size)
    depths: int = 3  # the draft depths whose hidden states the streams are trained on (where a window may end)
    batches: int = 2000
    lr: float = 1e-3  # peak; warm-up over 30 batches, then cosine to 5%
    tokens_per_batch: int = 4096  # padded tokens per batch
    max_len: int = 1024  # a longer conversation keeps its last max_len tokens
    eval_records: int = 64  # held-out records measured on
    seed: int = 0  # batch order
    continue_streams: bool = False  # train the heads the draft has further (same shape) instead of new ones

    def __post_init__(self) -> None:
        if self.streams < 1 or self.depths < 1 or self.batches < 1:
            raise ValueError(f"streams {self.streams}, depths {self.depths}, batches {self.batches}: at least 1")


class _OrtFeatures:
    """The target's tap features of a record, recomputed each time it is read by the exported prefix graph on ONNX
    Runtime (on CPU faster than torch, and nothing stored): stands where a FeatureStore does in tfd._tensors. On
    CUDA tfd.OnlineFeatures stands there instead."""

    def __init__(self, target, taps: list[int], records: list[tfd.Record]) -> None:
        self.prefix = tfd._OrtPrefix(target, max(taps), tuple(taps))
        self.taps, self.width, self.records = list(taps), target.config.hidden_size, records

    def get(self, i: int) -> np.ndarray:

        return self.prefix(self.records[i].ids, TAPS)


def _stream_rows(draft: FeatureDraft, ids: torch.Tensor) -> torch.Tensor:
    """Head rows of target ids, -100 where a stream cannot propose them (outside its first stream_rows rows)."""
    rows = draft.id_map[ids]
    return torch.where((rows >= 0) & (rows < draft.config.stream_rows), rows, torch.full_like(rows, -100))


def stream_loss(draft: FeatureDraft, taps, ids, labels, depths: int) -> tuple[torch.Tensor, list[float]]:
    """Weighted CE of the stream heads over the draft's hidden states at every depth below `depths`, and each
    stream's accuracy. Position t of depth k's hidden states predicts ids[t + 2] (main); stream j (0-based) is fed
    ids[t + 2 + j] and predicts ids[t + 3 + j]."""
    s = draft.config.streams
    with torch.no_grad():
        hs = draft.forward_ttt(taps, ids, depths)
    t = ids.shape[1]
    pad = torch.zeros(ids.shape[0], s + 1, dtype=ids.dtype, device=ids.device)
    ext_ids = torch.cat([ids, pad], 1)
    ext_lab = torch.cat([labels, torch.zeros_like(pad, dtype=torch.bool)], 1)
    # [B, T-2, S]: stream j at position p (of the T - 2 with a main label) is fed ids[p + 2 + j] and predicts
    # ids[p + 3 + j]
    fed = torch.stack([ext_ids[:, 2 + j: t + j] for j in range(s)], -1)
    want = torch.stack([ext_ids[:, 3 + j: t + 1 + j] for j in range(s)], -1)
    want_ok = torch.stack([ext_lab[:, 3 + j: t + 1 + j] for j in range(s)], -1)
    rows = torch.where(want_ok, _stream_rows(draft, want), torch.full_like(want, -100))
    total, weight = 0.0, 0.0
    right, seen = np.zeros(s), np.zeros(s)
    for k, h in enumerate(hs):
        base = labels[:, 2:].clone()  # the main stream's token is an answer token
        base[:, :k] = False  # no base before position 0
        states = draft.stream_states(h[:, :-1][base], fed[base])
        for j, z in enumerate(states):
            target = rows[base][:, j]
            if not (target >= 0).any():
                continue
            logits = draft.stream_logits(z)
            total = total + STREAM_DECAY ** j * torch.nn.functional.cross_entropy(logits, target, ignore_index=-100)
            weight += STREAM_DECAY ** j
            ok = target >= 0
            right[j] += float((logits.argmax(-1)[ok] == target[ok]).sum())
            seen[j] += float(ok.sum())
    if weight == 0:
        return torch.zeros((), requires_grad=True), [0.0] * s
    return total / weight, [float(r / max(1, n)) for r, n in zip(right, seen)]


@torch.no_grad()
def evaluate(draft: FeatureDraft, records: list[tfd.Record], indices: list[int], features, device: str,
             gamma: int) -> dict:
    """From every held-out answer position whose next gamma tokens are answer tokens: the tokens sd commits per
    target step (1 + the leading drafted tokens the target takes) with the draft alone, one token per forward, and
    with the last streams-many window tokens taken from the stream heads after the draft's (gamma - streams)-th
    token ("trust"); and the draft tokens per forward of each (walked as sd steps: _walk)."""
    s = min(draft.config.streams, gamma - 1)
    main_depth = gamma - s  # main-stream tokens per window; the streams read the hidden state of the last of them
    sums = {"plain": [0, 0], "trust": [0, 0]}  # walked steps, tokens
    bases = 0
    for i in indices:
        ids, labels, taps = tfd._tensors([i], records, features, device)
        t = ids.shape[1]
        if t - 1 - gamma <= 0:
            continue
        hs = draft.forward_ttt(taps, ids, gamma)
        right = tfd.draft_right(draft, hs, ids)  # [gamma, T], indexed by base
        trusted = right.clone()
        h = hs[main_depth - 1][0, :-1]  # base b's row is position b + main_depth - 1
        proposals = draft.stream_ids(h, draft.logits(h))  # [T-1, S]
        for j in range(s):
            k = main_depth + j  # window slot
            n = t - 2 - k
            if n > 0:
                trusted[k, :n] = proposals[main_depth - 1: main_depth - 1 + n, j] == ids[0, 2 + k: 2 + k + n]
        valid = tfd.window_bases(labels[0], gamma).tolist()
        bases += sum(valid)
        for name, table in (("plain", right), ("trust", trusted)):
            lead = torch.cumprod(table.int(), 0).sum(0).tolist()
            steps, tokens = tfd._walk(valid, lead)
            sums[name][0] += steps
            sums[name][1] += tokens
    out = {"bases": bases, "gamma": gamma, "streams": s}
    for name, (steps, tokens) in sums.items():
        out[f"{name}_tokens_per_step"] = tokens / max(1, steps)
        out[f"{name}_acceptance"] = (tokens / max(1, steps) - 1) / gamma
    out["plain_draft_tokens_per_forward"] = 1.0
    out["trust_draft_tokens_per_forward"] = gamma / main_depth
    return out


def train(draft: FeatureDraft, records: list[tfd.Record], order: list[int], features, device: str, work: Path,
          config: StreamHeadsTraining, *, max_minutes: float | None = None, report=print) -> dict:
    """config.batches batches of the training records (passes over them as needed), AdamW on the stream heads only
    with a warm-up and a cosine schedule; a checkpoint under `work` every few minutes, resumed from when run again."""
    from tqdm import tqdm

    batches, lr = config.batches, config.lr
    rng = random.Random(config.seed)
    plan: list[list[int]] = []
    while len(plan) < batches:
        plan += tfd._batches(order, records, config.tokens_per_batch, rng)
    plan = plan[:batches]
    params = list(draft.stream_heads.parameters())
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    ckpt = work / "checkpoint.pt"
    done, spent = 0, 0.0
    if ckpt.exists():
        state = torch.load(ckpt, map_location="cpu")
        if state["plan_len"] == len(plan):
            draft.stream_heads.load_state_dict(state["streams"])
            optimizer.load_state_dict(state["optimizer"])
            done, spent = state["done"], state["seconds"]
            report(f"resuming at batch {done} of {len(plan)}")
    run_start = last_save = time.monotonic()
    accs: list[float] = []
    with tqdm(total=len(plan), initial=done, desc="training stream heads", unit="batch") as bar:
        for b in range(done, len(plan)):
            for group in optimizer.param_groups:
                cosine = 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * b / len(plan)))
                group["lr"] = lr * min(1.0, (b + 1) / 30) * cosine
            ids, labels, taps = tfd._tensors(plan[b], records, features, device)
            loss, step_accs = stream_loss(draft, taps, ids, labels, config.depths)
            accs = tfd.optimizer_step(optimizer, params, loss, accs, step_accs, bar)
            stop = max_minutes is not None and time.monotonic() - run_start > max_minutes * 60
            if time.monotonic() - last_save > 300 or b + 1 == len(plan) or stop:
                tfd.save_checkpoint(ckpt, {"streams": draft.stream_heads.state_dict(),
                                           "optimizer": optimizer.state_dict(), "done": b + 1, "plan_len": len(plan),
                                           "seconds": spent + time.monotonic() - run_start})
                last_save = time.monotonic()
            if stop and b + 1 < len(plan):
                report(f"time budget reached after batch {b + 1} of {len(plan)}: run again to go on")
                return {"finished": False, "batches": b + 1, "of": len(plan)}
    return {"finished": True, "batches": len(plan), "minutes": round((spent + time.monotonic() - run_start) / 60, 1),
            "stream_accuracy": accs}


def run(target_dir: Path, draft_dir: Path, answers: list[Path], work: Path, out: Path | None,
        config: StreamHeadsTraining = StreamHeadsTraining(), *,
        prompt_ranges: list[tuple[int, int | None]] | None = None, max_minutes: float | None = None,
        device: str | None = None, report=print) -> dict:
    """Train config.streams stream heads for the feature draft at `draft_dir`; save the draft with them at `out`
    (which may be `draft_dir`: its streams are replaced), the summary in its STREAMS_SUMMARY. Returns the summary.
    prompt_ranges: per answers file, the prompt indices [lo, hi) to read (None: all). config.continue_streams: train
    the heads the draft has further (they must have these streams, rows and width) instead of new ones; the summary
    keeps the earlier training's under "before"."""
    from transformers import AutoModelForCausalLM

    c = config
    streams, stream_vocab, stream_width = c.streams, c.stream_vocab, c.stream_width
    torch.manual_seed(c.seed)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.monotonic()
    records = tfd.load_records(answers, c.max_len, ranges=prompt_ranges)
    train_set, held = tfd.split(records)
    records = train_set + held
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device).eval()
    base = FeatureDraft.load(draft_dir, target.get_input_embeddings().weight)
    have = base.config
    if have.target_vocab_size != target.config.vocab_size or have.hidden_size != target.config.hidden_size:
        raise SystemExit(f"the feature draft at {draft_dir} was trained for another target")
    before = None
    if c.continue_streams:
        def shape(cfg) -> tuple[int, int, int]:
            return cfg.streams, cfg.stream_rows, cfg.stream_width or 2 * cfg.hidden_size

        wanted = replace(have, streams=streams, stream_vocab=stream_vocab, stream_width=stream_width)
        if shape(have) != shape(wanted):
            raise BadInputError(f"--continue-streams: the draft at {draft_dir} has streams, rows, width {shape(have)}, "
                                f"not the {shape(wanted)} asked for")
        summary_file = draft_dir / STREAMS_SUMMARY
        before = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
        draft = base.to(device)
    else:
        draft = base.with_streams(streams, stream_vocab, stream_width).to(device)
    for name, p in draft.named_parameters():
        p.requires_grad_(name.startswith("stream_heads."))
    work.mkdir(parents=True, exist_ok=True)
    taps = draft.config.taps
    features = _OrtFeatures(target, taps, records) if device == "cpu" else tfd.OnlineFeatures(target, taps)
    report(f"{len(train_set)} training records, {len(held)} held out; {streams} streams over the first "
           f"{draft.config.stream_rows} head rows, held-out answer tokens covered: "
           f"{tfd.coverage(held, draft.config.vocab_ids[: draft.config.stream_rows]):.1%}")
    result = train(draft, records, list(range(len(train_set))), features, device, work, c, max_minutes=max_minutes,
                   report=report)
    if not result["finished"]:
        return result
    draft.eval()
    metrics = evaluate(draft, records, list(range(len(train_set), len(records)))[:c.eval_records], features, device,
                       gamma=4)
    report(f"held-out ({metrics['bases']} bases, gamma 4): tokens per sd step {metrics['plain_tokens_per_step']:.2f} "
           f"one token per forward, {metrics['trust_tokens_per_step']:.2f} with the last {metrics['streams']} from the "
           f"streams ({metrics['trust_draft_tokens_per_forward']:.1f} draft tokens per forward)")
    summary = {"device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({os.cpu_count()} cores)",
               "minutes": round((time.monotonic() - t0) / 60, 1), "draft": str(draft_dir), "streams": streams,
               "stream_vocab": draft.config.stream_rows, "stream_width": stream_width or 2 * draft.config.hidden_size,
               "depths": c.depths, "lr": c.lr, "tokens_per_batch": c.tokens_per_batch, "records": len(train_set),
               "data": [{"file": str(p), "prompts": list(r)} for p, r in
                        zip(answers, tfd.file_ranges(answers, None, prompt_ranges))],
               "config": asdict(c), "train": result, "held_out": metrics}
    if before is not None:
        summary["before"] = before
    if out is not None:
        _save(draft.to("cpu"), draft_dir, out, summary)
    return summary


def _save(draft: FeatureDraft, draft_dir: Path, out: Path, summary: dict) -> None:
    """The draft with its streams at `out` (which may be `draft_dir` itself), with the summary as STREAMS_SUMMARY and
    the draft's own training.json kept; written beside it first and swapped in, so a failure leaves the old one."""
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    draft.save(partial)
    if (draft_dir / "training.json").is_file():  # the draft's own history: the streams do not change it
        shutil.copy(draft_dir / "training.json", partial / "training.json")
    (partial / STREAMS_SUMMARY).write_text(json.dumps(summary, indent=1) + "\n")
    old = out.with_name(out.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    partial.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    d = StreamHeadsTraining()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, type=Path)
    p.add_argument("--draft", required=True, type=Path, help="a trained feature draft directory (kept frozen)")
    p.add_argument("--answers", required=True, type=Path, nargs="+")
    p.add_argument("--prompt-range", type=tfd.parse_range, nargs="+", default=None,
                   help="per answers file, the prompt indices LO:HI to read")
    p.add_argument("--work", required=True, type=Path)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--streams", type=int, default=d.streams)
    p.add_argument("--stream-vocab", type=int, default=d.stream_vocab,
                   help="head rows the streams predict over (0: all)")
    p.add_argument("--stream-width", type=int, default=d.stream_width,
                   help="inner width of a stream head (0: twice the hidden)")
    p.add_argument("--depths", type=int, default=d.depths, help="draft depths whose hidden states the streams read")
    p.add_argument("--batches", type=int, default=d.batches)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--tokens-per-batch", type=int, default=d.tokens_per_batch)
    p.add_argument("--max-len", type=int, default=d.max_len)
    p.add_argument("--eval-records", type=int, default=d.eval_records)
    p.add_argument("--max-minutes", type=float, default=None)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--continue-streams", action="store_true",
                   help="train the stream heads the draft has further instead of new ones (use another --seed for "
                        "another batch order)")
    a = p.parse_args(argv)
    problem = tfd.input_error([a.target, a.draft, *a.answers], a.prompt_range, a.answers, "answers files")
    if problem is None and not FeatureDraft.is_feature_draft(a.draft):
        problem = f"{a.draft} is not a feature draft (no feature_draft.json)"
    config = None
    if problem is None:
        try:
            config = StreamHeadsTraining(
                streams=a.streams, stream_vocab=a.stream_vocab, stream_width=a.stream_width, depths=a.depths,
                batches=a.batches, lr=a.lr, tokens_per_batch=a.tokens_per_batch, max_len=a.max_len,
                eval_records=a.eval_records, seed=a.seed, continue_streams=a.continue_streams)
        except ValueError as e:
            problem = str(e)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        summary = run(a.target, a.draft, a.answers, a.work, a.out, config, prompt_ranges=a.prompt_range,
                      max_minutes=a.max_minutes)
    except BadInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if summary.get("finished", True) else 3


if __name__ == "__main__":
    sys.exit(main())
