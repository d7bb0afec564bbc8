"""The package format (`make package`): plain data, validation and file checks. No runtimes here.

A package is a directory (or a .tar of one, members at its root) holding
  package.json            this format: version, static bounds, devices, weights, draft graphs, sha256 of every file
  manifest.json           the bundle's manifest, its draft partition rewritten to describe the static decode graph
  target_prefix.onnx, target_suffix.onnx, tokenizer files, draft_vocab.json, plan.json   copied from the bundle
  draft/<variant>.xml + draft/*.bin   the draft as static OpenVINO IR, one graph per fixed shape

`PackageInfo.load(dir)` refuses an unknown format version, a listed path that is absolute, contains `..` or is
a symbolic link, a missing file, a file whose sha256 differs, and a file the package does not list.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from mirror_sd.errors import PackageError
from mirror_sd.partitions.spec import to_json

# 2: the static draft graphs read a split past (the context lane whole, plus an own past of own_slots slots)
PACKAGE_FORMAT_VERSION = 2
PACKAGE_FILE = "package.json"
PACKAGE_KIND = "mirror-sd-package"
WEIGHTS = ("fp32", "fp16", "int8_sym", "int8_asym", "int4_sym")
WEIGHT_ALIASES = {"int8": "int8_sym", "int4": "int4_sym"}  # NPUs want symmetric weights
DEVICES = ("NPU", "CPU", "GPU")
# The static draft graphs: which shape serves which call (runtime/static_draft.py)
DECODE, BRANCH, PREFILL = "decode", "branch", "prefill"


@dataclass(frozen=True)
class StaticBounds:
    """What the static shapes admit. kv_length is the KV buffer every draft graph attends over."""

    max_prompt: int  # prompt tokens (after the chat template)
    max_context: int  # prompt + new tokens
    max_gamma: int  # the longest draft window a generation may ask for
    batch: int  # rows of the branch graph (branch rollouts are split or padded to it)
    tokens_per_forward: int  # new tokens per forward of the decode and branch graphs
    prefill_chunk: int  # new tokens per forward of the prefill graph (batch 1)

    @property
    def kv_length(self) -> int:
        """The draft's context lane: the committed context (< max_context) plus the window tokens a rollout feeds
        (< max_gamma) and one forward's proposals; a margin of one chunk on top."""
        return self.max_context + 2 * self.max_gamma + max(self.tokens_per_forward, self.prefill_chunk)

    @property
    def own_slots(self) -> int:
        """A row's own past: the tokens it lacks of its context when it leaves the lane (a branch's window part and
        correction, <= max_gamma + 1) and those it feeds while rolling out (< max_gamma), with the holes of
        rejected proposals and left padding, which the runtime compacts away when they no longer fit."""
        return 4 * (self.max_gamma + self.tokens_per_forward)

    def check(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PackageError(f"package bound {name} must be an integer >= 1, got {value!r}")
        if self.max_prompt > self.max_context:
            raise PackageError(f"max_prompt {self.max_prompt} exceeds max_context {self.max_context}")


@dataclass(frozen=True)
class DraftGraph:
    """One static draft graph: its IR files and the fixed batch and new-token count it was built for."""

    xml: str
    bin: str
    batch: int
    tokens: int


@dataclass(frozen=True)
class PackageInfo:
    bounds: StaticBounds
    weights: str  # one of WEIGHTS
    group_size: int  # int4 only (0 otherwise): weights per quantisation group
    devices: tuple[str, ...]  # intended OpenVINO devices for the draft, first preferred
    draft_graphs: dict[str, DraftGraph]  # DECODE, BRANCH, PREFILL
    files: dict[str, str]  # relative path -> sha256, every file but package.json
    producer: str = ""
    source_bundle: str = ""  # the bundle's producer line, for the record
    # graph_sha256 of the bundle's draft graph the static draft was made from: tells a cached package from a stale
    # one (empty in packages made before it was recorded)
    source_draft_sha256: str = ""
    format_version: int = PACKAGE_FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        d = {"kind": PACKAGE_KIND, **to_json(self)}
        d["bounds"].update(kv_length=self.bounds.kv_length, own_slots=self.bounds.own_slots)  # for the reader
        return {k: d[k] for k in ("kind", "format_version", "producer", "source_bundle", "source_draft_sha256",
                                  "bounds", "weights", "group_size", "devices", "draft_graphs", "files")}

    @classmethod
    def from_dict(cls, d: Any) -> PackageInfo:
        if not isinstance(d, dict) or d.get("kind") != PACKAGE_KIND:
            raise PackageError(f"{PACKAGE_FILE} is not a mirror-sd package description")
        version = d.get("format_version")
        if version != PACKAGE_FORMAT_VERSION:
            raise PackageError(f"package format_version {version!r} is not supported (this build reads "
                               f"{PACKAGE_FORMAT_VERSION})")
        try:
            bounds = StaticBounds(**{k: v for k, v in d["bounds"].items() if k not in ("kv_length", "own_slots")})
            graphs = {k: DraftGraph(**g) for k, g in d["draft_graphs"].items()}
            info = cls(bounds=bounds, weights=d["weights"], group_size=int(d["group_size"]),
                       devices=tuple(d["devices"]), draft_graphs=graphs, files=dict(d["files"]),
                       producer=str(d.get("producer", "")), source_bundle=str(d.get("source_bundle", "")),
                       source_draft_sha256=str(d.get("source_draft_sha256", "")), format_version=version)
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise PackageError(f"{PACKAGE_FILE} is malformed: {type(e).__name__}: {e}") from None
        info.validate()
        return info

    def validate(self) -> None:
        self.bounds.check()
        if self.weights not in WEIGHTS:
            raise PackageError(f"package weights {self.weights!r} unknown (known: {', '.join(WEIGHTS)})")
        if set(self.draft_graphs) != {DECODE, BRANCH, PREFILL}:
            raise PackageError(f"package draft_graphs must be {DECODE}, {BRANCH} and {PREFILL}")
        if not self.devices or any(dev not in DEVICES for dev in self.devices):
            raise PackageError(f"package devices {list(self.devices)} must be among {', '.join(DEVICES)}")
        for rel in self.files:
            check_member_name(rel)
        for g in self.draft_graphs.values():
            for rel in (g.xml, g.bin):
                if rel not in self.files:
                    raise PackageError(f"draft graph file {rel!r} is not among the package's checksummed files")

    # -- files -----------------------------------------------------------------------------------------------
    def save(self, package_dir: Path) -> None:
        (package_dir / PACKAGE_FILE).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, package_dir: str | os.PathLike) -> PackageInfo:
        """Read package.json and check every file of the directory against it (see the module docstring)."""
        root = Path(package_dir)
        try:
            raw = json.loads((root / PACKAGE_FILE).read_text())
        except FileNotFoundError:
            raise PackageError(f"{str(root)!r} has no {PACKAGE_FILE}: not a package") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PackageError(f"cannot read {PACKAGE_FILE}: {e}") from None
        info = cls.from_dict(raw)
        verify_files(root, info.files)
        return info


