"""The plan file: plan.json in a bundle directory, written by `mirror-sd plan` (planner.plan_document), read by
the runtime for its defaults and by `mirror-sd export --plan` for its advice.

Its own module so that reading a plan needs neither the cost model nor the search: this is the schema's whole
contract with its readers (file name, format tag and version, the three sections they use, and their checks).
Plain data only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from mirror_sd.errors import BadInputError, check_int
from mirror_sd.partitions.spec import BACKENDS

# how a generation decodes (runtime/config.py GenerationConfig.mode); a plan picks one
MODES = ("ar", "lookup", "sd", "mirror")
DRAFT_MODES = ("sd", "mirror")  # the modes that run the draft model (lookup copies its windows from the text)
# what a draft confidence threshold is compared with (runtime/config.py GenerationConfig.draft_confidence_rule)
CONFIDENCE_RULES = ("token", "window")
PLAN_FILE = "plan.json"  # optional file in a bundle directory: the runtime's defaults come from it when present
StepRate = tuple[float, float, int]  # a kind of step as measured: tokens per step, seconds per step, steps
PLAN_FORMAT = "mirror-sd-plan"
PLAN_VERSION = 1


@dataclass(frozen=True)
class RuntimeDefaults:
    """The settings a bundle's plan.json gives the runtime (each overridable per call)."""

    gamma: int
    kappa: int
    branch_budget: int | None  # None: adaptive
    target_threads: int
    draft_threads: int
    # measured on real generations of the chosen setting (runtime/profile.py); a plan without it: 0 (off)
    draft_confidence_threshold: float = 0.0
    # the faster runtime for the draft where it runs on the CPU (no NPU), measured the same way; None: the
    # manifest's (a plan without it, or one made where the draft ran on another device)
    draft_backend: str | None = None
    # what the threshold is compared with (CONFIDENCE_RULES), measured with it; a plan without it: "token"
    draft_confidence_rule: str = "token"
    # the mode a generation that names none runs: "ar" where the target alone at all the cores measured faster than
    # speculating on this machine (runtime/profile.py); a plan without it: "mirror"
    mode: str = "mirror"
    # the batching engine's steps measured per count of rows (1 .. its window rows: one row is left in the batch
    # when the others finish): (rows, window steps, plain steps), each kind as (tokens per step, seconds per step,
    # steps measured); its gate per count of rows starts from them (runtime/batching.py). A plan without it: ()
    batch_windows: tuple[tuple[int, StepRate, StepRate], ...] = ()

    def budget_showing_branches(self) -> int | None:
        """Where the plan turned branch sets off (budget 0: measured slower on its machine), the budget the runs
        that measure mirror's branch mechanism use instead: kappa, one row of candidates; None where the plan's own
        budget has branch sets."""
        return self.kappa if self.branch_budget == 0 else None


@dataclass(frozen=True)
class ExportAdvice:
    exit_layer: int
    top_k: int


def read_plan(path: str | Path) -> dict[str, Any]:
    """A plan file, checked: BadInputError if it is unreadable or not a plan of this version."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadInputError(f"cannot read plan {str(path)!r}: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT or doc.get("version") != PLAN_VERSION:
        raise BadInputError(f"{str(path)!r} is not a {PLAN_FORMAT} file of version {PLAN_VERSION}")
    for part in ("bundle", "runtime", "export"):
        if not isinstance(doc.get(part), dict):
            raise BadInputError(f"plan {str(path)!r} has no {part!r} section")
    return doc


def check_depth(doc: Mapping[str, Any], num_layers: int, option: str | None = None) -> None:
    """Refuse a plan measured on a target of another depth (another model): its settings, exit layers among them,
    are that model's. A plan that does not say its depth is taken."""
    planned = doc["bundle"].get("num_layers")
    if planned is not None and (not isinstance(planned, int) or isinstance(planned, bool) or planned < 1):
        raise BadInputError(f"the plan's bundle.num_layers is {planned!r}, not a count of layers", option=option)
    if planned is not None and planned != num_layers:
        raise BadInputError(f"the plan was made for a target of {planned} layers, this one has {num_layers}: run "
                            "`mirror-sd plan` on a bundle of this model", option=option)


