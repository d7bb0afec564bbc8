"""Would verifying the draft's second and third choices beside its window (a token tree, as EAGLE-2 and SpecInfer
verify) pay on this CPU? Offline, feature bundle, greedy, gamma 4, the benchmark's prompts (PER_KIND of each kind),
64 new tokens: the target's greedy answer walked as sd walks it, the draft's window at each step (one token per
forward over the whole sequence, as runtime/reference.py drafts), and whether the target's token at the first
mismatch is among the draft's top 2 / 3 / 4 there: each such sibling row, verified beside the window, would have
committed one more token that step. Printed per prompt, running totals (shares of steps).

python lab/scripts/draft_siblings.py PER_KIND      (2026-11-26: PER_KIND 2, 345 steps; results/README.md)
"""
import json
import sys
import time

import numpy as np

from mirror_sd.models.benchmark_prompts import select
from mirror_sd.partitions.manifest import DRAFT_HIDDEN, FEATURES, LOGITS, SURROGATE, USE_SURROGATE
from mirror_sd.runtime.config import GenerationConfig
from mirror_sd.runtime.feature_draft import empty_channel
from mirror_sd.runtime.pipeline import Pipeline

GAMMA, NEW = 4, 64
pipe = Pipeline.load("build/bundles/smollm2-feature", huge_pages=False)
target, draft = pipe.target, pipe.draft
columns = draft.output_ids  # draft column -> target id


def window_rows(seq, size):
    """The draft's greedy window continuing seq, and its top 8 target ids at each window slot."""
    taps = target.run_prefix(seq, target.empty_cache()).taps
    window, tops, hidden = [], [], []
    for _ in range(size):
        x = np.asarray([seq[1:] + window], np.int64)
        real = len(seq) - 1
        channel = empty_channel(draft.facts, 1, x.shape[1])
        channel[FEATURES][0, :real] = taps[:real]
        for j, h in enumerate(hidden):
            channel[SURROGATE][0, real + j], channel[USE_SURROGATE][0, real + j] = h, 1
        out = draft.prefill(x, channel)
        order = np.argsort(-out[LOGITS][0, -1])[:8]
        tops.append([int(columns[c]) for c in order])
        window.append(tops[-1][0])
        hidden.append(out[DRAFT_HIDDEN][0, -1])
    return window, tops


stats = {"steps": 0, "committed": 0, "sibling_hits": {k: 0 for k in (2, 3, 4)}}
accepted_at = [0] * (GAMMA + 1)
started = time.time()
for prompt in select(int(sys.argv[1])):
    messages = list(prompt.messages)
    ids = pipe.prompt_ids(messages)
    answer = list(pipe.generate(messages, GenerationConfig(mode="ar", max_new_tokens=NEW)).token_ids)
    p = 0
    while p < len(answer) - 1:
        size = min(GAMMA, len(answer) - p - 1)
        window, tops = window_rows(ids + answer[:p], size)
        a = 0
        while a < size and window[a] == answer[p + a]:
            a += 1
        stats["steps"] += 1
        accepted_at[a] += 1
        if a < size:
            for k in stats["sibling_hits"]:
                stats["sibling_hits"][k] += answer[p + a] in tops[a][:k]
        stats["committed"] += a + 1
        p += a + 1
    print(prompt.name, stats["steps"], round(stats["committed"] / stats["steps"], 3),
          {k: round(v / stats["steps"], 3) for k, v in stats["sibling_hits"].items()}, round(time.time() - started),
          flush=True)
print(json.dumps({"stats": stats, "steps_by_accepted_tokens": accepted_at}))
