"""The product's layers import downward only, and no import, at module level or inside a function, closes a cycle.

Each module belongs to one layer; a layer may import the layers listed for it and nothing else. The test reads every
module's syntax tree (nothing is imported), so an import hidden inside a function counts like one at the top; only
what a type checker alone reads (`if TYPE_CHECKING:`) is left out. lab/ is not a package of the product: nothing
may import it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# the folders that install as mirror_sd.<name> (pyproject.toml's package-dir)
FOLDERS = {"mirror_sd": "mirror_sd", "export": "mirror_sd.export", "partitions": "mirror_sd.partitions",
           "runtime": "mirror_sd.runtime", "serve": "mirror_sd.serve", "package": "mirror_sd.package",
           "models": "mirror_sd.models", "bench": "mirror_sd.bench"}

# module name prefix -> layer (the longest matching prefix wins)
LAYER_OF = {
    "mirror_sd": "api",  # the package root: lazily re-exports Pipeline and GenerationConfig
    "mirror_sd.errors": "core",
    "mirror_sd.outputs": "core",
    "mirror_sd.version": "core",
    "mirror_sd.partitions": "partitions",
    "mirror_sd.runtime": "runtime",
    "mirror_sd.serve": "serve",
    "mirror_sd.package": "package",
    "mirror_sd.models": "architectures",  # the torch modules of the drafts and the exit head, tiny test pairs
    "mirror_sd.models.smollm2": "recipes",  # the real pair: committed weights -> a bundle
    "mirror_sd.models.training": "training",
    "mirror_sd.export": "export",
    "mirror_sd.bench": "bench",
    "mirror_sd.demo": "cli",
    "mirror_sd.cli": "cli",
}

ALLOWED = {
    "core": set(),
    "partitions": {"core"},
    "runtime": {"core", "partitions"},
    "api": {"core", "runtime"},
    "serve": {"core", "partitions", "runtime"},
    "package": {"core", "partitions"},
    "architectures": {"core"},
    "export": {"core", "partitions", "runtime", "package", "architectures"},
    "training": {"core", "partitions", "runtime", "export", "architectures"},
    "recipes": {"core", "partitions", "runtime", "export", "architectures", "training"},
    "bench": {"core", "partitions", "runtime", "serve", "package", "export", "architectures", "recipes", "training"},
    "cli": {"core", "api", "partitions", "runtime", "serve", "package", "export", "architectures", "recipes",
            "training", "bench"},
}


def layer_of(module: str) -> str:
    best = max((p for p in LAYER_OF if module == p or module.startswith(p + ".")), key=len)
    return LAYER_OF[best]


def modules() -> dict[str, Path]:
    out = {}
    for folder, package in FOLDERS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            name = ".".join((package, *parts))
            out[name.removesuffix(".__init__")] = path
    return out


def _nodes(tree: ast.AST):
    """Every node, but those under `if TYPE_CHECKING:`: names for type checkers, never imported at run time."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in [child, *_nodes(child)])
            continue
        yield node
        yield from _nodes(node)


def imports(path: Path, module: str) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file that runs, relative ones resolved, at any depth."""
    found = []
    is_package = path.name == "__init__.py"
    for node in _nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((name, node.lineno))
            # `from mirror_sd.models import tiny` imports the submodule mirror_sd.models.tiny
            found += [(f"{name}.{a.name}", node.lineno) for a in node.names]
    return found


def edges() -> list[tuple[str, str, int]]:
    known = modules()
    out = []
    for module, path in known.items():
        for target, line in imports(path, module):
            if target.startswith("lab") or "mirror_sd.lab" in target:
                out.append((module, "lab", line))
            elif target in known and target != module:
                out.append((module, target, line))
    return out


def test_every_module_has_a_layer_and_the_layers_form_no_cycle():
    assert set(ALLOWED) == set(LAYER_OF.values())
    seen: dict[str, int] = {}

    def visit(layer: str, path: tuple[str, ...]) -> None:
        assert layer not in path, f"the layers import each other: {' -> '.join(path + (layer,))}"
        for lower in ALLOWED[layer]:
            visit(lower, path + (layer,))

    for layer in ALLOWED:
        visit(layer, ())
    for module in modules():
        seen[layer_of(module)] = seen.get(layer_of(module), 0) + 1
    assert set(seen) == set(ALLOWED), f"layers without a module: {set(ALLOWED) - set(seen)}"


def test_imports_go_downward_only():
    bad = []
    for module, target, line in edges():
        if target == "lab":
            bad.append(f"{module}:{line} imports lab/ (experiments; nothing in the product imports them)")
            continue
        src, dst = layer_of(module), layer_of(target)
        if src != dst and dst not in ALLOWED[src]:
            bad.append(f"{module}:{line} ({src}) imports {target} ({dst})")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_import_cycle_between_modules():
    """Not even through an import inside a function: such an import would only hide the cycle."""
    graph: dict[str, set[str]] = {}
    for module, target, _line in edges():
        if target != "lab" and not target.startswith(module + "."):  # a package importing its own submodule
            graph.setdefault(module, set()).add(target)
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(nxt):] + [node, nxt]))
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_the_layering_test_sees_a_forbidden_edge(tmp_path):
    """The checker itself: a runtime module importing the models' training code is reported."""
    path = tmp_path / "bad.py"
    path.write_text("def f():\n    from mirror_sd.models.training import answers\n")
    found = imports(path, "mirror_sd.runtime.bad")
    assert ("mirror_sd.models.training.answers", 2) in found
    assert layer_of("mirror_sd.models.training.answers") not in ALLOWED[layer_of("mirror_sd.runtime.bad")]
