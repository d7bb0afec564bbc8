"""Train the feature draft (models/feature_draft.py) on the target's own answers, in resumable stages.

    python -m mirror_sd.models.training.train_feature_draft --target build/models/smollm2-135m-instruct \\
        --answers models/training/data/answers-broad.jsonl.gz --work build/feature-draft --out models/weights/...

Stages, each resumable: a stopped run goes on where it stopped when run again with the same arguments.
  vocab     the draft's output vocabulary: the most frequent answer tokens of the training records; its coverage
            of the held-out records' answer tokens is reported (it caps acceptance: a token outside it is never
            proposed).
  features  the target's hidden states after each tap layer, recomputed from the token ids (the committed data is
            ids only), stored as fp16 in a memory map under --work. Only the layers up to the deepest tap run.
            On CUDA (--features online, the default there) they are recomputed batch by batch instead.
  train     training-time test: every position drafts `steps` tokens deep, fed its own hidden states as features
            after the first (models/feature_draft.py `forward_ttt`); cross-entropy on the target's answer tokens
            (its greedy choices, so hard targets are the target's argmax), later steps weighted down, Gaussian
            feature noise; bf16 autocast on CUDA. A checkpoint is written every few minutes; the run resumes from it.
            With --soft-targets K the loss also takes the target's own next-token distribution (its top K over
            the draft vocabulary, from a pass of the whole target stored beside the features), as EAGLE and
            DistillSpec distil: half hard, half soft (--soft-weight).
  eval      the go/no-go figure before any export: on held-out records, from every answer position, how many of
            gamma drafted tokens the target would accept (the chain stops at the first miss). This is what sd
            commits per target step, without the runtime's costs.

Records with index % HOLD_OUT == 0 are never trained on. Uses CUDA when torch sees a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import sys
import time
import zlib
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from mirror_sd.models.feature_draft import CONFIG_NAME, WEIGHTS_NAME, FeatureDraft, FeatureDraftConfig
from mirror_sd.models.training import answers as answers_file
from mirror_sd.outputs import staged
from mirror_sd.partitions.manifest import BOUNDARY, TAPS
from mirror_sd.partitions.spec import (
    SEQLENS,
    TOTAL_LENGTH,
    past_key_name,
    past_value_name,
)

HOLD_OUT = answers_file.HOLD_OUT  # every 20th record is held out
DEFAULT_TAPS = (5, 10, 15)
REFRESH_DROPS = ("least-used", "tail")  # which tokens a vocabulary refresh swaps out (refreshed_vocab)
FEATURE_MODES = ("auto", "stored", "online")  # run(features=...)
STEP_DECAY = 0.8  # loss weight of draft step k: STEP_DECAY ** k (later tokens matter only if earlier ones land)


@dataclass(frozen=True)
class FeatureDraftTraining:
    """How one feature-draft stage trains (`run`). What it reads (answers files, prompt ranges), where it works and
    the draft it continues are `run`'s arguments; the defaults are the command's."""

    taps: tuple[int, ...] | None = None  # target layers the draft reads; None: DEFAULT_TAPS, or the continued draft's
    vocab_size: int = 8192  # a new draft's output rows: the most frequent answer tokens (no other is ever proposed)
    max_len: int = 768  # a longer conversation keeps its last max_len tokens (the answers are at the end)
    epochs: float = 1.0  # passes over the training records; a fraction stops part-way through the last
    steps: int = 4  # training-time-test depth: each position drafts this many tokens on its own features
    lr: float = 1e-3  # peak; warm-up over 50 batches, then cosine to 5% over the plan (or the budget)
    tokens_per_batch: int = 4096  # padded tokens per batch
    noise: float = 0.05  # feature noise: past step 0 the draft reads its own hidden states, not the target's
    budget_minutes: float | None = None  # train this long in all, the schedule fitted to it (None: the whole plan)
    eval_records: int = 400  # held-out records the go/no-go figure is measured on
    seed: int = 0  # batch order and a new draft's initialisation
    refresh_vocab: int = 0  # continuing: swap N tokens for this data's N most frequent missing ones (new kinds of text)
    refresh_drop: str = "least-used"  # which tokens a refresh swaps out (REFRESH_DROPS, refreshed_vocab)
    extend_vocab: int = 0  # continuing: append this data's N most frequent missing tokens, every trained row kept
    soft_targets: int = 0  # also distil the target's own top-K draft-vocabulary rows (0: its greedy tokens only)
    soft_weight: float = 0.5  # with soft_targets: the soft loss's share
    max_loop: float | None = None  # train only on records whose loop_share is at most this (held-out ones stay all)
    # "stored": fp16 memory map under work (the CPU way); "online": recomputed per batch; "auto": online on CUDA
    features: str = "auto"

    def __post_init__(self) -> None:
        checks = [(self.features in FEATURE_MODES, f"features {self.features!r}: one of {', '.join(FEATURE_MODES)}"),
                  (self.refresh_drop in REFRESH_DROPS,
                   f"refresh_drop {self.refresh_drop!r}: one of {', '.join(REFRESH_DROPS)}"),
                  (self.refresh_vocab >= 0 and self.extend_vocab >= 0,
                   f"refresh_vocab {self.refresh_vocab} / extend_vocab {self.extend_vocab}: N >= 0"),
                  (self.soft_targets >= 0 and 0.0 <= self.soft_weight <= 1.0,
                   f"soft_targets {self.soft_targets} / soft_weight {self.soft_weight}: K >= 0, weight in [0, 1]"),
                  (self.max_loop is None or 0.0 <= self.max_loop <= 1.0,
                   f"max_loop {self.max_loop}: a share in [0, 1]"),
                  (self.epochs > 0 and self.steps >= 1 and self.tokens_per_batch >= 1,
                   f"epochs {self.epochs}, steps {self.steps}, tokens_per_batch {self.tokens_per_batch}: positive")]
        problems = [message for ok, message in checks if not ok]
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(frozen=True)
class Record:
    index: int
    ids: np.ndarray  # [T] int64
    labels: np.ndarray  # [T] bool: ids[t] is a token the target generated (an answer token)


def load_records(paths: list[Path], max_len: int, max_prompts: int | None = None,
                 ranges: list[tuple[int, int | None]] | None = None) -> list[Record]:
    """Answer records as ids and answer masks; a conversation longer than max_len keeps its last max_len tokens
    (the answers are at the end). max_prompts: only records of prompt index below it (the answers file grows across
    sessions; a committed draft names the prefix it was trained on). ranges: per file, the prompt indices [lo, hi)
    to read (hi None: to the end), instead of max_prompts."""
    ranges = file_ranges(paths, max_prompts, ranges)
    if len(ranges) != len(paths):
        raise ValueError(f"{len(ranges)} prompt ranges for {len(paths)} answers files")
    out = []
    for path, (lo, hi) in zip(paths, ranges):
        for r in answers_file.read(path):
            if int(r["index"]) < lo or (hi is not None and int(r["index"]) >= hi):
                continue
            ids = np.asarray(r["ids"], np.int64)
            labels = np.zeros(len(ids), bool)
            for start, end in r["answers"]:
                labels[start:end] = True
            if len(ids) > max_len:
                ids, labels = ids[-max_len:], labels[-max_len:]
            if labels.any():
                out.append(Record(int(r["index"]), ids, labels))
    return out


def _ngram_groups(ids: np.ndarray, n: int) -> np.ndarray:
    """One group number per n-gram (the n tokens ending at position n-1, n, ...): equal n-grams, equal numbers."""
    windows = np.lib.stride_tricks.sliding_window_view(ids, n)
    return np.unique(windows, axis=0, return_inverse=True)[1].reshape(-1)


def _first_position(groups: np.ndarray, where: np.ndarray) -> np.ndarray:
    """Per group, the first position where `where` holds (len(groups): nowhere)."""
    first = np.full(groups.max() + 1, len(groups))
    np.minimum.at(first, groups[where], np.flatnonzero(where))
    return first


def repeat_share(record: Record, n: int = 4) -> float:
    """The share of the record's answer tokens whose n-gram (the n tokens ending at it) occurs earlier in the same
    conversation, prompt included: text copied from the prompt (summaries, RAG) as well as text the answer repeats."""
    answer = record.labels[n - 1:]
    if not answer.any():
        return 0.0
    groups = _ngram_groups(record.ids, n)
    earlier = _first_position(groups, np.ones(len(groups), bool))[groups] < np.arange(len(groups))
    return float(earlier[answer].mean())


def loop_share(record: Record, n: int = 4) -> float:
    """The share of the record's answer tokens whose n-gram repeats one earlier in the answers and occurs in none of
    the conversation's other text before it: the answer going round in a loop, not copying its prompt. Loops draft
    easily, and the target's self-written turns loop more than users' prompts do (docs/training.md)."""
    answer = record.labels[n - 1:]
    if not answer.any():
        return 0.0
    groups = _ngram_groups(record.ids, n)
    pos = np.arange(len(groups))
    in_answer = _first_position(groups, answer)[groups] < pos
    elsewhere = _first_position(groups, ~answer)[groups] < pos
    return float((in_answer & ~elsewhere)[answer].mean())


def file_ranges(paths: list[Path], max_prompts: int | None,
                ranges: list[tuple[int, int | None]] | None) -> list[tuple[int, int | None]]:
    """The prompt range of each answers file: `ranges` where given, else the first max_prompts of each."""
    return ranges or [(0, max_prompts)] * len(paths)


def parse_range(text: str) -> tuple[int, int | None]:
    """"LO:HI" (either side may be empty) -> (lo, hi or None)."""
    lo, sep, hi = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: a prompt range is LO:HI (either side may be empty)")
    try:
        return int(lo or 0), int(hi) if hi else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a prompt range is LO:HI of integers") from None


def input_error(paths: list[Path], prompt_ranges: list | None, files: list[Path], noun: str) -> str | None:
    """What is wrong with a training command's inputs, or None: a path that does not exist, or --prompt-range values
    that do not pair up with the data files (`noun`: what the files are called)."""
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        return f"not found: {', '.join(missing)}"
    if prompt_ranges and len(prompt_ranges) != len(files):
        return f"{len(prompt_ranges)} --prompt-range values for {len(files)} {noun}"
    return None


def split(records: list[Record]) -> tuple[list[Record], list[Record]]:
    train = [r for r in records if r.index % HOLD_OUT != 0]
    return train, [r for r in records if r.index % HOLD_OUT == 0]


def answer_counts(train: list[Record]) -> Counter:
    """How often each token occurs among the records' answer tokens (what a draft vocabulary is ranked by)."""
    counts = Counter()
    for r in train:
        counts.update(r.ids[r.labels].tolist())
    return counts


