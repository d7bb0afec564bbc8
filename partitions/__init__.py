"""The partition plan and the bundle manifest, as plain validated data (no torch, no runtimes). The manifest's
module (partitions/manifest.py) holds the contract between export and runtime; the names users reach for most are
here too."""

from mirror_sd.partitions.manifest import DRAFT_VOCAB_FILE, MANIFEST_NAME, Manifest

__all__ = ["DRAFT_VOCAB_FILE", "MANIFEST_NAME", "Manifest"]
