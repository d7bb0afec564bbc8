"""The attention kernel's source broken by hand, each copy compiled and put through the check a fresh build gets
(runtime/cpu_attention_check.py): prints what the check says of each (None: the broken copy would have been kept).

    .venv/bin/python lab/scripts/kernel_check_mutations.py [scratch folder]
"""

import subprocess
import sys
import tempfile
from pathlib import Path

from mirror_sd.runtime import cpu_attention
from mirror_sd.runtime import cpu_attention_check as check

BROKEN = {  # what breaks: (source text, its replacement)
    "each row reads row 0's transposed keys": ("kb = s.kt + ((b * s.attrs.kv_heads + kv)",
                                              "kb = s.kt + ((0 * s.attrs.kv_heads + kv)"),
    "head 128's keys transposed as 64's": ("case 128: return transpose<128>(keys, out, n, D);",
                                           "case 128: return transpose<64>(keys, out, n, D);"),
    "the values past a partial rotary zeroed": ("for (int64_t i = rotary; i < head_dim; ++i) out[i] = x[i];",
                                                "for (int64_t i = rotary; i < head_dim; ++i) out[i] = 0.f;"),
    "new keys left unturned": ("        if (rotary) {\n          rotate(ks",
                               "        if (!rotary) {\n          rotate(ks"),
    "each query blind to its own key": ("return std::min(past + t, s.capacity - 1);",
                                        "return std::min(past + t - 1, s.capacity - 1);"),
}


def main(scratch: Path) -> None:
    source = cpu_attention.SOURCES[0].read_text()
    (scratch / cpu_attention.SOURCES[1].name).write_bytes(cpu_attention.SOURCES[1].read_bytes())
    for n, (what, (text, replacement)) in enumerate(BROKEN.items()):
        if text not in source:
            print(f"{what}: the source no longer has {text!r}")
            continue
        (scratch / "attention.cc").write_text(source.replace(text, replacement, 1))
        lib = scratch / f"lib{n}.so"
        subprocess.run(["g++", *cpu_attention.FLAGS, "-o", str(lib), str(scratch / "attention.cc")], check=True)
        print(f"{what}: {check.disagreement(lib, cpu_attention.DOMAINS)}", flush=True)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tmp))
