"""The float32 target's ar with the attention kernel off and on (native_attention), one prompt cut from README.md:
TTFT and time per output token from the result's perf_metrics, two calls each. Written on a CPU without AVX-512
(results/kernel-avx2-ab.txt), where the kernel (tuned on AVX-512) ran slower than ONNX Runtime's GroupQueryAttention.

    .venv/bin/python lab/scripts/kernel_avx2_ab.py build/bundles/smollm2-feature --tokens 1024
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mirror_sd.runtime.pipeline import Pipeline


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()
    text = Path("README.md").read_text()
    for native in (False, True):
        pipe = Pipeline.load(args.bundle, native_attention=native, enable_prefix_caching=False)
        ids = pipe.prompt_ids(text)[:args.tokens]
        for rep in range(2):
            r = pipe.generate(ids[rep:], mode="ar", max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
            m = r.perf_metrics
            print(f"native_attention={native} prompt {len(ids) - rep} tokens: TTFT {m.get_ttft().mean:.0f} ms, "
                  f"TPOT {m.get_tpot().mean:.1f} ms, first tokens {list(r.token_ids[:4])}", flush=True)
        pipe.close()


if __name__ == "__main__":
    main()
