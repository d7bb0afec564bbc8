"""Mirror Speculative Decoding: a target LLM on ONNX Runtime and a draft LLM on OpenVINO, run at the same time.

Subpackages: ``mirror_sd.runtime`` (no torch: engines and decoding), ``mirror_sd.partitions`` (the manifest and the
plan, plain data), ``mirror_sd.serve`` (the OpenAI-compatible server), ``mirror_sd.package`` (NPU packages),
``mirror_sd.export`` (torch side, writes bundles), ``mirror_sd.models`` (the drafts' architectures and the real
pair's recipe; ``mirror_sd.models.training`` trains them), ``mirror_sd.bench`` (``make bench``, ``make soak``).
"""

from mirror_sd.errors import MirrorSDError
from mirror_sd.version import __version__

__all__ = ["GenerationConfig", "LoadOptions", "MirrorSDError", "Pipeline", "__version__"]


def __getattr__(name: str):
    # Lazy: `import mirror_sd.errors` (every module's first import) must not load ONNX Runtime and OpenVINO; the
    # runtime loads when the API is asked for.
    if name == "Pipeline":
        from mirror_sd.runtime.pipeline import Pipeline

        return Pipeline
    if name in ("GenerationConfig", "LoadOptions"):
        from mirror_sd.runtime import config

        return getattr(config, name)
    raise AttributeError(f"module 'mirror_sd' has no attribute {name!r}")
