"""Mirror Speculative Decoding: a target LLM on ONNX Runtime and a draft LLM on OpenVINO, run at the same time.

Subpackages: ``mirror_sd.export`` (torch side, writes bundles), ``mirror_sd.partitions`` (the manifest, plain data),
``mirror_sd.runtime`` (no torch: engines and decoding), ``mirror_sd.models`` (recipes for models).
"""

from mirror_sd.errors import MirrorSDError

__version__ = "0.1.0"
__all__ = ["GenerationConfig", "MirrorSDError", "Pipeline", "__version__"]


def __getattr__(name: str):
    # Lazy: `import mirror_sd` stays light; the runtimes load only when the Pipeline is asked for.
    if name == "Pipeline":
        from mirror_sd.runtime.pipeline import Pipeline

        return Pipeline
    if name == "GenerationConfig":
        from mirror_sd.runtime.config import GenerationConfig

        return GenerationConfig
    raise AttributeError(f"module 'mirror_sd' has no attribute {name!r}")
