"""The GPU run's self-written answers cut at the end of their turn (results/self-data-gpu.json).

That run's generator stopped at the tokenizer's eos_token_id, which the GPU machine's transformers read from the
converted GGUF as <|im_start|> (1), not <|im_end|> (2): 1,527 of the first 5,573 answers ran on past their
<|im_end|> by 1-3 tokens ("\\n<|im_start|>"). Greedy decoding is causal, so each answer up to and including its first
<|im_end|> is exactly the answer a run stopping there gives; this cuts them so (models.self_queries now stops at the
template's own end-of-turn token). Answers without an <|im_end|> (the 160-token cap) are kept whole.

    python lab/scripts/self_answers_cut.py IN.jsonl.gz models/training/data/answers-self.jsonl.gz
"""

import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

from mirror_sd.models.training import answers
from mirror_sd.models.training.self_queries import cut_at_stop, end_of_turn

TARGET = Path("build/models/smollm2-135m-instruct")


def main(src: Path, dst: Path) -> None:
    eot = end_of_turn(AutoTokenizer.from_pretrained(TARGET))
    records, cut, dropped = answers.read(src), 0, 0
    partial = dst.with_name(dst.name + ".partial")
    with partial.open("wb") as f:
        for lo in range(0, len(records), 512):
            batch = []
            for r in records[lo:lo + 512]:
                (start, end), = r["answers"]
                stop = start + len(cut_at_stop(r["ids"][start:end], [eot]))
                if stop < end:
                    dropped += end - stop
                    cut += 1
                    r = {**r, "ids": r["ids"][:stop], "answers": [[start, stop]]}
                batch.append(r)
            answers.write_member(f, batch)
    partial.replace(dst)
    print(json.dumps({"records": len(records), "answers_cut": cut, "tokens_dropped": dropped, "end_of_turn": eot}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