def build_vocab(train: list[Record], size: int, always: list[int]) -> list[int]:
    counts = answer_counts(train)
    ranked = [t for t, _ in counts.most_common() if t not in set(always)]
    return list(dict.fromkeys(list(always) + ranked))[:size]


def refreshed_vocab(vocab: list[int], train: list[Record], n: int, keep: list[int],
                    drop: str = "least-used") -> list[int]:
    """`vocab` with n of its tokens, never one of `keep`, replaced by the n most frequent answer tokens of `train` it
    lacks (new data in new kinds brings new tokens: translations, code). drop "least-used": the tokens dropped are
    the ones `train`'s answers use least, the later in `vocab` first among equals (its order is most frequent first
    in the data it was built on; tokens a refresh added sit at its end, so they go only where this data does not use
    them either). drop "tail": the last n, whatever this data uses (right for a vocabulary no refresh has touched:
    its tail is its rarest tokens)."""
    if drop not in REFRESH_DROPS:
        raise ValueError(f"drop {drop!r}: one of {', '.join(REFRESH_DROPS)}")
    counts = answer_counts(train)
    have = set(vocab)
    new = [t for t, _ in counts.most_common() if t not in have][:n]
    position = {t: i for i, t in enumerate(vocab)}
    used = counts if drop == "least-used" else Counter()
    keep = set(keep)
    candidates = sorted((t for t in vocab if t not in keep), key=lambda t: (used[t], -position[t]))
    dropped = set(candidates[: len(new)])
    return [t for t in vocab if t not in dropped] + new


def extended_vocab(vocab: list[int], train: list[Record], n: int) -> list[int]:
    """`vocab` and, after it, the n most frequent answer tokens of `train` it lacks (a draft that reads a larger
    vocabulary keeps every row it had)."""
    have = set(vocab)
    return list(vocab) + [t for t, _ in answer_counts(train).most_common() if t not in have][:n]


def coverage(records: list[Record], vocab: list[int]) -> float:
    answer = np.concatenate([r.ids[r.labels] for r in records])
    return float(np.isin(answer, vocab).mean())


