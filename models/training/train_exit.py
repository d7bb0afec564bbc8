"""Train the early-exit adapter (models/exit_adapter.py) by distillation from the target's final distribution.

One teacher pass runs the target over the target's own answers (models/training/datagen.py) and keeps, for every answer
position, the hidden state after each candidate exit layer and the final distribution's top-32. An adapter per
exit layer then learns to map the layer-l_e state to that distribution (soft cross-entropy on the teacher's
top-32, renormalised). Coverage — how often the target's final greedy token is in the exit head's top-1 / top-k
— is measured on held-out conversations for the adapter and for the untrained logit lens side by side.

Mirror's branches need the exit head only where the draft is rejected: at the first slot of a window whose draft
token the target does not take, the branch that wins is the one on the target's token there. Those slots are the
hard ones: the exit head holds the target's token there far less often than over all answer positions
(docs/training.md). With a feature draft given (`--hard-draft`), the teacher pass also runs that draft
over each conversation as training runs it (every position, its own features for up to gamma steps deep) and keeps,
per position, the share of those depths at which the draft's token is not the target's; `--hard-weight W` then
samples training positions in proportion to 1 + W x that share, and coverage is reported on the positions the draft
misses as well.

Where torch sees a GPU the teacher pass, the steps and the coverage run there (the teacher's tensors come back to
the CPU between them, so a cache written on one device reads on the other); `--device cpu` keeps them here.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mirror_sd.export.segments import LogitLens
from mirror_sd.models.exit_adapter import ExitAdapter, ExitAdapterConfig
from mirror_sd.models.feature_draft import FeatureDraft
from mirror_sd.models.training import answers
from mirror_sd.models.training.train_draft import ANSWER_WEIGHT, PROMPT_WEIGHT, Example, conversation_examples
from mirror_sd.models.training.train_feature_draft import file_ranges, input_error, parse_range

TEACHER_TOP = 32
HARD_DEPTHS = 4  # the draft depths whose misses mark a position as hard: gamma 4's window slots


@dataclass(frozen=True)
class ExitAdapterTraining:
    """How the exit adapters train (`train`). The data files and their prompt ranges, the adapter continued and the
    draft whose misses are weighed are `train`'s arguments; the defaults are the command's."""

    layers: tuple[int, ...] = (15, 20, 24)  # one adapter per exit layer (a continued adapter: its one layer)
    conversations: int = 300  # training conversations per data file: a small pool is not drowned by a large one
    skip: int = 0  # past the held-out ones, leave this many out first (a continued stage reads new ones)
    held_out: int = 300  # held-out conversations per file measured on (at most the 300 the split sets apart)
    rank: int = 512  # a new adapter's low-rank width (a continued one keeps its own)
    steps: int = 400
    batch: int = 256  # positions per step
    lr: float = 2e-3  # peak; warm-up over 20 steps, then linear to 0
    minutes_per_layer: float = 5.0  # training stops here even before `steps`
    hard_weight: float = 0.0  # draw the positions the hard draft misses up to 1 + W times as often (needs one)
    top_k: int = 8  # the widest top-k whose coverage is reported (the bundles' top_k)
    seed: int = 0  # the split, the conversations drawn and the positions drawn

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("layers: give at least one exit layer")
        if self.hard_weight < 0:
            raise ValueError(f"hard_weight {self.hard_weight}: give a weight >= 0")
        if self.batch < 1 or self.steps < 1:
            raise ValueError(f"batch {self.batch} / steps {self.steps}: at least 1")


@dataclass
class TeacherData:
    hidden: dict[int, torch.Tensor]  # exit layer -> [N, H] hidden states at answer positions
    top_ids: torch.Tensor  # [N, 32] the final distribution's most probable ids
    top_logprobs: torch.Tensor  # [N, 32]
    # [N] share of the draft depths 0..HARD_DEPTHS-1 at which the draft misses the position's final token (a
    # draft given to the teacher pass), else None; first_miss [N] bool: the draft misses it at depth 0
    miss_share: torch.Tensor | None = None
    first_miss: torch.Tensor | None = None


def _malloc_trim():
    """glibc's malloc_trim: returns freed heap memory to the system. A forward per conversation frees buffers of a
    new size each time; without it the heap only grows, to tens of GiB over a few thousand conversations."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        return lambda: libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        return lambda: None