def normalize_weights(weights: str) -> str:
    w = WEIGHT_ALIASES.get(weights.lower(), weights.lower())
    if w not in WEIGHTS:
        raise PackageError(f"unknown weights {weights!r}; known: fp32, fp16, int8 (= int8_sym), int8_asym, "
                           f"int4 (= int4_sym)")
    return w


def check_member_name(rel: str) -> None:
    """A package member must land inside the package: relative, no `..`, no backslashes or empty parts."""
    if "\\" in rel or Path(rel).is_absolute() or any(part in ("", ".", "..") for part in rel.split("/")):
        raise PackageError(f"package member {rel!r} would land outside the package directory")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def graph_sha256(root: Path, files: tuple[str, ...]) -> str:
    """One digest of a graph's files (its .onnx and any external-data files, where a large graph's weights live,
    so a retrained draft changes it even when its .onnx does not)."""
    h = hashlib.sha256()
    for name in files:
        h.update(f"{name} {sha256_of(Path(root) / name)}\n".encode())
    return h.hexdigest()


def verify_files(root: Path, files: dict[str, str]) -> None:
    """Every listed file is a regular file (no symbolic link on the way) with its sha256; nothing else is there."""
    root = Path(root)
    for rel, digest in files.items():
        check_member_name(rel)
        path = root / rel
        parts = PurePosixPath(rel).parts
        if any(root.joinpath(*parts[:i]).is_symlink() for i in range(1, len(parts) + 1)):  # the file or a folder
            raise PackageError(f"package member {rel!r} is a symbolic link: refused")
        if not path.is_file():
            raise PackageError(f"package file {rel!r} is missing")
        if sha256_of(path) != digest:
            raise PackageError(f"package file {rel!r} does not match its sha256 in {PACKAGE_FILE}: refused")
    present = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + [d for d in dirnames if (Path(dirpath) / d).is_symlink()]:
            rel = (Path(dirpath) / name).relative_to(root).as_posix()
            if (Path(dirpath) / name).is_symlink():
                raise PackageError(f"package member {rel!r} is a symbolic link: refused")
            present.add(rel)
    extra = sorted(present - set(files) - {PACKAGE_FILE})
    if extra:
        raise PackageError(f"package holds files it does not list in {PACKAGE_FILE}: {', '.join(extra[:5])}")


def is_package(path: str | Path) -> bool:
    """A directory with package.json, or any file (a bundle is always a directory; a file that is no .tar is
    then refused as an unreadable package)."""
    p = Path(path)
    try:
        return (p.is_dir() and (p / PACKAGE_FILE).is_file()) or p.is_file()
    except OSError as e:  # a folder this user may not read: stat inside it fails
        raise PackageError(f"cannot read {str(p)!r}: {e.strerror or e}") from None
