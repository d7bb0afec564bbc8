"""The target's greedy answers to the benchmark's prompts (bench/prompts.py) as an answers file (models/answers.py
format), so that `train_feature_draft --compare` measures saved drafts on them offline: the prompt set `make bench`
times, which no draft trains on. Every record's index is a multiple of HOLD_OUT, so every one is a held-out record.
Multi-turn prompts carry their hand-written first reply; only the target's last answer is an answer span.

python lab/scripts/bench_answers.py build/bundles/smollm2-feature 10 96 build/gpu/bench-answers.jsonl.gz

With a fifth argument "held-out", the prompts are the held-out pool's (models/prompts.py, the kinds
models.evaluate measures) past the first EVALUATED per kind that `models.evaluate --per-kind 3` reads, less any
equal to one of those: a diagnostic set neither the benchmark nor the held-out evaluation measures
(lab/scripts/self_data_gpu.sh's ARM_B_TAPS).
"""
import gzip
import json
import sys
import time

EVALUATED = 3


def answer_record(pipe, n: int, messages: list[dict], kind: str, new_tokens: int):
    """The n-th held-out record (models/answers.py format) of a prompt: the target's greedy answer to `messages`,
    and the ar result it came from."""
    from mirror_sd.models.training.answers import HOLD_OUT

    ids = list(pipe.prompt_ids(messages))
    ar = pipe.generate(messages, mode="ar", max_new_tokens=new_tokens)
    answer = list(ar.token_ids)
    return {"index": n * HOLD_OUT, "kind": kind, "ids": ids + answer,
            "answers": [[len(ids), len(ids) + len(answer)]]}, ar


def main(bundle: str, per_kind: int, new_tokens: int, out: str, which: str = "bench") -> None:
    from mirror_sd.models.training.evaluate import _prompts, bench_prompts, messages_of
    from mirror_sd.runtime.pipeline import Pipeline

    pipe = Pipeline.load(bundle, huge_pages=False)
    if which == "held-out":  # build() cycles through the kinds: the first EVALUATED rounds are models.evaluate's
        evaluated = _prompts(EVALUATED)  # the held-out pool's few templates repeat: none of those prompts again
        prompts = [p for p in _prompts(EVALUATED + per_kind)[len(evaluated):] if p not in evaluated]
    elif which == "bench":
        prompts = bench_prompts(per_kind)[0]
    else:
        raise SystemExit(f"prompt set {which!r}: bench or held-out")
    started = time.time()
    with gzip.open(out, "wt") as f:
        for n, prompt in enumerate(prompts):
            record, _ = answer_record(pipe, n, messages_of(pipe, prompt), prompt.kind, new_tokens)
            f.write(json.dumps(record) + "\n")
            print(f"{n + 1}/{len(prompts)} {prompt.kind:<14} {time.time() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], *sys.argv[5:6])
