"""Does the feature draft draft better with one more tap from the target's upper layers, or with more depth? A
warm-started A/B on CPU (results/extra-tap-ab.json).

The committed draft reads the residual stream after layers 5, 10 and 15 (all below the exit layer 24, so a mirror
branch can start before the suffix runs). EAGLE's drafts read the target's top layer. Each arm starts from the
committed draft. Arms B and C add a fourth tap whose fuse columns start at zero: after layer 24 (the prefix's
boundary, which the runtime already has) and after layer 30 (the suffix's last residual, which it would have to
output). Arm D adds depth instead: a residual MLP after the decoder layer, its output projection at zero. So every
arm starts as the committed draft, token for token. All arms then train on the same batches in the same order (the
task-kind answers no draft has read: models/training/data/answers-tasks.jsonl.gz prompts from TASKS_TRAINED on), and are
scored offline (train_feature_draft.evaluate, gamma 4) on the target's answers to the benchmark's 60 prompts and to
46 held-out prompts (results/gpu-diag/) and on the held-out records of the new task answers.

    python lab/scripts/extra_tap_ab.py WORK EPOCHS OUT     e.g. build/extra-tap-ab 1.5 results/extra-tap-ab.json

Resumable: the feature store and each arm's training go on where they stopped (run it again with the same arguments).
"""
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from mirror_sd.models.feature_draft import FeatureDraft, RMSNorm
from mirror_sd.models.training import train_feature_draft as tfd
from mirror_sd.models.training.recipe import TASKS_TRAINED

TARGET = Path("build/models/smollm2-135m-instruct")
DRAFT = Path("models/weights/smollm2-feature-draft")
TASKS = Path("models/training/data/answers-tasks.jsonl.gz")
DIAG = [Path("results/gpu-diag/bench-answers.jsonl.gz"), Path("results/gpu-diag/held-out-answers.jsonl.gz")]
STORE_TAPS = [5, 10, 15, 24, 30]
ARMS = {"A: taps 5/10/15 (control)": [5, 10, 15], "B: + tap 24": [5, 10, 15, 24], "C: + tap 30": [5, 10, 15, 30],
        "D: taps 5/10/15, + an MLP block": [5, 10, 15]}
MAX_LEN, TOKENS_PER_BATCH, LR, STEPS, NOISE = 768, 4096, 3e-4, 4, 0.05


class TapView:
    """The store's features at some of its taps (what _tensors and evaluate read)."""

    def __init__(self, store: tfd.FeatureStore, taps: list[int]) -> None:
        self.store, self.taps, self.width = store, taps, store.width
        self.cols = [store.taps.index(t) for t in taps]

    def get(self, i: int) -> np.ndarray:
        return self.store.get(i)[:, self.cols]


def with_extra_taps(draft: FeatureDraft, taps: list[int]) -> FeatureDraft:
    """The draft reading `taps` (its own first, then new ones): a new tap's norm starts at ones and its fuse columns
    at zero, so the draft computes what it did before until training moves them."""
    old = list(draft.config.taps)
    if taps[: len(old)] != old:
        raise ValueError(f"taps {taps} do not start with the draft's {old}")
    out = copy.deepcopy(draft)
    out.config = copy.deepcopy(draft.config)
    out.config.taps = list(taps)
    d = draft.config.hidden_size
    for _ in taps[len(old):]:
        norm = copy.deepcopy(draft.tap_norms[-1])
        torch.nn.init.ones_(norm.weight)
        out.tap_norms.append(norm)
    fuse = torch.nn.Linear(len(taps) * d, d, bias=False)
    with torch.no_grad():
        fuse.weight.zero_()
        fuse.weight[:, : len(old) * d] = draft.fuse.weight
    out.fuse = fuse
    return out