def runtime_defaults(doc: Mapping[str, Any], exit_layer: int, top_k: int,
                     num_layers: int | None = None) -> RuntimeDefaults:
    """The runtime section of a plan made for a bundle with this exit layer and top_k (and this many target layers,
    where given); BadInputError if the plan was made for another export (its settings were measured on other graphs)
    or a value is out of range."""
    b, r = doc["bundle"], doc["runtime"]
    if num_layers is not None:
        check_depth(doc, num_layers)
    if b.get("exit_layer") != exit_layer or b.get("top_k") != top_k:
        raise BadInputError(f"the plan was made for exit layer {b.get('exit_layer')} / top_k {b.get('top_k')}, the "
                            f"bundle has {exit_layer} / {top_k}: run `mirror-sd plan` on this bundle again")
    for name, low in (("gamma", 1), ("kappa", 1), ("target_threads", 1), ("draft_threads", 1)):
        check_int(f"plan runtime.{name}", r.get(name), low)
    if r["kappa"] > top_k:
        raise BadInputError(f"plan runtime.kappa {r['kappa']} exceeds the bundle's top_k {top_k}")
    budget = r.get("branch_budget")
    if budget is not None:
        check_int("plan runtime.branch_budget", budget, 0)
    threshold = r.get("draft_confidence_threshold", 0.0)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold < 1:
        raise BadInputError(f"plan runtime.draft_confidence_threshold must be a number in [0, 1), got {threshold!r}")
    backend = r.get("draft_backend")
    if backend is not None and backend not in BACKENDS:
        raise BadInputError(f"plan runtime.draft_backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    rule = r.get("draft_confidence_rule", "token")
    if rule not in CONFIDENCE_RULES:
        raise BadInputError(f"plan runtime.draft_confidence_rule must be one of {', '.join(CONFIDENCE_RULES)}, "
                            f"got {rule!r}")
    mode = r.get("mode", "mirror")
    if mode not in MODES:
        raise BadInputError(f"plan runtime.mode must be one of {', '.join(MODES)}, got {mode!r}")
    return RuntimeDefaults(r["gamma"], r["kappa"], budget, r["target_threads"], r["draft_threads"], float(threshold),
                           backend, rule, mode, _batch_windows(r.get("batch_windows", {})))


def _batch_windows(doc: object) -> tuple[tuple[int, StepRate, StepRate], ...]:
    """plan runtime.batch_windows: {"<rows>": {"windows": [tokens, seconds, steps], "plain": [...]}, ...}."""
    where = "plan runtime.batch_windows"
    if not isinstance(doc, dict):
        raise BadInputError(f"{where} must be an object of row counts, got {doc!r}")
    out = []
    for rows, kinds in doc.items():
        if not (isinstance(rows, str) and rows.isdigit() and int(rows) >= 1):
            raise BadInputError(f"{where} keys must be row counts of 1 or more, got {rows!r}")
        if not isinstance(kinds, dict) or set(kinds) != {"windows", "plain"}:
            raise BadInputError(f"{where}.{rows} must have exactly 'windows' and 'plain', got {kinds!r}")
        rates = []
        for kind in ("windows", "plain"):
            rate = kinds[kind]
            if not (isinstance(rate, list) and len(rate) == 3 and all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in rate)
                    and isinstance(rate[2], int)):
                raise BadInputError(f"{where}.{rows}.{kind} must be [tokens, seconds, steps] >= 0, got {rate!r}")
            rates.append((float(rate[0]), float(rate[1]), rate[2]))
        out.append((int(rows), rates[0], rates[1]))
    return tuple(sorted(out))


def export_advice(doc: Mapping[str, Any]) -> ExportAdvice:
    e = doc["export"]
    check_int("plan export.exit_layer", e.get("exit_layer"), 1)
    check_int("plan export.top_k", e.get("top_k"), 1)
    return ExportAdvice(e["exit_layer"], e["top_k"])


def plan_machine(doc: Mapping[str, Any]) -> dict[str, Any] | None:
    """The machine the plan was measured on ({"cpu", "cores", optionally "isa"}: runtime/machine.py writes it), or
    None for a plan that does not say; BadInputError if the section is malformed."""
    m = doc.get("machine")
    if m is None:
        return None
    if not (isinstance(m, dict) and isinstance(m.get("cpu"), str) and m["cpu"]):
        raise BadInputError(f"plan machine must be an object with a non-empty 'cpu', got {m!r}")
    check_int("plan machine.cores", m.get("cores"), 1)
    isa = m.get("isa")
    if isa is not None and not (isinstance(isa, list) and all(isinstance(f, str) for f in isa)):
        raise BadInputError(f"plan machine.isa must be a list of CPU feature names, got {isa!r}")
    return {"cpu": m["cpu"], "cores": m["cores"], **({"isa": list(isa)} if isa is not None else {})}
