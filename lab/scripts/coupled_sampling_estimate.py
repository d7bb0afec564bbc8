"""Could sampled sd and mirror give ar's own sampled tokens (the same seed, the same text, whatever the mode or the
load) and still accept as many draft tokens? Offline estimate on the real pair: sampled sd generations record, at
every verified window position, the target's warped distribution p and the draft's q; per position the expected
acceptance of
  residual    speculative sampling as the runtime does it (accept min(1, p/q), residual on rejection): sum min(p, q)
  icdf        the draft draws its token with the uniform ar draws the target's token with at that position (inverse
              CDF over token ids, as runtime/sampling.py sample): accepted where both land on the same token
  gumbel      both draw by Gumbel-max with the same noise per position (ar would draw so too): accepted where the
              argmaxes agree (Monte Carlo over noise draws)
The last two commit ar's own token at every position (lossless by construction, and seed-for-seed equal to ar).

    .venv/bin/python lab/scripts/coupled_sampling_estimate.py build/bundles/smollm2-feature --out lab/results/...
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from mirror_sd.runtime import verify as verify_module
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.runtime.sampling import warp

PROMPTS = ["Give me three tips for staying focused while studying.", "Write a short story about a lost key.",
           "Explain how a rainbow forms.", "What should I pack for a weekend hike?",
           "Summarise the plot of Romeo and Juliet.", "Write a Python function that reverses a string."]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--noise-draws", type=int, default=64)
    args = parser.parse_args()
    rows: list[tuple[np.ndarray, np.ndarray]] = []
    accept = verify_module.speculative_accept

    def recording(window, draft_logits, target_logits, params, rng):
        for i in range(len(window)):
            rows.append((warp(target_logits[i], params), warp(draft_logits[i], params)))
        return accept(window, draft_logits, target_logits, params, rng)

    verify_module.speculative_accept = recording
    pipe = Pipeline.load(Path(args.bundle))
    noise = np.random.default_rng(0)
    out = {}
    for temperature in (0.7, 1.0):
        rows.clear()
        for seed, prompt in enumerate(PROMPTS):
            pipe.generate([{"role": "user", "content": prompt}], mode="sd", max_new_tokens=args.tokens,
                          temperature=temperature, top_p=1.0, seed=seed)
        res, icdf, gum = [], [], []
        for p, q in rows:
            res.append(float(np.minimum(p, q).sum()))
            fp, fq = np.cumsum(p), np.cumsum(q)
            lo = np.maximum(fp - p, fq - q)
            icdf.append(float(np.clip(np.minimum(fp, fq) - lo, 0, None).sum()))
            lp, lq = np.log(np.maximum(p, 1e-300)), np.log(np.maximum(q, 1e-300))
            lp[p == 0], lq[q == 0] = -np.inf, -np.inf
            g = noise.gumbel(size=(args.noise_draws, p.size))
            gum.append(float(np.mean(np.argmax(lp + g, -1) == np.argmax(lq + g, -1))))
        out[str(temperature)] = {"positions": len(rows), "residual": round(statistics.mean(res), 4),
                                 "icdf": round(statistics.mean(icdf), 4), "gumbel": round(statistics.mean(gum), 4)}
        print(temperature, out[str(temperature)], flush=True)
    pipe.close()
    Path(args.out).write_text(json.dumps({"question": "expected acceptance per window position of speculative "
                                          "sampling against draws coupled to ar's", "bundle": args.bundle,
                                          "prompts": PROMPTS, "new_tokens": args.tokens, "by_temperature": out},
                                         indent=1) + "\n")


if __name__ == "__main__":
    main()