class MLPBlock(torch.nn.Module):
    """A residual MLP after the draft's decoder layer (Llama's, no attention); its output projection starts at zero,
    so the draft with it computes what it did before until training moves it."""

    def __init__(self, d: int, inner: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(d, eps)
        self.gate, self.up = torch.nn.Linear(d, inner, bias=False), torch.nn.Linear(d, inner, bias=False)
        self.down = torch.nn.Linear(inner, d, bias=False)
        torch.nn.init.zeros_(self.down.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        n = self.norm(h)
        return h + self.down(torch.nn.functional.silu(self.gate(n)) * self.up(n))


def with_extra_block(draft: FeatureDraft) -> FeatureDraft:
    """The draft with an MLPBlock after its layer (more depth at a cost of one MLP per forward)."""
    out = copy.deepcopy(draft)
    c = draft.config
    out.extra_block = MLPBlock(c.hidden_size, c.intermediate_size, c.rms_norm_eps)
    finish = out.layer.finish
    out.layer.finish = lambda x, attended: out.extra_block(finish(x, attended))
    return out


def main(work: Path, epochs: float, out: Path) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    t0 = time.time()
    new = tfd.load_records([TASKS], MAX_LEN, ranges=[(TASKS_TRAINED, None)])
    train_set, held = tfd.split(new)
    diag = [tfd.load_records([p], MAX_LEN) for p in DIAG]  # every record of these files is held out of all training
    records = train_set + held + [r for part in diag for r in part]
    first = len(train_set) + len(held)
    sets = {"benchmark's prompts (gpu-diag)": range(first, first + len(diag[0])),
            "held-out prompts (gpu-diag)": range(len(records) - len(diag[1]), len(records)),
            "held-out task records": range(len(train_set), len(train_set) + len(held))}
    print(f"{len(train_set)} training records ({sum(len(r.ids) for r in train_set)} tokens), "
          f"{len(held)} held-out task records, {len(diag[0])} + {len(diag[1])} diagnostic", flush=True)
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    embedding = target.get_input_embeddings().weight
    store = tfd.FeatureStore(work / "features", records, STORE_TAPS, target.config.hidden_size)
    if store.done < len(records):
        tfd.extract_features(target, records, store, "cpu")
    results = {}
    base = FeatureDraft.load(DRAFT, embedding)
    for name, taps in ARMS.items():
        view = TapView(store, taps)
        draft = with_extra_taps(base, taps)
        if name.startswith("D"):
            draft = with_extra_block(draft)
        arm_work = work / name.split(":")[0]
        arm_work.mkdir(parents=True, exist_ok=True)
        before = {s: tfd.evaluate(draft, records, view, list(idx), gamma=4, device="cpu") for s, idx in sets.items()}
        config = tfd.FeatureDraftTraining(epochs=epochs, steps=STEPS, lr=LR, tokens_per_batch=TOKENS_PER_BATCH,
                                          noise=NOISE, seed=0)
        result = tfd.train(draft.train(), records, list(range(len(train_set))), view, arm_work, config, device="cpu")
        after = {s: tfd.evaluate(draft, records, view, list(idx), gamma=4, device="cpu") for s, idx in sets.items()}
        results[name] = {"taps": taps, "train": result, "before": before, "after": after}
        print(name, {s: (round(before[s]["tokens_per_step"], 3), round(after[s]["tokens_per_step"], 3),
                         round(after[s]["alpha_first"], 3)) for s in sets}, flush=True)
    doc = {"what": __doc__.split("\n\n")[0], "device": "cpu (2 cores)", "minutes": round((time.time() - t0) / 60, 1),
           "data": {"train": f"{TASKS} prompts [{TASKS_TRAINED}, end), training records", "records": len(train_set),
                    "tokens": int(sum(len(r.ids) for r in train_set))},
           "settings": {"epochs": epochs, "lr": LR, "tokens_per_batch": TOKENS_PER_BATCH, "ttt_steps": STEPS,
                        "noise": NOISE, "max_len": MAX_LEN, "gamma": 4},
           "arms": results}
    out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]), Path(sys.argv[3]))
