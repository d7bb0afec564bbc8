"""The speculation and copy gates over growing contexts, two ways of running them side by side in one process on the
feature bundle (2026-11-26; `prior` and `catch-up` at commit 26c84ac, `try-window` at the commit that added
scheduler.TRY_PROMPT_WINDOW):

- `prior` (results/gate-prior.json): each longer bucket's first gate starting from the nearest shorter bucket's
  memory as it was ("carried", the runtime before GateState.as_prior) or as a prior ("prior", the runtime now).
- `catch-up` (results/gate-catch-up.json): a speculative step after steps of the target alone first lets the draft
  read what it skipped (scheduler.fresh_window: after a generation whose gate memory preferred the target alone, the
  prompt's last 256 inputs); "uncharged" times the step without that wait (the runtime), "charged" with it.
- `try-window` (results/try-window.json): that read of a skipped prompt before a try at most 256 inputs (the feature
  draft's prompt window, "try-256") or 64 ("try-64", the runtime now: scheduler.TRY_PROMPT_WINDOW).

It follows the context benchmark (bench/context.py): lengths in increasing order, at each one a warm-up generation of
8 new tokens per method, then REPEATS prompts of real text, 32 new tokens, the order of the methods rotating per
prompt. Each arm keeps its own gate memory across the lengths, as a pipeline does across a benchmark's prompts.

python lab/scripts/gate_context_ab.py prior|catch-up|try-window LENGTHS REPEATS OUT
e.g. `prior 64,2048,4096 3 results/gate-prior.json`
"""
import json
import platform
import statistics
import sys
import time

from mirror_sd.bench.context import WARMUP_TOKENS, context_prompts
from mirror_sd.runtime import scheduler, speculation_policy
from mirror_sd.runtime.pipeline import Pipeline

NEW = 32
recalled_now, fresh_window = speculation_policy.recalled, scheduler._Decoder.fresh_window
try_window = getattr(scheduler, "TRY_PROMPT_WINDOW", 0)  # 0: read the drafter's whole prompt window


def recalled_carried(memory, key):
    """The runtime before as_prior: a shorter bucket's memory as it was."""
    kind, bucket = key
    return next((memory[kind, b] for b in range(bucket, -1, -1) if (kind, b) in (memory or {})), None)


def charged_fresh_window(self, ctx, gamma):
    """The decoder's fresh_window, reporting no catch-up: the gate times the whole step."""
    window = fresh_window(self, ctx, gamma)
    self.catch_up_s = 0.0
    return window


# arm -> (mode, speculation_policy.recalled, scheduler._Decoder.fresh_window, scheduler.TRY_PROMPT_WINDOW)
ARMS = {"prior": {"ar": ("ar", recalled_now, fresh_window, try_window),
                  "sd-carried": ("sd", recalled_carried, fresh_window, try_window),
                  "sd-prior": ("sd", recalled_now, fresh_window, try_window),
                  "mirror-carried": ("mirror", recalled_carried, fresh_window, try_window),
                  "mirror-prior": ("mirror", recalled_now, fresh_window, try_window)},
        "catch-up": {"ar": ("ar", recalled_now, fresh_window, try_window),
                     "sd-uncharged": ("sd", recalled_now, fresh_window, try_window),
                     "sd-charged": ("sd", recalled_now, charged_fresh_window, try_window),
                     "mirror-uncharged": ("mirror", recalled_now, fresh_window, try_window),
                     "mirror-charged": ("mirror", recalled_now, charged_fresh_window, try_window)},
        "try-window": {"ar": ("ar", recalled_now, fresh_window, 64),
                       "sd-try-256": ("sd", recalled_now, fresh_window, 256),
                       "sd-try-64": ("sd", recalled_now, fresh_window, 64),
                       "mirror-try-256": ("mirror", recalled_now, fresh_window, 256),
                       "mirror-try-64": ("mirror", recalled_now, fresh_window, 64)}}
KEYS = ("draft_wait_s", "mean_accepted_tokens", "target_steps", "proposed_tokens", "accepted_tokens", "gated_steps",
        "lookup_steps", "declined_copies", "fresh_rollouts")

arms = ARMS[sys.argv[1]]
lengths, repeats, out = [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3]), sys.argv[4]
pipe = Pipeline.load("build/bundles/smollm2-feature")
memories = {name: {} for name in arms}


def run(name, ids, n):
    mode, speculation_policy.recalled, scheduler._Decoder.fresh_window, scheduler.TRY_PROMPT_WINDOW = arms[name]
    pipe._gate_memory = memories[name]
    start = time.perf_counter()
    r = pipe.generate(ids, mode=mode, max_new_tokens=n, temperature=0.0)
    total = time.perf_counter() - start
    decode = (len(r.token_ids) - 1) / (total - r.stats["ttft_s"])
    return r.token_ids, {"decode_tokens_per_s": decode, "ttft_s": r.stats["ttft_s"],
                         **{k: r.stats[k] for k in KEYS}}


doc = {"what": __doc__.split("\n\n")[0], "arms": sys.argv[1], "machine": platform.processor() or platform.machine(),
       "created": time.strftime("%Y-%m-%d %H:%M:%S"), "new_tokens": NEW, "repeats": repeats, "per_length": {}}
started = time.time()
for length in lengths:
    warm, *prompts = context_prompts(pipe, length, repeats + 1)
    for name in arms:
        run(name, warm, WARMUP_TOKENS)
    rows = {name: [] for name in arms}
    identical = {name: True for name in arms}
    names = list(arms)
    for i, ids in enumerate(prompts):
        order = names[i % len(names):] + names[:i % len(names)]
        results = {name: run(name, ids, NEW) for name in order}
        for name, (tokens, stats) in results.items():
            rows[name].append(stats)
            identical[name] &= tokens == results["ar"][0]
    ar = statistics.median(s["decode_tokens_per_s"] for s in rows["ar"])
    per = {}
    for name, stats in rows.items():
        decode = statistics.median(s["decode_tokens_per_s"] for s in stats)
        per[name] = {"decode_tokens_per_s": decode, "over_ar": decode / ar, "identical_to_ar": identical[name],
                     "runs": stats}
        print(f"{length:>5} {name:<16} {decode:6.1f} tok/s  {decode / ar:.2f}x ar  "
              f"lookup {sum(s['lookup_steps'] for s in stats):>3}  "
              f"declined {sum(s['declined_copies'] for s in stats):>3}  "
              f"gated {sum(s['gated_steps'] for s in stats):>3}  accepted/step "
              f"{statistics.mean(s['mean_accepted_tokens'] for s in stats):.2f}  draft wait "
              f"{sum(s['draft_wait_s'] for s in stats):.2f} s", flush=True)
    doc["per_length"][str(length)] = per
doc["elapsed_s"] = time.time() - started
with open(out, "w") as f:
    json.dump(doc, f, indent=1)
    f.write("\n")