def draft_misses(draft, hidden_states, ids: torch.Tensor, final: torch.Tensor,
                 where: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """For every position t < T-1 of one conversation (ids [T]; the target's hidden states, a tuple by layer, each
    [1,T,d]; final [T-1] the target's greedy token after each position): the share of depths k < HARD_DEPTHS at
    which the feature draft's token for position t+1 is not final[t], and whether it misses at depth 0.

    The draft's position t-1 predicts token t+1 (it reads the features of t-1 and token t); at depth k it is the
    k-th token drafted from base t-1-k with the k tokens before it the text's own (models/feature_draft.py
    forward_ttt), which exists only where t-1-k >= 0: sd reaches window slot k only when the draft's k tokens
    before it were accepted, that is, were the text's. where [T-1] bool: the positions wanted (the others are
    left 0 and not compared: the draft's head runs on the wanted rows only)."""
    t = ids.shape[0]
    taps = torch.stack([hidden_states[tap][0] for tap in draft.config.taps], 1)[None]  # [1,T,n,d]
    outs = draft.forward_ttt(taps, ids[None], HARD_DEPTHS)
    misses = torch.zeros(t - 1, device=ids.device)
    counted = torch.zeros(t - 1, device=ids.device)
    first = torch.zeros(t - 1, dtype=torch.bool, device=ids.device)
    for k, h in enumerate(outs):
        # exit positions t whose draft position t-1 has a base at depth k
        pos = torch.arange(k + 1, t - 1, device=ids.device)
        if where is not None:
            pos = pos[where[pos]]
        guess = draft.vocab_ids[draft.logits(h[0, pos - 1]).argmax(-1)]  # draft position t-1's guess for t+1
        miss = (guess != final[pos]).float()
        misses[pos] += miss
        counted[pos] += 1
        if k == 0:
            first[pos] = miss.bool()
    return misses / counted.clamp(min=1), first


@torch.no_grad()
def teacher_pass(model, examples, layers: list[int], draft=None, report=print) -> TeacherData:
    """draft: a feature draft whose misses to record per position (TeacherData.miss_share, first_miss). Runs on
    the model's device; what it keeps is on the CPU (a large pass would not fit beside the model on a small GPU)."""
    from tqdm import tqdm

    hidden: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
    ids, lps, shares, firsts = [], [], [], []
    trim = _malloc_trim()
    device = model.lm_head.weight.device
    for n, ex in enumerate(tqdm(examples, desc="teacher pass", unit="conversation")):
        if n % 25 == 24:
            trim()
        ex_ids = torch.from_numpy(ex.ids).to(device)
        out = model.model(ex_ids[None], output_hidden_states=True)
        # position t predicts token t+1: keep the positions whose next token is part of the answer
        keep = torch.from_numpy(ex.weights[1:] == ANSWER_WEIGHT).to(device)
        for layer in layers:
            hidden[layer].append(out.hidden_states[layer][0, :-1][keep].cpu())
        # the LM head on the kept rows only: no [T, 49,152] logits for the prompt's positions
        top = torch.log_softmax(model.lm_head(out.last_hidden_state[0, :-1][keep]), -1).topk(TEACHER_TOP, -1)
        ids.append(top.indices.cpu())
        lps.append(top.values.cpu())
        if draft is not None:  # the final token is wanted at the kept rows only: the teacher's top-1 there
            final = torch.full((len(keep),), -1, dtype=torch.long, device=device)
            final[keep] = top.indices[:, 0]
            share, first = draft_misses(draft, out.hidden_states, ex_ids, final, keep)
            shares.append(share[keep].cpu())
            firsts.append(first[keep].cpu())
    data = TeacherData({k: torch.cat(v) for k, v in hidden.items()}, torch.cat(ids), torch.cat(lps))
    if draft is not None:
        data.miss_share, data.first_miss = torch.cat(shares), torch.cat(firsts)
    return data


def answer_examples(path: Path, max_prompts: int | None = None, min_prompt: int = 0) -> list[Example]:
    """Examples from an answers file (models/training/answers.py: the committed token ids of the target's own answers,
    chat template applied); the answer spans get ANSWER_WEIGHT. Only records of prompt index in [min_prompt,
    max_prompts)."""
    import numpy as np


    out = []
    for r in answers.read(path):
        if int(r["index"]) < min_prompt or (max_prompts is not None and int(r["index"]) >= max_prompts):
            continue
        weights = np.full(len(r["ids"]), PROMPT_WEIGHT, np.float32)
        for start, end in r["answers"]:
            weights[start:end] = ANSWER_WEIGHT
        out.append(Example(np.asarray(r["ids"], np.int64), weights))
    return out


def _examples(data_file: Path, tokenizer, max_prompts: int | None = None, min_prompt: int = 0) -> list[Example]:
    """An answers file (*.jsonl.gz, token ids) or a datagen file (*.jsonl, chat messages)."""
    if data_file.name.endswith(".jsonl.gz"):
        return answer_examples(data_file, max_prompts, min_prompt)
    return conversation_examples(data_file, tokenizer)


def _fingerprint(directory: Path) -> str:
    """sha256 of a saved model's files: the teacher cache is kept only for the same draft."""
    import hashlib

    digest = hashlib.sha256()
    for f in sorted(Path(directory).iterdir()):
        if f.is_file():
            digest.update(f.name.encode() + f.read_bytes())
    return digest.hexdigest()


def _pack(data: TeacherData) -> dict:
    return {"hidden": data.hidden, "top_ids": data.top_ids, "top_logprobs": data.top_logprobs,
            "miss_share": data.miss_share, "first_miss": data.first_miss}


def _save_teacher(cache: Path | None, key: dict, train_data: TeacherData, tests: dict[str, TeacherData]) -> None:
    """The teacher passes and the inputs they were made from; written under a temporary name, then renamed, so
    an interrupted write leaves no cache behind that looks whole."""
    if cache is None:
        return
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / "teacher.pt.partial"
    torch.save({"key": key, "train": _pack(train_data), "tests": {n: _pack(t) for n, t in tests.items()}}, tmp)
    tmp.replace(cache / "teacher.pt")


def _load_teacher(cache: Path | None, key: dict) -> tuple[TeacherData, dict[str, TeacherData]] | None:
    """The cached teacher passes when they were made from the same inputs, else None."""
    path = cache / "teacher.pt" if cache is not None else None
    if path is None or not path.is_file():
        return None
    saved = torch.load(path, weights_only=True)
    if saved["key"] != json.loads(json.dumps(key)):  # lists for tuples, as the saved key holds them
        return None
    return TeacherData(**saved["train"]), {n: TeacherData(**t) for n, t in saved["tests"].items()}


def coverage(head, hidden: torch.Tensor, final_ids: torch.Tensor, ks=(1, 8), chunk: int = 512) -> dict[int, float]:
    """Share of positions whose final greedy token is in the head's top-k, for each k (on the head's device)."""
    hits = {k: 0 for k in ks}
    device = next(head.parameters()).device
    with torch.no_grad():
        for i in range(0, len(hidden), chunk):
            top = head(hidden[i: i + chunk].to(device)).topk(max(ks), -1).indices.cpu()
            for k in ks:
                hits[k] += int((top[:, :k] == final_ids[i: i + chunk, None]).any(-1).sum())
    return {k: hits[k] / max(1, len(hidden)) for k in ks}


def train_adapter(model, layer: int, data: TeacherData, config: ExitAdapterTraining,
                  initial: ExitAdapter | None = None) -> ExitAdapter:
    """initial: an adapter to go on training (a copy; its rank wins over config.rank). config.hard_weight W:
    positions are drawn in proportion to 1 + W x the share of draft depths that miss them (data.miss_share), else
    uniformly. Trains on the model's device; positions are drawn on the CPU (the same draws on either device)."""
    import copy

    from tqdm import tqdm

    seed, rank, steps, batch, lr = config.seed, config.rank, config.steps, config.batch, config.lr
    hard_weight, max_seconds = config.hard_weight, config.minutes_per_layer * 60
    torch.manual_seed(seed)
    if initial is not None:
        adapter = copy.deepcopy(initial)
        adapter.final_norm, adapter.lm_head = model.model.norm, model.lm_head  # shared, frozen: not copies
    else:
        adapter = ExitAdapter(ExitAdapterConfig(model.config.hidden_size, layer, rank, model.config.rms_norm_eps),
                              model.model.norm, model.lm_head)
    device = model.lm_head.weight.device
    adapter.to(device)
    params = [p for name, p in adapter.named_parameters() if name.split(".")[0] in ("norm", "down", "up")]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    x, ids, lps = data.hidden[layer], data.top_ids, data.top_logprobs
    target_p = torch.softmax(lps, -1)  # the teacher's top-32, renormalised
    deadline = time.monotonic() + max_seconds
    g = torch.Generator().manual_seed(seed)
    draw = None
    if hard_weight > 0:
        if data.miss_share is None:
            raise ValueError("hard_weight needs the draft's misses: give the teacher pass a draft")
        draw = 1.0 + hard_weight * data.miss_share
    for step in tqdm(range(steps), desc=f"adapter at layer {layer}", unit="step"):
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 20) * (1 - step / steps)
        sel = (torch.randint(0, len(x), (batch,), generator=g) if draw is None
               else torch.multinomial(draw, batch, replacement=True, generator=g))
        logq = torch.log_softmax(adapter(x[sel].to(device)), -1)
        loss = -(target_p[sel].to(device) * logq.gather(-1, ids[sel].to(device))).sum(-1).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if time.monotonic() > deadline:
            break
    return adapter.eval()


