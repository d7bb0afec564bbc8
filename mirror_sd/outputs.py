"""Writing a finished output directory into place, shared by export (bundles), packaging (packages), the
benchmark's results and its converted baselines: build in a staging directory beside OUT, then move it in."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from mirror_sd.errors import BadInputError


def check_out(out: Path, force: bool, marker: str, what: str, inputs: Iterable[str | Path] = ()) -> None:
    """Refuse, before any work, an OUT that would fail only after it or whose replacing would lose what the user
    gave: no name to rename to ("." or ".."), something other than a directory, a directory with files in it (with
    `force`: anything but an earlier `what`, a directory holding `marker`), one that is or holds an input, or a
    place where no directory can be made."""
    check_name(out)
    if out.exists() and not out.is_dir():
        raise BadInputError(f"OUT {str(out)!r} exists and is not a directory")
    check_apart(out, what, inputs)
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise BadInputError(f"OUT {str(out)!r} exists and is not empty (use --force to replace it)")
        if not (out / marker).is_file():
            raise BadInputError(f"OUT {str(out)!r} holds files that are not a {what}: --force replaces an earlier "
                                f"{what} only")


def check_name(out: Path) -> None:
    """Refuse an OUT with no name to rename to ("." or ".."): it is written beside its place, then moved in."""
    if out.name in ("", ".", ".."):
        raise BadInputError(f"OUT {str(out)!r} must name a directory to create or replace")


def check_apart(out: Path, what: str, inputs: Iterable[str | Path], label: str = "OUT") -> None:
    """Refuse an OUT that is, holds or lies inside one of `inputs`, that is a symbolic link (replacing it would
    replace the link, not what it points to), or whose nearest existing folder is not writable. `label`: what the
    messages call `out` (the flag that gave it)."""
    if out.is_symlink():
        raise BadInputError(f"{label} {str(out)!r} is a symbolic link: give the path it points to ({out.resolve()})")
    resolved = out.resolve()
    for given in inputs:
        path = Path(given).expanduser().resolve()
        if path == resolved or resolved in path.parents:
            raise BadInputError(f"{label} {str(out)!r} holds an input ({path}): write the {what} elsewhere")
        if path in resolved.parents:  # what the user gave stays as it was
            raise BadInputError(f"{label} {str(out)!r} lies inside an input ({path}): write the {what} elsewhere")
    ancestor = resolved.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    try:  # what the output's staging directory will need there (os.access says yes to root anywhere)
        os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=ancestor))
    except OSError:
        raise BadInputError(f"cannot create {label} {str(out)!r}: {ancestor} is not a writable directory") from None


@contextmanager
def staged(out: Path, place: Callable[[Path, Path], None] | None = None) -> Iterator[Path]:
    """A fresh, empty directory beside `out` to write into; when the block ends it is put in place by `place`
    (default: `move_into_place`) and removed. On any failure, from the block or from `place`, nothing is left: not
    the staging directory, nor the folders above `out` that were made for it."""
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]  # deepest first
    staging = _staging_dir(out)
    try:
        yield staging
        (place or move_into_place)(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for folder in made:
            try:
                folder.rmdir()
            except OSError:  # something else was written there meanwhile
                break
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _staging_dir(out: Path) -> Path:
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
    try:
        out.rename(aside / out.name)
    except OSError:
        aside.rmdir()
        raise
    try:
        staging.rename(out)
    except OSError:
        (aside / out.name).rename(out)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def write_whole(path: Path, text: str) -> None:
    """Write `path` whole or not at all, as a new file: a hard link to the one it replaces (a package's copy of its
    bundle's plan.json) keeps the old contents."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        partial.write_text(text)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
