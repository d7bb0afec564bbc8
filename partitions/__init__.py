"""The partition plan and the bundle manifest, as plain validated data (no torch, no runtimes)."""

from mirror_sd.partitions.manifest import (
    BOUNDARY,
    DRAFT_VOCAB_FILE,
    EXIT_IDS,
    EXIT_LOGPROBS,
    FORMAT_VERSION,
    LOGITS,
    MANIFEST_NAME,
    STREAM_IDS,
    DraftFacts,
    Manifest,
    ModelFacts,
    TargetFacts,
    TokenizerFacts,
)
from mirror_sd.partitions.spec import PartitionSpec, TensorSpec

__all__ = [
    "BOUNDARY", "DRAFT_VOCAB_FILE", "EXIT_IDS", "EXIT_LOGPROBS", "FORMAT_VERSION", "LOGITS", "MANIFEST_NAME",
    "STREAM_IDS", "DraftFacts", "Manifest",
    "ModelFacts", "PartitionSpec", "TargetFacts", "TensorSpec", "TokenizerFacts",
]
