"""Does the runtime draft as well as the offline figure says? The offline walk (train_feature_draft.evaluate: the
draft in PyTorch, fp32, the target's features teacher-forced, sd steps walked through each answer) has read higher
than models.evaluate's runtime tokens per step. This measures both on the same answers: the target's greedy
96-token answers to models.evaluate's held-out prompts (--per-kind 3), and per prompt the runtime's sd at gamma 4
with full windows (no confidence cut, no gate, no prompt lookup), with the stream heads ("sd") and without
("sd_ns"). Run it on the committed bundle (int8 draft weights) and on one exported with --draft-weights float32.

    PYTHONPATH=results/scripts python lab/scripts/runtime_offline_gap.py build/bundles/smollm2-feature \\
        results/runtime-offline-gap/held-out-answers.jsonl.gz
    python -m mirror_sd.models.training.train_feature_draft --target build/models/smollm2-135m-instruct \\
        --compare models/weights/smollm2-feature-draft \\
        --answers results/runtime-offline-gap/held-out-answers.jsonl.gz --work build/gap-work \\
        --eval-records 1000 --compare-out results/runtime-offline-gap/offline-compare.json

Writes the answers file and, beside it, OUT.rows.json (per prompt: kind, answer length, tokens per step of each
run, whether its output equals ar's). results/runtime-offline-gap.json collects the figures.
"""
import gzip
import json
import sys

from bench_answers import answer_record

from mirror_sd.models.training.evaluate import _prompts, messages_of
from mirror_sd.runtime.pipeline import Pipeline

NEW_TOKENS, GAMMA = 96, 4


def main(bundle: str, out: str) -> None:
    pipe = Pipeline.load(bundle, huge_pages=False)
    full = dict(draft_confidence_threshold=0.0, adaptive_speculation=False, prompt_lookup_num_tokens=0)
    runs = {"sd": dict(mode="sd", **full), "sd_ns": dict(mode="sd", draft_streaming=False, **full)}
    rows = []
    with gzip.open(out, "wt") as f:
        for n, prompt in enumerate(_prompts(3)):
            messages = messages_of(pipe, prompt)
            record, ar = answer_record(pipe, n, messages, prompt.kind, NEW_TOKENS)
            f.write(json.dumps(record) + "\n")
            row = {"kind": prompt.kind, "n": len(ar.token_ids)}
            for name, options in runs.items():
                result = pipe.generate(messages, max_new_tokens=NEW_TOKENS, gamma=GAMMA, **options)
                row[name] = result.stats["mean_accepted_tokens"]
                row[name + "_same"] = result.token_ids == ar.token_ids
            rows.append(row)
            print(n, row, flush=True)
    with open(out + ".rows.json", "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
