"""The exit adapter continued where the feature draft misses (EXIT_HARD in models/smollm2.py) against the same
continuation drawing every position alike, and both against the adapter they continue: results/exit-hard-ab.json.

Both arms read one teacher pass (train_exit --teacher-cache): 400 conversations of each answers file after the
first 800 past the held-out ones, 2,400 steps each; "hard" draws a position 1 + 3 x (share of draft depths 0-3
that miss it) times as often, "uniform" draws them alike. Coverage is of the target's greedy token on the same
100 held-out conversations per file, overall and at the positions where the draft's first token misses (where
mirror's branches are needed). The runtime's figures (models.evaluate, full windows: mirror's branch hits on
rejected steps) come from the evaluation files given.

python -m mirror_sd.models.train_exit ... --out build/exit-hard/w3 --hard-weight 3 --teacher-cache build/exit-hard/teacher
python -m mirror_sd.models.train_exit ... --out build/exit-hard/w0 --hard-weight 0 --teacher-cache build/exit-hard/teacher
python results/scripts/exit_hard_ab.py results/exit-hard-ab.json build/exit-hard/w3 build/exit-hard/w0 \\
    [NAME=before.json,after.json ...]     (a file as COMMIT:PATH is read from git)
"""
import json
import subprocess
import sys
import time
from pathlib import Path

EVAL_KEYS = ("mirror_rejected_branch_hit_rate", "mirror_branch_hit_rate", "mean_accepted_tokens_all",
             "acceptance_rate", "all_identical_to_ar", "prompts")


def arm(directory: str) -> dict:
    data = json.loads((Path(directory) / "coverage.json").read_text())
    (layer, files), = data["layers"].items()
    out = {"layer": int(layer), "hard": data.get("hard"), "positions": data["positions"], "files": {}}
    for name, row in files.items():
        missed = row["draft_misses"]
        out["files"][name] = {
            "all_positions": {"top1": [row["initial"]["1"], row["adapter"]["1"]],
                              "top4": [row["initial"]["4"], row["adapter"]["4"]],
                              "top8": [row["initial"]["8"], row["adapter"]["8"]]},
            "draft_misses": {"positions": missed["positions"],
                             "top1": [missed["initial"]["1"], missed["adapter"]["1"]],
                             "top4": [missed["initial"]["4"], missed["adapter"]["4"]]}}
    return out


def _read(spec: str) -> dict:
    """A JSON file, or COMMIT:PATH as committed."""
    if Path(spec).is_file():
        return json.loads(Path(spec).read_text())
    return json.loads(subprocess.run(["git", "show", spec], check=True, capture_output=True, text=True).stdout)


def evaluation(pair: str) -> dict:
    name, _, files = pair.partition("=")
    before, after = (_read(f)["summary"] for f in files.split(","))
    return {"set": name, "files": files.split(","),
            **{k: [before.get(k), after.get(k)] for k in EVAL_KEYS}}


def main(out: str, hard: str, uniform: str, *evaluations: str) -> None:
    result = {
        "what": __doc__.split("\n\n")[0],
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "pairs_are": "[the adapter continued from (committed before), this arm]",
        "hard": arm(hard), "uniform": arm(uniform),
        "runtime": [evaluation(e) for e in evaluations],
    }
    Path(out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
