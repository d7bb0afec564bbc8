"""Writing a finished output directory into place, shared by export (bundles), packaging (packages), the
benchmark's results and its converted baselines: build in a staging directory beside OUT, then move it in."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def staging_dir(out: Path) -> Path:
    """A fresh, empty directory beside `out` (same filesystem, so the final rename is atomic) with ordinary
    permissions: mkdtemp makes it private, and what is moved into place should not be."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)
    return staging


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
