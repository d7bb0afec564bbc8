"""What `train_feature_draft --max-loop` keeps: per prompt kind, the share of the answer tokens of every committed
answers file's training records (index % 20 != 0) in records whose loop_share is at most each limit. Writes them
into results/feature-draft-cpu-tasks-ab.json as "max_loop_kept".

usage: python lab/scripts/loop_filter_shares.py
"""
import collections
import json
from pathlib import Path

from mirror_sd.models.training import answers as answers_file
from mirror_sd.models.training.train_feature_draft import HOLD_OUT, load_records, loop_share

LIMITS = (0.2, 0.3, 0.4, 0.5)
RESULTS = Path("results/feature-draft-cpu-tasks-ab.json")


def main() -> None:
    total, kept = collections.Counter(), {limit: collections.Counter() for limit in LIMITS}
    for path in sorted(Path("models/data").glob("*.jsonl.gz")):
        kinds = {int(r["index"]): r.get("kind", "?").removeprefix("task-") for r in answers_file.read(path)}
        for r in load_records([path], 768):
            if r.index % HOLD_OUT == 0:
                continue
            kind, tokens, share = kinds[r.index], int(r.labels.sum()), loop_share(r)
            total[kind] += tokens
            for limit in LIMITS:
                kept[limit][kind] += tokens if share <= limit else 0
    out = {"how": "lab/scripts/loop_filter_shares.py: answer tokens of every committed answers file's training "
                  "records (max_len 768) in records whose loop_share is at most the limit, per kind and in all",
           "answer_tokens": dict(total.most_common()),
           "kept": {str(limit): {"all": round(sum(kept[limit].values()) / sum(total.values()), 3),
                                 **{k: round(kept[limit][k] / n, 3) for k, n in total.most_common()}}
                    for limit in LIMITS}}
    result = json.loads(RESULTS.read_text())
    result["max_loop_kept"] = out
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(out["kept"], indent=1))


if __name__ == "__main__":
    main()