# -- features -----------------------------------------------------------------------------------------------------
class _MappedStore:
    """Arrays memory-mapped under a work directory and filled record by record, in a fixed order, plus a progress
    file: `done` counts the records complete. A store opened with another `key` (other data, taps, vocabulary)
    starts over."""

    arrays: tuple[np.memmap, ...] = ()

    def _open(self, meta: Path, key: dict, nbytes: dict[Path, int]) -> None:
        """Set up the progress file `meta` for `key`; where it held another key, size each file of `nbytes` afresh."""
        self.meta, self.key = meta, key
        meta.parent.mkdir(parents=True, exist_ok=True)
        old = json.loads(meta.read_text()) if meta.exists() else None
        if old is None or old["key"] != key:
            for path, size in nbytes.items():
                with path.open("wb") as f:
                    f.truncate(size)
            self._write_meta(0)

    def _write_meta(self, done: int) -> None:
        tmp = self.meta.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": self.key, "done": done}))
        os.replace(tmp, self.meta)  # the progress mark is never half-written

    @property
    def done(self) -> int:
        return json.loads(self.meta.read_text())["done"]

    def mark(self, done: int) -> None:
        for array in self.arrays:
            array.flush()
        self._write_meta(done)


class FeatureStore(_MappedStore):
    """fp16 features [tokens, taps, d] of every record in a fixed order, in one memory-mapped file."""

    def __init__(self, work: Path, records: list[Record], taps: list[int], width: int) -> None:
        self.work, self.taps, self.width = work, taps, width
        self.lengths = np.asarray([len(r.ids) for r in records], np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        tokens = int(self.offsets[-1])
        self.path = work / "features.f16"
        self._open(work / "features.json", {"records": [r.index for r in records], "taps": taps, "width": width,
                                            "tokens": tokens}, {self.path: tokens * len(taps) * width * 2})
        self.array = np.memmap(self.path, np.float16, "r+", shape=(tokens, len(taps), width))
        self.arrays = (self.array,)

    def get(self, i: int) -> np.ndarray:
        return self.array[self.offsets[i]: self.offsets[i + 1]]


class OnlineFeatures:
    """The target's tap features computed batch by batch on the training device instead of stored: on a GPU the
    target's layers up to the deepest tap cost less than reading them back, and every answers file at once would
    need tens of GB of fp16 features. Stands where a FeatureStore does in `_tensors`."""

    def __init__(self, target, taps: list[int]) -> None:
        self.taps, self.width = list(taps), target.config.hidden_size
        self.captured, self.handles = _tap_model(target, self.taps)
        self.model = target.model

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B,W] (right-padded: causal attention keeps the real positions exact) -> taps [B,W,n_taps,d]."""
        self.model(input_ids=ids, use_cache=False)
        return torch.stack([self.captured[t] for t in self.taps], 2).float()


def _tap_model(target, taps: list[int]):
    """The target's layers up to the deepest tap, with hooks that keep the residual stream after each tap."""
    captured: dict[int, torch.Tensor] = {}
    layers = target.model.layers
    handles = [layers[t - 1].register_forward_hook(
        lambda _m, _i, out, t=t: captured.__setitem__(t, out[0] if isinstance(out, tuple) else out)) for t in taps]
    target.model.layers = layers[: max(taps)]
    return captured, handles


class _OrtPrefix:
    """The target's layers [0, end) as the exported prefix graph (export/target_graphs.py, the one the runtime runs)
    on ONNX Runtime, one record at a time: on CPU faster than torch, and no padding. taps: it also outputs the
    residual stream after these layers."""

    def __init__(self, target, end: int, taps: tuple[int, ...] = (), threads: int | None = None) -> None:
        import onnxruntime as ort

        # here, not at the top: the GPU machine that runs this module's torch path has no optimum or onnx
        from mirror_sd.export.architectures import architecture_of
        from mirror_sd.export.target_graphs import build_target_graph

        arch = architecture_of(target.config)
        facts = arch.model_facts()
        proto = build_target_graph(target, arch, facts, "target_prefix", 0, end, tuple(taps))
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads or torch.get_num_threads()
        self.session = ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        self.layers = range(end)
        self.empty = np.zeros((1, facts.num_kv_heads, 0, facts.head_dim), np.float32)

    def __call__(self, ids: np.ndarray, output: str) -> np.ndarray:
        """ids [T] -> the graph's `output` for them, batch dimension dropped (TAPS: [T, n_taps, H]; BOUNDARY: the
        residual stream after layer end - 1, [T, H])."""

        t = len(ids)
        feed = {"input_ids": np.asarray(ids, np.int64)[None], SEQLENS: np.array([t - 1], np.int32),
                TOTAL_LENGTH: np.array(t, np.int32)}
        for i in self.layers:
            feed[past_key_name(i)] = feed[past_value_name(i)] = self.empty
        return self.session.run([output], feed)[0][0]


@torch.no_grad()
def extract_features(target, records: list[Record], store: FeatureStore, device: str, tokens_per_batch: int = 8192,
                     report=print) -> None:
    from tqdm import tqdm

    start = store.done
    if device == "cpu":

        prefix = _OrtPrefix(target, max(store.taps), tuple(store.taps))
        with tqdm(total=len(records), initial=start, desc="target features (onnxruntime)", unit="record") as bar:
            for i in range(start, len(records)):
                store.array[store.offsets[i]: store.offsets[i + 1]] = prefix(records[i].ids, TAPS)
                if (i + 1) % 64 == 0 or i + 1 == len(records):
                    store.mark(i + 1)
                bar.update(1)
        return
    captured, handles = _tap_model(target, store.taps)
    try:
        with tqdm(total=len(records), initial=start, desc="target features", unit="record") as bar:
            i = start
            while i < len(records):
                j = i
                while j < len(records) and (j - i + 1) * max(len(r.ids) for r in records[i: j + 1]) <= tokens_per_batch:
                    j += 1
                j = max(j, i + 1)
                batch = records[i:j]
                width = max(len(r.ids) for r in batch)
                ids = torch.zeros(len(batch), width, dtype=torch.long)
                for n, r in enumerate(batch):  # right padding: causal attention keeps real positions exact
                    ids[n, : len(r.ids)] = torch.from_numpy(r.ids)
                target.model(input_ids=ids.to(device), use_cache=False)
                feats = torch.stack([captured[t] for t in store.taps], 2).half().cpu().numpy()
                for n, r in enumerate(batch):
                    store.array[store.offsets[i + n]: store.offsets[i + n + 1]] = feats[n, : len(r.ids)]
                i = j
                store.mark(i)
                bar.update(len(batch))
    finally:
        for h in handles:
            h.remove()


