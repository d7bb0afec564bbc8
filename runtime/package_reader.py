"""Opening a package (partitions/package_format.py) for the runtime: a directory, or a .tar checked before extraction.

A .tar is read member by member: every member must be a regular file or a directory with a name inside the
package (no absolute path, no `..`, no symbolic or hard link, no device); only then are the files written, one by
one, into a fresh private directory, which is removed when the returned `OpenedPackage` is garbage-collected or
closed. The checksums are then checked on what was written, as for a directory.
"""

from __future__ import annotations

import shutil
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from mirror_sd.errors import PackageError, first_line
from mirror_sd.partitions.package_format import PackageInfo, check_member_name


@dataclass
class OpenedPackage:
    root: Path  # the package directory (the extracted copy for a .tar)
    info: PackageInfo
    _extracted: tempfile.TemporaryDirectory | None = field(default=None, repr=False)  # removed when collected

    def close(self) -> None:
        if self._extracted is not None:
            self._extracted.cleanup()


def open_package(path: str | Path) -> OpenedPackage:
    p = Path(path)
    if p.is_dir():
        return OpenedPackage(p, PackageInfo.load(p))
    if not p.is_file():
        raise PackageError(f"package {str(p)!r} does not exist")
    extracted = tempfile.TemporaryDirectory(prefix="mirror-sd-package-")
    dest = Path(extracted.name)
    try:
        _extract_checked(p, dest)
        return OpenedPackage(dest, PackageInfo.load(dest), extracted)
    except BaseException:
        extracted.cleanup()
        raise


def _extract_checked(tar_path: Path, dest: Path) -> None:
    try:
        with tarfile.open(tar_path, "r:") as tar:  # packages are plain (uncompressed) archives
            members = tar.getmembers()
            seen = set()
            for m in members:  # every member is checked before anything is written
                name = m.name[2:] if m.name.startswith("./") else m.name
                name = name.rstrip("/")
                if not name or name == ".":
                    continue
                check_member_name(name)
                if m.issym() or m.islnk():
                    raise PackageError(f"package member {m.name!r} is a link: refused")
                if not (m.isfile() or m.isdir()):
                    raise PackageError(f"package member {m.name!r} is not a regular file or directory: refused")
                if m.isfile() and name in seen:
                    raise PackageError(f"package member {m.name!r} appears twice: refused")
                seen.add(name)
            for m in members:
                name = (m.name[2:] if m.name.startswith("./") else m.name).rstrip("/")
                if not name or name == "." or not m.isfile():
                    continue
                out = dest / name
                out.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(m)
                with src, open(out, "wb") as f:
                    shutil.copyfileobj(src, f, 1 << 20)
    except (tarfile.TarError, OSError, EOFError) as e:
        raise PackageError(f"cannot read package {str(tar_path)!r} (not a package directory or .tar): "
                           f"{first_line(e)}") from None
