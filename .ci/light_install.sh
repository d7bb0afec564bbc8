#!/usr/bin/env bash
# `pip install .` alone (the runtime: no extras) into a fresh environment must not bring torch, and `mirror-sd
# generate` must run from it on a bundle exported by the full environment (.venv, made by `make setup`).
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

.venv/bin/python -m mirror_sd.demo --tiny > "$work/demo.log"  # exports build/bundles/tiny where it is missing
# the tracked files only, so that the wheel's build leaves nothing in this checkout's build/
mkdir "$work/src"
git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$work/src"
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet -c constraints.txt "$work/src"
if "$work/venv/bin/python" -c "import torch" 2> /dev/null; then
  echo "light install: torch came with 'pip install .'" >&2
  exit 1
fi
"$work/venv/bin/mirror-sd" generate build/bundles/tiny --prompt "Hello there" --mode mirror --max-new-tokens 8 \
  --json > "$work/out.json"
"$work/venv/bin/python" - "$work/out.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
assert len(doc["token_ids"]) == 8, doc
print(f"light install: no torch; mirror-sd generate gave {len(doc['token_ids'])} tokens "
      f"({doc['stats']['mode']}, {doc['stats']['tokens_per_second']:.0f} tok/s)")
PY
