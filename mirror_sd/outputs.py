"""Writing a finished output directory into place, shared by export (bundles) and packaging (packages)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path


def move_into_place(staging: Path, out: Path) -> None:
    """Rename the finished `staging` directory to `out`. An existing `out` (callers allow that only with --force) is
    moved aside first and removed only once the new one is in place, so a failure never leaves neither."""
    if not out.exists():
        staging.rename(out)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    out.rename(aside / out.name)
    try:
        staging.rename(out)
    except OSError:
        (aside / out.name).rename(out)
        raise
    shutil.rmtree(aside, ignore_errors=True)
