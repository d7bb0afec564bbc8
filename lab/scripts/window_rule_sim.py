"""Where should a draft window stop? Offline, from full windows: sd, greedy, gamma GAMMA, one draft token per forward,
no gate, no prompt lookup; every drafted token's draft probability and each window's accepted count are recorded
(the window's outcome under any shorter stop follows: a window cut after L tokens accepts min(A, L)). The target's
step is timed here at every window length, the draft's forward too, and each stopping rule is scored by its
modelled time per committed token:

  token τ       the window ends after a token whose probability is below τ (the runtime's rule, transformers'
                assistant_confidence_threshold)
  product τ     the window ends after the token where the product of the window's probabilities falls below τ
  drop τ        as product, but that token is left out of the window (it is drafted, not verified)

python lab/scripts/window_rule_sim.py collect PER_KIND NEW GAMMA OUT.json [--held-out]   (records, timings;
    windows are scored up to GAMMA - 1 tokens)
python lab/scripts/window_rule_sim.py score IN.json [IN.json ...] [--steps MS,MS,...]   (the rules' modelled
    times; --steps: a target step's ms by rows 1, 2, ... in place of the first file's)
"""
import json
import statistics
import sys
import time

BUNDLE = "build/bundles/smollm2-feature"


def collect(per_kind: int, new: int, gamma: int, out: str, held_out: bool = False) -> None:
    from mirror_sd.models.benchmark_prompts import select
    from mirror_sd.runtime import draft as draft_mod
    from mirror_sd.runtime import scheduler
    from mirror_sd.runtime.pipeline import Pipeline

    windows, probs, draft_ms = [], [], []
    confident, rollout, verify = draft_mod.DrafterBase._confident, draft_mod.DrafterBase.rollout, scheduler.verify
    forward = draft_mod.DrafterBase._forward

    def confident_logged(self, row, token):
        probs.append(float(self.vocab.prob(row, token)))
        return confident(self, row, token)

    def forward_timed(self, x, shared, own, new_mask, keep, rows, channel=None):
        s = time.perf_counter()
        out = forward(self, x, shared, own, new_mask, keep, rows, channel)
        if rows == 1 and x.shape[1] == 1:  # a drafted token fed back, batch 1
            draft_ms.append((time.perf_counter() - s) * 1000)
        return out

    def rollout_logged(self, *a, **k):
        probs.clear()
        return rollout(self, *a, **k)

    def verify_logged(window, draft_logits, target_logits, *a, **k):
        verdict = verify(window, draft_logits, target_logits, *a, **k)
        # the last token of a full window is not checked (its probability is unknown): windows are scored on the
        # tokens before it, so collect at one more than the longest window scored
        windows.append({"p": probs[:len(window)], "accepted": min(verdict.accepted, len(probs))})
        return verdict

    draft_mod.DrafterBase._confident, draft_mod.DrafterBase.rollout = confident_logged, rollout_logged
    draft_mod.DrafterBase._forward = forward_timed
    scheduler.verify = verify_logged
    pipe = Pipeline.load(BUNDLE)
    if held_out:
        from mirror_sd.models.training.evaluate import _prompts, messages_of
        prompts = [(f"held-out-{i}", messages_of(pipe, p)) for i, p in enumerate(_prompts(per_kind))]
    else:
        prompts = [(p.name, list(p.messages)) for p in select(per_kind)]
    cfg = dict(mode="sd", gamma=gamma, temperature=0.0, draft_streaming="off", draft_confidence_threshold=1e-9,
               adaptive_speculation=False, prompt_lookup_num_tokens=0)
    started = time.time()
    for i, (name, messages) in enumerate(prompts):
        pipe.generate(messages, max_new_tokens=new, **cfg)
        print(f"{i + 1}/{len(prompts)} {name}: {len(windows)} windows, {time.time() - started:.0f} s", flush=True)
    timing = time_steps(pipe, gamma)
    timing["draft_forward"] = statistics.median(draft_ms)
    with open(out, "w") as f:
        json.dump({"what": __doc__.split("\n\n")[0], "created": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "bundle": BUNDLE, "prompts": "held-out" if held_out else f"bench/prompts.py select({per_kind})",
                   "new_tokens": new, "gamma": gamma, "timing_ms": timing, "windows": windows}, f)


def time_steps(pipe, gamma: int, reps: int = 30) -> dict:
    """Median ms of a target step verifying T = 1 .. gamma + 1 positions after a 100-token context, as the pipeline
    runs it (its plan's threads)."""
    target = pipe.target
    _, cache = target.prefill(list(range(1000, 1100)), target.empty_cache())
    step = {}
    for t in range(1, gamma + 2):
        times = []
        for _ in range(reps):
            s = time.perf_counter()
            target.forward(list(range(2000, 2000 + t)), cache)
            times.append((time.perf_counter() - s) * 1000)
        step[t] = statistics.median(times)
    return {"target_step_by_rows": step}


def score(paths: list[str], steps: str | None = None) -> None:
    """steps: "t1,t2,..." ms of a target step by rows, in place of the first file's timings."""
    docs = [json.load(open(p)) for p in paths]
    windows = [w for d in docs for w in d["windows"]]
    step = {int(k): v for k, v in docs[0]["timing_ms"]["target_step_by_rows"].items()}
    if steps:
        step = {i + 1: float(v) for i, v in enumerate(steps.split(","))}
    draft_ms = docs[0]["timing_ms"]["draft_forward"]
    gamma = docs[0]["gamma"] - 1

    def modelled(lengths):
        """ms per committed token when window w is cut after lengths[w] = (verified, drafted) tokens (0 verified: the
        target alone)."""
        ms = tokens = 0.0
        for w, (n, drafted) in zip(windows, lengths):
            ms += step[n + 1] + draft_ms * drafted
            tokens += min(w["accepted"], n) + 1
        return ms / tokens, tokens / len(windows)

    def cut(rule, tau):
        out = []
        for w in windows:
            p, prod, n, drafted = w["p"], 1.0, 0, 0
            for i, q in enumerate(p):
                drafted = i + 1
                prod *= q
                if rule == "token":
                    n = i + 1
                    if q < tau:
                        break
                elif rule == "product":
                    n = i + 1
                    if prod < tau:
                        break
                elif rule == "drop":
                    if prod < tau:
                        break
                    n = i + 1
            out.append((n, drafted))
        return out

    print(f"{len(windows)} windows; target step ms by rows {step}; draft forward {draft_ms} ms")
    base, _ = modelled([(0, 0)] * len(windows))
    for g in range(1, gamma + 1):
        ms, tps = modelled([(min(g, len(w["p"])),) * 2 for w in windows])
        print(f"full windows gamma {g}: {ms:.2f} ms/token ({base / ms:.3f}x target alone), {tps:.2f} tokens/step")
    for rule in ("token", "product", "drop"):
        for tau in (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8):
            ms, tps = modelled(cut(rule, tau))
            print(f"{rule} {tau}: {ms:.2f} ms/token ({base / ms:.3f}x), {tps:.2f} tokens/step")


if __name__ == "__main__":
    if sys.argv[1] == "collect":
        collect(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], held_out="--held-out" in sys.argv)
    else:
        args = sys.argv[2:]
        steps = args[args.index("--steps") + 1] if "--steps" in args else None
        score([a for a in args if a.endswith(".json")], steps)