class SoftTargets(_MappedStore):
    """The target's next-token distribution at every position of every record, as its top K rows of the draft
    vocabulary (int16) and their probabilities renormalised over that vocabulary (fp16), memory-mapped under `work`
    beside the features; row p is what the target predicts for ids[p + 1]. Resumable as the features are."""

    def __init__(self, work: Path, records: list[Record], vocab: list[int], k: int) -> None:
        self.k = k
        lengths = np.asarray([len(r.ids) for r in records], np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        tokens = int(self.offsets[-1])
        if len(vocab) > np.iinfo(np.int16).max:
            raise ValueError(f"soft targets store draft-vocabulary rows as int16: {len(vocab)} rows do not fit")
        rows_path, probs_path = work / "soft_rows.i16", work / "soft_probs.f16"
        self._open(work / "soft.json", {"records": [r.index for r in records], "k": k,
                                        "vocab": zlib.crc32(np.asarray(vocab, np.int64).tobytes()), "tokens": tokens},
                   {rows_path: tokens * k * 2, probs_path: tokens * k * 2})
        self.rows = np.memmap(rows_path, np.int16, "r+", shape=(tokens, k))
        self.probs = np.memmap(probs_path, np.float16, "r+", shape=(tokens, k))
        self.arrays = (self.rows, self.probs)

    def get(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.offsets[i], self.offsets[i + 1]
        return self.rows[lo:hi], self.probs[lo:hi]


def _top_rows(hidden: np.ndarray, norm_w: np.ndarray, eps: float, head: np.ndarray, k: int):
    """hidden [T,H] (the residual stream after the last layer) -> the top k rows of the head [Vd,H] after the final
    RMS norm and their softmax probabilities over all Vd rows."""
    x = hidden / np.sqrt((hidden * hidden).mean(-1, keepdims=True) + eps) * norm_w
    logits = x @ head.T
    logits -= logits.max(-1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(-1, keepdims=True)
    top = np.argpartition(-p, k - 1, axis=-1)[:, :k]
    return top, np.take_along_axis(p, top, -1)


def extract_soft_targets(target, records: list[Record], store: SoftTargets, vocab: list[int]) -> None:
    """The whole target over each record (the exported graph on ONNX Runtime's CPU EP whatever the training device,
    as the features on CPU), then its final norm and the LM head's rows of the draft vocabulary."""
    from tqdm import tqdm


    prefix = _OrtPrefix(target, len(target.model.layers))
    head = target.get_output_embeddings().weight.detach().float().numpy()[np.asarray(vocab)]
    norm_w = target.model.norm.weight.detach().float().numpy()
    eps = float(target.config.rms_norm_eps)
    start = store.done
    with tqdm(total=len(records), initial=start, desc="target soft targets (onnxruntime)", unit="record") as bar:
        for i in range(start, len(records)):
            top, p = _top_rows(prefix(records[i].ids, BOUNDARY), norm_w, eps, head, store.k)
            lo, hi = store.offsets[i], store.offsets[i + 1]
            store.rows[lo:hi], store.probs[lo:hi] = top.astype(np.int16), p.astype(np.float16)
            if (i + 1) % 64 == 0 or i + 1 == len(records):
                store.mark(i + 1)
            bar.update(1)


# -- training -----------------------------------------------------------------------------------------------------
def _batches(order: list[int], records: list[Record], tokens_per_batch: int, rng: random.Random):
    """Batches of record indices of similar length (sorted within shuffled blocks), at most tokens_per_batch
    padded tokens each."""
    order = order[:]
    rng.shuffle(order)
    out = []
    for b in range(0, len(order), 256):
        block = sorted(order[b: b + 256], key=lambda i: len(records[i].ids))
        cur: list[int] = []
        for i in block:
            if cur and (len(cur) + 1) * len(records[i].ids) > tokens_per_batch:
                out.append(cur)
                cur = []
            cur.append(i)
        if cur:
            out.append(cur)
    rng.shuffle(out)
    return out


def _tensors(batch: list[int], records: list[Record], store: FeatureStore | OnlineFeatures, device: str):
    width = max(len(records[i].ids) for i in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    labels = torch.zeros(len(batch), width, dtype=torch.bool)
    online = isinstance(store, OnlineFeatures)
    taps = None if online else torch.zeros(len(batch), width, len(store.taps), store.width)
    for n, i in enumerate(batch):
        r = records[i]
        ids[n, : len(r.ids)] = torch.from_numpy(r.ids)
        labels[n, : len(r.ids)] = torch.from_numpy(r.labels)
        if not online:
            taps[n, : len(r.ids)] = torch.from_numpy(np.asarray(store.get(i), np.float32))
    ids = ids.to(device)
    return ids, labels.to(device), store(ids) if online else taps.to(device)


def _soft_tensors(batch: list[int], records: list[Record], soft: SoftTargets, device: str):
    """The batch's soft targets: rows [B,W,K] (draft-vocabulary rows) and probabilities [B,W,K] (0 on padding)."""
    width = max(len(records[i].ids) for i in batch)
    rows = torch.zeros(len(batch), width, soft.k, dtype=torch.long)
    probs = torch.zeros(len(batch), width, soft.k)
    for n, i in enumerate(batch):
        r, p = soft.get(i)
        rows[n, : len(r)] = torch.from_numpy(np.asarray(r, np.int64))
        probs[n, : len(p)] = torch.from_numpy(np.asarray(p, np.float32))
    return rows.to(device), probs.to(device)


def ttt_loss(draft: FeatureDraft, taps, ids, labels, steps: int, noise: float, soft=None, soft_weight: float = 0.5):
    """Weighted CE over the draft steps and per-step accuracy; the head runs only where there is a label. soft:
    (rows, probs) [B,T,K] of `_soft_tensors`; the loss is then (1 - soft_weight) x the hard CE + soft_weight x the
    cross-entropy against the target's top-K distribution (renormalised over its K rows)."""
    hs = draft.forward_ttt(taps, ids, steps, noise=noise)
    target_rows = draft.id_map[ids[:, 2:]]  # position t predicts ids[t + 2]
    if soft is not None:  # row p of the soft targets predicts ids[p + 1]: position t's is row t + 1
        soft_rows, soft_probs = soft[0][:, 1:-1], soft[1][:, 1:-1]
    total, weight, accs = 0.0, 0.0, []
    for k, h in enumerate(hs):
        valid = labels[:, 2:].clone()
        valid[:, :k] = False  # no base before position 0
        rows = target_rows[valid]
        logits = draft.logits(h[:, :-1][valid])
        # a token outside the draft vocabulary (-100) cannot be proposed: it costs nothing and is a miss
        ce = torch.nn.functional.cross_entropy(logits, rows, ignore_index=-100)
        if soft is not None:
            q = soft_probs[valid]
            q = q / q.sum(-1, keepdim=True).clamp_min(1e-6)
            soft_ce = -(q * logits.log_softmax(-1).gather(-1, soft_rows[valid])).sum(-1).mean()
            ce = (1 - soft_weight) * ce + soft_weight * soft_ce
        total = total + STEP_DECAY ** k * ce
        weight += STEP_DECAY ** k
        accs.append(float((logits.argmax(-1) == rows).float().mean()) if len(rows) else 0.0)
    return total / weight, accs


def optimizer_step(optimizer, params, loss: torch.Tensor, accs_avg: list[float], accs: list[float], bar
                   ) -> list[float]:
    """One step on `loss` (gradients clipped to 0.5); returns the running accuracies with this batch's `accs` in,
    shown with the loss on the progress bar."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 0.5)
    optimizer.step()
    accs_avg = accs if not accs_avg else [0.98 * a + 0.02 * x for a, x in zip(accs_avg, accs)]
    bar.set_postfix(loss=f"{loss.item():.3f}", acc="/".join(f"{a:.2f}" for a in accs_avg))
    bar.update(1)
    return accs_avg


def save_checkpoint(path: Path, state: dict) -> None:
    """torch.save, written beside `path` and moved over it: a run stopped mid-write keeps the checkpoint before."""
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def train(draft: FeatureDraft, records: list[Record], order: list[int], store: FeatureStore | OnlineFeatures,
          work: Path, config: FeatureDraftTraining, *, device: str, max_minutes: float | None = None,
          soft: SoftTargets | None = None, report=print) -> dict:
    """The training records `order` in config.epochs passes. max_minutes: stop after this long, resumably (a run
    spread over sessions). config.budget_minutes: the whole training's length: the learning-rate schedule runs over
    whichever ends first, the plan or this budget (time spent before a resume counts), and training ends there."""
    from tqdm import tqdm

    epochs, lr, budget_minutes = config.epochs, config.lr, config.budget_minutes
    rng = random.Random(config.seed)
    passes = [_batches(order, records, config.tokens_per_batch, rng) for _ in range(max(1, math.ceil(epochs)))]
    plan = [b for p in passes for b in p][: max(1, round(epochs * len(passes[0])))]  # a fractional last pass
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    ckpt = work / "checkpoint.pt"
    done, spent = 0, 0.0
    if ckpt.exists():
        state = torch.load(ckpt, map_location=device)
        if state["plan_len"] == len(plan):
            draft.load_state_dict(state["model"], strict=False)
            optimizer.load_state_dict(state["optimizer"])
            done, spent = state["done"], state.get("seconds", 0.0)
            report(f"resuming training at batch {done} of {len(plan)}")
    draft.train()
    # on a GPU the draft trains in bf16 autocast (fp32 weights and optimizer); on CPU in fp32, as it always did
    autocast = torch.autocast("cuda", torch.bfloat16) if device == "cuda" else contextlib.nullcontext()
    run_start = last_save = time.monotonic()
    start = run_start - spent  # the training's start, counting the time spent before a resume
    budget = budget_minutes * 60 if budget_minutes else math.inf
    accs_avg: list[float] = []
    b = done
    with tqdm(total=len(plan), initial=done, desc="training feature draft", unit="batch") as bar:
        for b in range(done, len(plan)):
            progress = max(b / len(plan), (time.monotonic() - start) / budget)
            if progress >= 1.0:
                report(f"training budget of {budget_minutes} minutes spent after {b} of {len(plan)} batches")
                break
            for group in optimizer.param_groups:  # warm-up, then cosine to 5% over the plan (or the budget)
                group["lr"] = lr * min(1.0, (b + 1) / 50) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))
            ids, labels, taps = _tensors(plan[b], records, store, device)
            soft_batch = _soft_tensors(plan[b], records, soft, device) if soft is not None else None
            with autocast:
                loss, accs = ttt_loss(draft, taps, ids, labels, config.steps, config.noise, soft_batch,
                                      config.soft_weight)
            accs_avg = optimizer_step(optimizer, params, loss, accs_avg, accs, bar)
            stop = max_minutes is not None and time.monotonic() - run_start > max_minutes * 60
            if time.monotonic() - last_save > 300 or b + 1 == len(plan) or stop:
                save_checkpoint(ckpt, {"model": {k: v for k, v in draft.state_dict().items() if k != "embed.weight"},
                                       "optimizer": optimizer.state_dict(), "done": b + 1, "plan_len": len(plan),
                                       "seconds": time.monotonic() - start})
                last_save = time.monotonic()
            if stop:
                report(f"time budget reached after batch {b + 1} of {len(plan)}: run again to go on")
                return {"finished": False, "batches": b + 1, "of": len(plan)}
        else:
            b = len(plan)
    draft.eval()
    return {"finished": True, "batches": b, "of": len(plan), "minutes": round((time.monotonic() - start) / 60, 1),
            "train_step_accuracy": accs_avg}


def draft_right(draft: FeatureDraft, hs: list[torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """[len(hs), T] bool, indexed by base b: whether the token drafted k places after base b is the text's. Base b
    drafts ids[b + 2 ..]; forward_ttt's step k row for base b is position b + k (ids [1, T], hs its steps)."""
    t = ids.shape[1]
    right = torch.zeros(len(hs), t, dtype=torch.bool, device=ids.device)
    for k, h in enumerate(hs):
        pred = draft.vocab_ids[draft.logits(h[0, :-1]).argmax(-1)]  # [T-2]: position p predicts ids[p + 2]
        n = t - 2 - k
        if n > 0:
            right[k, :n] = pred[k: k + n] == ids[0, 2 + k: 2 + k + n]  # indexed by base b = p - k
    return right


def window_bases(labels: torch.Tensor, gamma: int) -> torch.Tensor:
    """[T] bool: the bases whose next gamma tokens (ids[b + 2 .. b + 1 + gamma]) are all answer tokens (labels [T])."""
    t = labels.shape[0]
    span = t - 1 - gamma
    valid = torch.zeros(t, dtype=torch.bool, device=labels.device)
    if span > 0:
        valid[:span] = torch.stack([labels[2 + k: 2 + k + span] for k in range(gamma)]).all(0)
    return valid


@torch.no_grad()
def evaluate(draft: FeatureDraft, records: list[Record], store: FeatureStore | OnlineFeatures, indices: list[int],
             gamma: int, device: str) -> dict:
    """From every answer position whose next gamma tokens are all answer tokens: the number of leading drafted
    tokens equal to the target's (the draft fed its own features and, while it is right, the right tokens: the
    training-time-test form equals the sequential rollout, tests/test_feature_draft.py). Returns the mean accepted
    tokens per target step (1 + accepted: the target's own token always lands) and the per-token acceptance
    alpha_k = P(token k right | tokens before it right)."""
    draft.eval()
    accepted, tried = np.zeros(gamma + 1), np.zeros(gamma)
    bases = walked_steps = walked_tokens = 0
    for i in indices:
        ids, labels, taps = _tensors([i], records, store, device)
        if ids.shape[1] - 1 - gamma <= 0:
            continue
        right = draft_right(draft, draft.forward_ttt(taps, ids, gamma), ids)  # [gamma, T]
        valid = window_bases(labels[0], gamma)
        lead = torch.cumprod(right.int(), 0)  # [gamma, T]: 1 while every step so far is right
        for k in range(gamma):
            tried[k] += int((valid & (lead[k - 1].bool() if k else valid)).sum())
            accepted[k] += int((valid & lead[k].bool()).sum())
        bases += int(valid.sum())
        steps, tokens = _walk(valid.tolist(), lead.sum(0).tolist())
        walked_steps += steps
        walked_tokens += tokens
    alpha = [float(accepted[k] / max(1, tried[k])) for k in range(gamma)]
    mean_accepted = float(accepted[:gamma].sum() / max(1, bases))
    return {"bases": bases, "gamma": gamma, "tokens_per_step": 1.0 + mean_accepted,
            "acceptance": mean_accepted / gamma, "alpha_per_step": alpha,
            "alpha_first": alpha[0], "alpha_mean": float(np.mean(alpha)),
            "walked_tokens_per_step": walked_tokens / max(1, walked_steps), "walked_steps": walked_steps}


def _walk(valid: list[bool], accepted: list[int]) -> tuple[int, int]:
    """The steps sd takes through one answer: from a base, the target commits the accepted drafted tokens and its
    own, and the next step starts after them. Returns (steps, tokens) over the valid bases it lands on. The mean over
    every base (`tokens_per_step`) weights an easy stretch by its length although sd crosses it in few steps; this
    walk is what sd measures at run time (full windows, no gate)."""
    steps = tokens = b = 0
    while b < len(valid):
        if valid[b]:
            steps += 1
            tokens += 1 + accepted[b]
            b += 1 + accepted[b]
        else:
            b += 1
    return steps, tokens


def run(target_dir: Path, answers: list[Path], work: Path, out: Path | None,
        config: FeatureDraftTraining = FeatureDraftTraining(), *,
        prompt_ranges: list[tuple[int, int | None]] | None = None, init_from: Path | None = None,
        max_minutes: float | None = None, device: str | None = None, report=print) -> dict:
    """All stages; returns the summary (also written as training.json beside the weights at `out`). prompt_ranges:
    per answers file, the prompt indices [lo, hi) to read (None: all). init_from: go on training a saved feature
    draft (its vocabulary is kept, and its taps unless config.taps names others; use a fresh `work` for its
    checkpoints, or remove the one a stage before left there). max_minutes: stop after this long, resumably. device:
    "cuda" where torch sees a GPU, else "cpu", unless named."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    c = config
    torch.manual_seed(c.seed)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    online = c.features == "online" or (c.features == "auto" and device == "cuda")
    if device == "cuda":  # the target's features in TF32, near its fp32 (the stored ones are fp16)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    t0 = time.monotonic()
    records = load_records(answers, c.max_len, ranges=prompt_ranges)
    train_set, held = split(records)
    dropped = 0
    if c.max_loop is not None:
        kept = [r for r in train_set if loop_share(r) <= c.max_loop]
        dropped = len(train_set) - len(kept)
        report(f"{dropped} of {len(train_set)} training records loop on more than {c.max_loop:.0%} of their answer "
               "tokens: left out")
        train_set = kept
    records = train_set + held  # one order for the feature store: training records first
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device).eval()
    special = sorted({i for i in (tokenizer.convert_tokens_to_ids(t) for t in tokenizer.all_special_tokens)
                      if i is not None})
    vocab_path = work / "vocab.json"
    work.mkdir(parents=True, exist_ok=True)
    start_from = None
    if init_from is not None:
        start_from = FeatureDraft.load(init_from, target.get_input_embeddings().weight)
        vocab, trained_on = list(start_from.config.vocab_ids), list(start_from.config.taps)
        taps = list(c.taps or trained_on)
        if taps != trained_on:
            # other layers, as many: the same weights read them (the tap norms and the fuse layer relearn them), so
            # a draft for a deeper exit layer starts from the one trained for a shallower
            if len(taps) != len(trained_on):
                raise SystemExit(f"--taps {taps}: the draft continued from reads {len(trained_on)} taps")
            start_from.config.taps = taps
            report(f"continuing from {init_from} on taps {taps} (it was trained on {trained_on})")
        if c.refresh_vocab:
            before = coverage(held, vocab)
            vocab = refreshed_vocab(vocab, train_set, c.refresh_vocab, special, c.refresh_drop)
            start_from = start_from.with_vocab(vocab, target.get_output_embeddings().weight)
            report(f"vocabulary refreshed: {c.refresh_vocab} tokens swapped; held-out answer tokens covered "
                   f"{before:.1%} -> {coverage(held, vocab):.1%}")
        if c.extend_vocab:
            before = coverage(held, vocab)
            vocab = extended_vocab(vocab, train_set, c.extend_vocab)
            start_from = start_from.with_vocab(vocab, target.get_output_embeddings().weight)
            report(f"vocabulary extended to {len(vocab)} tokens; held-out answer tokens covered "
                   f"{before:.1%} -> {coverage(held, vocab):.1%}")
        # the size it holds (an extended vocabulary is larger than vocab_size): a fresh run in this work
        # directory reuses the file only when that is the size it asks for
        vocab_path.write_text(json.dumps({"size": len(vocab), "ids": vocab}))
    else:
        if c.refresh_vocab or c.extend_vocab:
            raise SystemExit("--refresh-vocab and --extend-vocab change a trained draft's vocabulary: they need "
                             "--init-from")
        taps = list(c.taps or DEFAULT_TAPS)
        if vocab_path.exists() and json.loads(vocab_path.read_text())["size"] == c.vocab_size:
            vocab = json.loads(vocab_path.read_text())["ids"]
        else:
            vocab = build_vocab(train_set, c.vocab_size, special)
            vocab_path.write_text(json.dumps({"size": c.vocab_size, "ids": vocab}))
    if max(taps) > len(target.model.layers):
        raise SystemExit(f"tap {max(taps)} is deeper than the target's {len(target.model.layers)} layers")
    cover = {n: coverage(held, vocab[:n]) for n in sorted({2048, 4096, 8192, 16384, len(vocab)}) if n <= len(vocab)}
    answer_tokens = int(sum(r.labels.sum() for r in train_set))
    report(f"{len(train_set)} training records ({answer_tokens} answer tokens, "
           f"{sum(len(r.ids) for r in train_set)} in all), {len(held)} held out; held-out answer tokens covered "
           "by the top-N vocabulary: " + ", ".join(f"{n}: {v:.1%}" for n, v in cover.items()))

    if not online:
        store = FeatureStore(work, records, taps, target.config.hidden_size)
        if store.done < len(records):
            extract_features(target, records, store, device, report=report)
    if c.soft_targets > len(vocab):
        raise SystemExit(f"--soft-targets {c.soft_targets}: more than the draft vocabulary's {len(vocab)} rows")
    soft = SoftTargets(work, records, vocab, c.soft_targets) if c.soft_targets else None
    if soft is not None and soft.done < len(records):
        extract_soft_targets(target, records, soft, vocab)
    if online:  # after the soft targets: it cuts the target to its layers up to the deepest tap
        store = OnlineFeatures(target, taps)
    if start_from is not None:
        draft = start_from.train()
    else:
        draft = FeatureDraft(FeatureDraftConfig.for_target(target.config, vocab, taps))
        draft.init_from_target(target)
    draft.to(device)
    del target  # online features keep only the layers up to the deepest tap (OnlineFeatures)
    result = train(draft, records, list(range(len(train_set))), store, work, c, device=device,
                   max_minutes=max_minutes, soft=soft, report=report)
    if not result["finished"]:
        return result
    held_idx = list(range(len(train_set), len(records)))[:c.eval_records]
    metrics = evaluate(draft, records, store, held_idx, gamma=4, device=device)
    report(f"held-out ({metrics['bases']} bases, gamma 4): {metrics['tokens_per_step']:.2f} tokens per target step "
           f"from every base, {metrics['walked_tokens_per_step']:.2f} walked as sd steps, per-token acceptance "
           + "/".join(f"{a:.2f}" for a in metrics["alpha_per_step"]))
    summary = {"device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({os.cpu_count()} cores)",
               "minutes": round((time.monotonic() - t0) / 60, 1), "records": len(train_set),
               "answer_tokens": answer_tokens, "held_out_records": len(held), "vocab_size": len(vocab),
               "vocab_coverage_held_out": cover, "taps": taps, "epochs": c.epochs, "steps": c.steps, "lr": c.lr,
               "noise": c.noise, "continued_from": str(init_from) if init_from else None,
               "data": [{"file": str(path), "prompts": list(rng)} for path, rng in
                        zip(answers, file_ranges(answers, None, prompt_ranges))],
               "vocab_refreshed": c.refresh_vocab, "vocab_refresh_drop": c.refresh_drop if c.refresh_vocab else None,
               "soft_targets": c.soft_targets, "soft_weight": c.soft_weight if c.soft_targets else None,
               "vocab_extended": c.extend_vocab,
               "features": "online (recomputed per batch)" if online else "stored fp16",
               "tokens_per_batch": c.tokens_per_batch,
               "max_loop": c.max_loop, "records_left_out_as_looping": dropped,
               "config": asdict(c),
               "train": result,
               "held_out": metrics}
    if out is not None:
        draft.to("cpu").save(out)
        (out / "training.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def average_drafts(drafts: list[Path], out: Path, weights: list[float]) -> Path:
    """A saved feature draft whose every tensor is the weighted mean of the same tensor of `drafts` (saved drafts of
    one config: the same taps and vocabulary, as a stage continued without a vocabulary refresh leaves them). A stage
    that gains on its own data and loses elsewhere can keep most of the gain and little of the loss halfway between
    its start and its end (weight averaging, as WiSE-FT does)."""
    from safetensors.torch import load_file, save_file

    if len(drafts) != len(weights) or not drafts or abs(sum(weights) - 1.0) > 1e-6:
        raise ValueError(f"{len(drafts)} drafts and weights {weights}: one weight per draft, summing to 1")
    configs = [json.loads((Path(d) / CONFIG_NAME).read_text()) for d in drafts]
    if any(c != configs[0] for c in configs[1:]):
        raise ValueError("drafts of different configs (taps, vocabulary or shapes) cannot be averaged")
    states = [load_file(str(Path(d) / WEIGHTS_NAME)) for d in drafts]
    mean = {k: sum(w * st[k].float() for w, st in zip(weights, states)).to(states[0][k].dtype).contiguous()
            for k in states[0]}
    with staged(Path(out)) as staging:  # `out` may be one of `drafts`: it is replaced only at the end
        save_file(mean, str(staging / WEIGHTS_NAME))
        (staging / CONFIG_NAME).write_text(json.dumps(configs[0]) + "\n")
    return Path(out)


def compare(target_dir: Path, drafts: list[Path], answers: list[Path], work: Path, *, max_len: int,
            eval_records: int, prompt_ranges: list[tuple[int, int | None]] | None = None,
            max_prompts: int | None = None, report=print) -> dict:
    """Saved drafts side by side on the same held-out records, per answers file (the first `eval_records` of each):
    the offline figure of `evaluate`, for an A/B of two trainings. Features of the held-out records only."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ranges = file_ranges(answers, max_prompts, prompt_ranges)
    held_by_file = [split(load_records([path], max_len, ranges=[rng]))[1][:eval_records]
                    for path, rng in zip(answers, ranges)]
    held = [r for part in held_by_file for r in part]
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device).eval()
    embedding = target.get_input_embeddings().weight
    loaded = [FeatureDraft.load(d, embedding).to(device) for d in drafts]
    taps = sorted({tuple(d.config.taps) for d in loaded})
    if len(taps) != 1:
        raise SystemExit(f"the drafts read different taps {taps}: compare drafts of one tap set")
    store = FeatureStore(work, held, list(taps[0]), target.config.hidden_size)
    if store.done < len(held):
        extract_features(target, held, store, device, report=report)
    del target
    out, first = {}, 0
    for path, part in zip(answers, held_by_file):
        idx = list(range(first, first + len(part)))
        first += len(part)
        out[str(path)] = {str(d): evaluate(m, held, store, idx, gamma=4, device=device) for d, m in zip(drafts, loaded)}
        for d in drafts:
            m = out[str(path)][str(d)]
            report(f"{path.name} ({len(part)} held-out records, {m['bases']} bases) {d}: "
                   f"{m['tokens_per_step']:.3f} tokens per step ({m['walked_tokens_per_step']:.3f} walked), alpha "
                   + "/".join(f"{a:.2f}" for a in m["alpha_per_step"]))
    return {"device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({os.cpu_count()} cores)",
            "gamma": 4, "held_out_records_per_file": eval_records, "by_file": out}


def main(argv: list[str] | None = None) -> int:
    d = FeatureDraftTraining()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, required=True, help="the target (transformers directory)")
    parser.add_argument("--answers", type=Path, nargs="+", required=True,
                        help="answers files (models/training/answers.py)")
    parser.add_argument("--work", type=Path, default=Path("build/feature-draft"), help="features and checkpoints")
    parser.add_argument("--out", type=Path, default=None, help="save the trained draft here")
    parser.add_argument("--taps", type=int, nargs="+", default=None,
                        help=f"target layers the draft reads (default {list(DEFAULT_TAPS)}, or --init-from's)")
    parser.add_argument("--vocab-size", type=int, default=d.vocab_size)
    parser.add_argument("--max-len", type=int, default=d.max_len)
    parser.add_argument("--epochs", type=float, default=d.epochs)
    parser.add_argument("--steps", type=int, default=d.steps, help="training-time-test depth (drafted tokens)")
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--tokens-per-batch", type=int, default=d.tokens_per_batch)
    parser.add_argument("--noise", type=float, default=d.noise)
    parser.add_argument("--max-minutes", type=float, default=None, help="stop (resumably) after this long")
    parser.add_argument("--budget-minutes", type=float, default=d.budget_minutes,
                        help="train this long in all (the schedule fits it), then save and evaluate")
    parser.add_argument("--eval-records", type=int, default=d.eval_records)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--init-from", type=Path, default=None, help="go on training this saved feature draft")
    parser.add_argument("--max-prompts", type=int, default=None,
                        help="train on the records of the first N prompts only (default: all)")
    parser.add_argument("--prompt-range", type=parse_range, nargs="+", default=None, metavar="LO:HI",
                        help="per answers file, the prompt indices to train on (instead of --max-prompts)")
    parser.add_argument("--refresh-vocab", type=int, default=d.refresh_vocab, metavar="N",
                        help="with --init-from: the N most frequent answer tokens of this data that the draft's "
                             "vocabulary lacks replace N of its tokens (head rows from the target's LM head)")
    parser.add_argument("--refresh-drop", choices=REFRESH_DROPS, default=d.refresh_drop,
                        help="which tokens --refresh-vocab swaps out: the ones this data uses least, or the last N")
    parser.add_argument("--soft-targets", type=int, default=d.soft_targets, metavar="K",
                        help="also distil the target's own next-token distribution, its top K draft-vocabulary "
                             "rows (a pass of the whole target; 0: hard targets only)")
    parser.add_argument("--soft-weight", type=float, default=d.soft_weight,
                        help="with --soft-targets: the soft loss's share (the hard loss gets the rest)")
    parser.add_argument("--extend-vocab", type=int, default=d.extend_vocab, metavar="N",
                        help="with --init-from: append the N most frequent answer tokens of this data that the "
                             "draft's vocabulary lacks (head rows from the target's LM head)")
    parser.add_argument("--features", choices=FEATURE_MODES, default=d.features,
                        help="the target's features stored under --work (CPU) or recomputed per batch (auto: on CUDA)")
    parser.add_argument("--max-loop", type=float, default=d.max_loop, metavar="SHARE",
                        help="train only on records where at most this share of the answer tokens repeats a 4-gram "
                             "of the answers before it that the rest of the conversation lacks (loop_share; the "
                             "held-out records stay all)")
    parser.add_argument("--compare", type=Path, nargs="+", default=None, metavar="DRAFT",
                        help="train nothing: evaluate these saved drafts on the same held-out records of each "
                             "answers file (--eval-records per file) and write the figures to --compare-out")
    parser.add_argument("--compare-out", type=Path, default=None, help="JSON file for --compare")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    error = input_error([args.target, *args.answers, *(args.compare or [])], args.prompt_range, args.answers,
                        "answers files")
    config = None
    if not error:
        try:
            config = FeatureDraftTraining(
                taps=tuple(args.taps) if args.taps else None, vocab_size=args.vocab_size, max_len=args.max_len,
                epochs=args.epochs, steps=args.steps, lr=args.lr, tokens_per_batch=args.tokens_per_batch,
                noise=args.noise, budget_minutes=args.budget_minutes, eval_records=args.eval_records,
                seed=args.seed, refresh_vocab=args.refresh_vocab, refresh_drop=args.refresh_drop,
                extend_vocab=args.extend_vocab, soft_targets=args.soft_targets, soft_weight=args.soft_weight,
                max_loop=args.max_loop, features=args.features)
        except ValueError as e:
            error = str(e)
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    ranges = args.prompt_range or file_ranges(args.answers, args.max_prompts, None)
    if args.compare:
        result = compare(args.target, args.compare, args.answers, args.work, max_len=args.max_len,
                         eval_records=args.eval_records, prompt_ranges=ranges)
        if args.compare_out:
            args.compare_out.parent.mkdir(parents=True, exist_ok=True)
            args.compare_out.write_text(json.dumps(result, indent=1) + "\n")
        return 0
    run(args.target, args.answers, args.work, args.out, config, prompt_ranges=ranges, init_from=args.init_from,
        max_minutes=args.max_minutes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
