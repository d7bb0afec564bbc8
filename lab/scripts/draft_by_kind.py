"""The committed feature draft's offline tokens per step by prompt kind, on the benchmark's prompts (gpu-diag's
bench answers) against the task-kind turns the target wrote itself (held-out records of the CPU-written range): is
the benchmark harder than the data the draft trains on, and in which kinds? Beside each, pooled over answer tokens:
the share whose 4-gram occurred earlier in the conversation (train_feature_draft.repeat_share: copied or repeated)
and the share that repeats the answers' own earlier text found nowhere else before it (loop_share). Reads the
features that `train_feature_draft --compare` stored in WORK for the same three files
(results/feature-draft-cpu-tasks-ab.json).

usage: python lab/scripts/draft_by_kind.py WORK OUT.json DRAFT [DRAFT ...]
"""
import json
import sys
from pathlib import Path

from mirror_sd.models.feature_draft import FeatureDraft
from mirror_sd.models.training import answers as answers_file
from mirror_sd.models.training.train_feature_draft import (
    FeatureStore,
    evaluate,
    load_records,
    loop_share,
    repeat_share,
    split,
)

TARGET = Path("build/models/smollm2-135m-instruct")
FILES = [(Path("results/gpu-diag/held-out-answers.jsonl.gz"), (0, None)),
         (Path("results/gpu-diag/bench-answers.jsonl.gz"), (0, None)),
         (Path("models/training/data/answers-tasks.jsonl.gz"), (9040, 14432))]


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    work, out, drafts = Path(sys.argv[1]), Path(sys.argv[2]), [Path(d) for d in sys.argv[3:]]
    held_by_file = [split(load_records([p], 768, ranges=[rng]))[1][:1000] for p, rng in FILES]
    held = [r for part in held_by_file for r in part]
    kinds = {}
    for p, _ in FILES:
        kinds[str(p)] = {int(r["index"]): r["kind"].removeprefix("task-") for r in answers_file.read(p)}
    embedding = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).get_input_embeddings().weight
    models = {d: FeatureDraft.load(d, embedding) for d in drafts}
    store = FeatureStore(work, held, [5, 10, 15], 576)
    assert store.done == len(held), "run train_feature_draft --compare on the same files into WORK first"
    result, first = {}, 0
    for (path, _), part in zip(FILES, held_by_file):
        by_kind: dict[str, list[int]] = {}
        for j, r in enumerate(part):
            by_kind.setdefault(kinds[str(path)][r.index], []).append(first + j)
        first += len(part)
        shares = {}  # per kind, what the text holds: the same for every draft
        for kind, idx in by_kind.items():
            answer_tokens = [int(held[i].labels[3:].sum()) for i in idx]
            total = max(sum(answer_tokens), 1)
            repeated = sum(repeat_share(held[i]) * n for i, n in zip(idx, answer_tokens))
            looped = sum(loop_share(held[i]) * n for i, n in zip(idx, answer_tokens))
            shares[kind] = {"answer_tokens": sum(answer_tokens), "repeat_share": round(repeated / total, 3),
                            "loop_share": round(looped / total, 3)}
        for d, model in models.items():
            for kind, idx in sorted(by_kind.items()):
                m = evaluate(model, held, store, idx, gamma=4, device="cpu")
                row = {"records": len(idx), "bases": m["bases"], **shares[kind],
                       "tokens_per_step": round(m["tokens_per_step"], 3),
                       "walked_tokens_per_step": round(m["walked_tokens_per_step"], 3),
                       "alpha_per_step": [round(a, 3) for a in m["alpha_per_step"]]}
                result.setdefault(str(path), {}).setdefault(str(d), {})[kind] = row
                print(path.name, d, kind, row, flush=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