def train(target_dir: Path, data_file: Path | list[Path], out_dir: Path,
          config: ExitAdapterTraining = ExitAdapterTraining(), *,
          prompt_ranges: list[tuple[int, int | None]] | None = None, init_from: Path | None = None,
          hard_draft: Path | None = None, teacher_cache: Path | None = None, device: str | None = None,
          report=print) -> dict:
    """Train one adapter per layer in config.layers; saves each to out_dir/layer-<l>; returns the coverage table.

    data_file: one data file or several (the answers of several prompt pools); each gives its own held-out
    conversations and up to config.conversations training ones. prompt_ranges: per answers file, the prompt indices
    [lo, hi) to read (None: all). init_from: a saved adapter (one layer) to go on training instead of starting from
    the logit lens. hard_draft: a feature draft whose misses the teacher pass records (coverage is then reported on
    the positions it misses too; config.hard_weight draws them more often). teacher_cache: a directory that keeps
    the teacher passes (the slow part on a CPU) for the next run with the same inputs, e.g. another hard_weight.
    device: "cuda" where torch sees a GPU, else "cpu", unless named."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    c, layers = config, list(config.layers)
    files = [Path(data_file)] if isinstance(data_file, (str, Path)) else [Path(f) for f in data_file]
    ranges = file_ranges(files, None, prompt_ranges)
    if len(ranges) != len(files):
        raise ValueError(f"{len(ranges)} prompt ranges for {len(files)} data files")
    if init_from is not None and len(layers) != 1:
        raise ValueError("--init-from continues one adapter: give one layer")
    if c.hard_weight > 0 and hard_draft is None:
        raise ValueError("--hard-weight needs the draft whose misses it weighs: give --hard-draft")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval().to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    draft = None
    if hard_draft is not None:

        draft = FeatureDraft.load(hard_draft, model.get_input_embeddings().weight).to(device)
        if max(draft.config.taps) > model.config.num_hidden_layers:
            raise ValueError(f"{hard_draft} reads layer {max(draft.config.taps)}: not a draft of this target")
    train_examples, held_examples, data = [], {}, {}
    named_twice = len({f.name for f in files}) < len(files)  # two prompt ranges of one file: figures per range
    for path, (lo, hi) in zip(files, ranges):
        examples = _examples(path, tokenizer, hi, lo)
        random.Random(c.seed).shuffle(examples)
        held = min(max(10, len(examples) // 10), 300)  # a large answers file: 300 held-out conversations do
        train_examples += examples[held + c.skip: held + c.skip + c.conversations]
        # a file read in several prompt ranges is named once per range ("name lo:hi"), in the held-out figures and
        # in the data the run read (a dict keyed by the path alone would keep the last range only)
        span = f" {lo}:{'' if hi is None else hi}" if named_twice else ""
        held_examples[path.name + span] = examples[:min(held, c.held_out)]
        data[str(path) + span] = [lo, hi]
    key = {"target": str(target_dir), "data": data, "layers": layers,
           "conversations": c.conversations, "skip": c.skip, "held_out": c.held_out, "seed": c.seed,
           "hard_draft": _fingerprint(hard_draft) if hard_draft is not None else None}
    cached = _load_teacher(teacher_cache, key)
    if cached is None:
        train_data = teacher_pass(model, train_examples, layers, draft)
        tests = {name: teacher_pass(model, ex, layers, draft) for name, ex in held_examples.items()}
        _save_teacher(teacher_cache, key, train_data, tests)
    else:
        train_data, tests = cached
        report(f"teacher passes read from {teacher_cache}")
    lens = LogitLens(model.model.norm, model.lm_head)
    top_k = c.top_k
    ks = sorted({1, 4, top_k})
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({os.cpu_count()} cores)",
               "data": data,
               "positions": {"train": len(train_data.top_ids),
                             "held_out": sum(len(t.top_ids) for t in tests.values())},
               "layers": {}}
    if draft is not None:
        results["hard"] = {"draft": str(hard_draft), "weight": c.hard_weight, "depths": HARD_DEPTHS,
                           "train_first_miss_share": float(train_data.first_miss.float().mean()),
                           "train_mean_miss_share": float(train_data.miss_share.mean())}
    if c.skip:
        results["skip"] = c.skip
    results["config"] = asdict(c)
    for layer in layers:
        initial = None
        if init_from is not None:
            initial = ExitAdapter.load(init_from, model.model.norm, model.lm_head).to(device)
            if initial.config.exit_layer != layer:
                raise ValueError(f"{init_from} is an adapter at layer {initial.config.exit_layer}, not {layer}")
            results["init_from"] = str(init_from)
        adapter = train_adapter(model, layer, train_data, c, initial)
        adapter.save(out_dir / f"layer-{layer}")
        per_file: dict = {}
        for name, test in tests.items():
            final = test.top_ids[:, 0]
            per_file[name] = {"positions": len(final), "logit_lens": coverage(lens, test.hidden[layer], final, ks),
                              "adapter": coverage(adapter, test.hidden[layer], final, ks)}
            if initial is not None:
                per_file[name]["initial"] = coverage(initial, test.hidden[layer], final, ks)
            if test.first_miss is not None:  # where the draft's first token is rejected: what the branches need
                missed = test.first_miss
                per_file[name]["draft_misses"] = {
                    "positions": int(missed.sum()),
                    **{head: coverage(h, test.hidden[layer][missed], final[missed], ks)
                       for head, h in (("adapter", adapter), ("initial", initial)) if h is not None}}
        # one data file: the table's shape before several files
        results["layers"][layer] = (per_file if len(files) > 1 else
                                    {k: v for k, v in next(iter(per_file.values())).items() if k != "positions"})
        for name, r in per_file.items():
            report(f"layer {layer}, {name}: top-1 / top-{top_k} coverage of the final token: logit lens "
                   f"{r['logit_lens'][1]:.1%} / {r['logit_lens'][top_k]:.1%}, adapter "
                   f"{r['adapter'][1]:.1%} / {r['adapter'][top_k]:.1%}"
                   + (f" (before: {r['initial'][1]:.1%} / {r['initial'][top_k]:.1%})" if "initial" in r else ""))
            if "draft_misses" in r:
                m = r["draft_misses"]
                report(f"  where the draft misses ({m['positions']} positions): adapter top-1 / top-4 "
                       f"{m['adapter'][1]:.1%} / {m['adapter'][4]:.1%}"
                       + (f" (before: {m['initial'][1]:.1%} / {m['initial'][4]:.1%})" if "initial" in m else ""))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "coverage.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


def main(argv: list[str] | None = None) -> int:
    d = ExitAdapterTraining()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--data", type=Path, nargs="+", required=True,
                        help="the target's answers: answers files (*.jsonl.gz) or datagen files (*.jsonl)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", default=",".join(map(str, d.layers)))
    parser.add_argument("--conversations", type=int, default=d.conversations,
                        help="training conversations per data file")
    parser.add_argument("--rank", type=int, default=d.rank, help="a new adapter's low-rank width")
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--minutes-per-layer", type=float, default=d.minutes_per_layer)
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--max-prompts", type=int, default=None,
                        help="an answers file's records of the first N prompts only (default: all)")
    parser.add_argument("--prompt-range", type=parse_range, nargs="+", default=None, metavar="LO:HI",
                        help="per data file, the prompt indices to read (instead of --max-prompts)")
    parser.add_argument("--init-from", type=Path, default=None,
                        help="a saved adapter to go on training (one layer) instead of starting from the logit lens")
    parser.add_argument("--hard-draft", type=Path, default=None,
                        help="a feature draft: record where it misses the target's token, report coverage there")
    parser.add_argument("--hard-weight", type=float, default=d.hard_weight,
                        help="draw positions the draft misses this much more often (needs --hard-draft)")
    parser.add_argument("--held-out", type=int, default=d.held_out,
                        help="held-out conversations per data file to measure")
    parser.add_argument("--teacher-cache", type=Path, default=None,
                        help="keep the teacher passes here for the next run with the same inputs")
    parser.add_argument("--batch", type=int, default=d.batch, help="positions per step")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="where to run (default: cuda where torch sees a GPU, else cpu)")
    parser.add_argument("--skip", type=int, default=d.skip,
                        help="train on the conversations after the first SKIP past the held-out ones")
    parser.add_argument("--seed", type=int, default=d.seed)
    args = parser.parse_args(argv)
    error = input_error([args.target, *args.data, *(p for p in (args.init_from, args.hard_draft) if p)],
                        args.prompt_range, args.data, "data files")
    if not error and args.hard_weight < 0:
        error = f"--hard-weight {args.hard_weight}: give a weight >= 0"
    if not error and args.batch < 1:
        error = f"--batch {args.batch}: give at least 1 position per step"
    if not error and args.device == "cuda" and not torch.cuda.is_available():
        error = "--device cuda: torch sees no GPU here"
    if not error and args.hard_weight > 0 and args.hard_draft is None:
        error = "--hard-weight needs --hard-draft (the draft whose misses it weighs)"
    layers = tuple(int(x) for x in args.layers.split(","))
    if not error and args.init_from and len(layers) != 1:
        error = "--init-from continues one adapter: give one layer in --layers"
    config = None
    if not error:
        try:
            config = ExitAdapterTraining(
                layers=layers, conversations=args.conversations, skip=args.skip, held_out=args.held_out,
                rank=args.rank, steps=args.steps, batch=args.batch, lr=args.lr,
                minutes_per_layer=args.minutes_per_layer, hard_weight=args.hard_weight, seed=args.seed)
        except ValueError as e:
            error = str(e)
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    torch.set_num_threads(2)
    train(args.target, args.data, args.out, config,
          prompt_ranges=args.prompt_range or file_ranges(args.data, args.max_prompts, None),
          init_from=args.init_from, hard_draft=args.hard_draft, teacher_cache=args.teacher_cache, device=args.device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
