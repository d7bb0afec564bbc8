"""Writing a benchmark's outputs: bench.json, report.md and plots/*.png, all or nothing.

Everything is written into a staging directory next to OUT and moved into place at the end, so an interrupted or
failed write never leaves a half-written result (an older result in OUT stays until the new one is complete).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mirror_sd.bench.plots import write_plots
from mirror_sd.bench.report import render
from mirror_sd.errors import BadInputError
from mirror_sd.outputs import check_apart, check_name, staged

RESULT_FILE = "bench.json"


def check_out(out: Path) -> None:
    """OUT may be missing, empty, or an earlier benchmark result (replaced); anything else is refused."""
    check_name(out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / RESULT_FILE).is_file())):
        raise BadInputError(f"--out {out} exists and is not an earlier benchmark result; choose another directory")
    check_apart(out, "benchmark result", ())  # a folder that cannot be made is refused before an hour's run


def write_outputs(doc: dict[str, Any], out: Path) -> list[Path]:
    check_out(out)
    with staged(out) as staging:
        (staging / RESULT_FILE).write_text(json.dumps(doc, indent=1, default=_plain) + "\n")
        (staging / "report.md").write_text(render(doc))
        write_plots(doc, staging / "plots")
    return sorted(p for p in out.rglob("*") if p.is_file())


def _plain(value: Any) -> Any:
    """numpy scalars and tuples that reach the document become plain JSON values."""
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return str(value)
