"""How well the feature draft drafts after reading only the last 256 / 128 / 64 inputs of a long prompt: tokens per
step and acceptance, sd, gamma 4, no gate, no lookup, full windows, 6 context-benchmark prompts x 48 tokens per
length (runtime/scheduler.py TRY_PROMPT_WINDOW). 2026-11-26 (tokens per step, 256 / 128 / 64): 512 prompt tokens
1.461 / 1.439 / 1.446, 2,048 1.584 / 1.575 / 1.541, 4,096 1.533 / 1.461 / 1.431.

python lab/scripts/prompt_window_acceptance.py
"""
from mirror_sd.bench.context import context_prompts
from mirror_sd.runtime import feature_draft
from mirror_sd.runtime.pipeline import Pipeline

pipe = Pipeline.load("build/bundles/smollm2-feature")
for L in (512, 2048, 4096):
    prompts = context_prompts(pipe, L, 6)
    for w in (256, 128, 64):
        feature_draft.FEATURE_PROMPT_WINDOW = w
        acc, prop, steps, new = 0, 0, 0, 0
        for ids in prompts:
            r = pipe.generate(ids, mode="sd", max_new_tokens=48, gamma=4, adaptive_speculation=False,
                              prompt_lookup_num_tokens=0, draft_confidence_threshold=0.0)
            s = r.stats
            acc += s["accepted_tokens"]; prop += s["proposed_tokens"]; steps += s["target_steps"] - 1; new += s["new_tokens"] - 1
        print(L, w, "tokens/step", round(new / steps, 3), "acceptance", round(acc / prop, 3), flush=True)
