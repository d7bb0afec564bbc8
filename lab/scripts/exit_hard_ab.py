"""The exit adapter continued where the feature draft misses (EXIT_HARD in models/training/recipe.py) against the same
continuation drawing every position alike, and both against the adapter they continue: results/exit-hard-ab.json.

The arms read one teacher pass (train_exit --teacher-cache): 400 conversations of each answers file after the
first 800 past the held-out ones, 2,400 steps each; "hard" draws a position 1 + 3 x (share of draft depths 0-3
that miss it) times as often, "uniform" draws them alike; "hard-more" continues "hard" 2,400 steps more at 1 + 8 x
(the committed adapter: EXIT_HARD_MORE), so its "before" is "hard". Coverage is of the target's greedy
token on the same 100 held-out conversations per file, overall and at the positions where the draft's first token
misses (where mirror's branches are needed). The runtime's figures (models.evaluate, full windows: mirror's branch
hits on rejected steps) come from the evaluation files given.

python -m mirror_sd.models.training.train_exit ... --hard-weight W --out build/exit-hard/wW \\
    --teacher-cache build/exit-hard/teacher       (W = 3, 0; then 8 --init-from w3: the teacher pass runs once)
python lab/scripts/exit_hard_ab.py results/exit-hard-ab.json --arm hard=build/exit-hard/w3 \\
    --arm uniform=build/exit-hard/w0 --arm hard-more=build/exit-hard/w8 \\
    [--eval NAME=BEFORE.json,AFTER.json ...]                     (a file as COMMIT:PATH: read from git)
    [--what TEXT]                        (another A/B of a continued adapter: what it asks, instead of the above)
"""
import argparse
import json
import subprocess
import time
from pathlib import Path

EVAL_KEYS = ("mirror_rejected_branch_hit_rate", "mirror_branch_hit_rate", "mean_accepted_tokens_all",
             "acceptance_rate", "all_identical_to_ar", "prompts")


def arm(directory: str) -> dict:
    data = json.loads((Path(directory) / "coverage.json").read_text())
    (layer, files), = data["layers"].items()
    if "adapter" in files:  # one data file: train_exit writes its table without the file level
        files = {Path(next(iter(data["data"]))).name: files}
    out = {"layer": int(layer), "init_from": data.get("init_from"), "hard": data.get("hard"),
           "positions": data["positions"], "files": {}}
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--arm", action="append", required=True, metavar="NAME=DIR",
                        help="a train_exit output directory (its coverage.json) and the arm's name")
    parser.add_argument("--eval", action="append", default=[], metavar="NAME=BEFORE,AFTER",
                        help="two models.evaluate files of one prompt set, before and after")
    parser.add_argument("--what", default=__doc__.split("\n\n")[0], help="what the A/B asks")
    args = parser.parse_args(argv)
    result = {
        "what": args.what,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "pairs_are": "[the adapter continued from (committed before), this arm]",
        "arms": {name: arm(directory) for name, _, directory in (a.partition("=") for a in args.arm)},
        "runtime": [evaluation(e) for e in args.eval],
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
