"""report.md from the bench.json document: every number here is read from the document, none is written in."""

from __future__ import annotations

from typing import Any

from mirror_sd.models.benchmark_prompts import KINDS

# What each method is (text, not figures): the report says what was compared with what.
WHAT = {
    "ar": "the project's target alone (ONNX Runtime, prefix + suffix graphs), at its best target thread count",
    "sd": "the project's speculative decoding: windows from the bundle's draft (its runtime: Machine and settings), "
          "or copied from the text (prompt lookup), verified by the target serially, under the speculation gate",
    "mirror": "the project's Mirror-SD: early-exit candidates, branch rollouts on the draft thread under the suffix",
    "hf-generate": "transformers generate, the fp32 target alone (PyTorch)",
    "hf-assisted": "transformers assisted generation (assistant_model=) with the baseline draft (below) in its plain "
                   "form: over the full vocabulary, one token per forward, stream heads dropped",
    "ov-genai-ar": "OpenVINO GenAI LLMPipeline, the same fp32 target converted to OpenVINO IR",
    "ov-genai-sd": "OpenVINO GenAI speculative decoding, the same target and the baseline draft's plain form as "
                   "OpenVINO IR",
    "ov-genai-pld": "OpenVINO GenAI prompt-lookup decoding (n-grams of the prompt as the draft), the same target",
    "ar-openvino": "the project's target alone on OpenVINO (its graphs rewritten without GroupQueryAttention, "
                   "runtime/portable.py): the CPU-only backend",
}


def _f(value: Any, digits: int = 2, suffix: str = "") -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}{suffix}"
    return f"{value}{suffix}"


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1e3:.1f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def render(doc: dict[str, Any]) -> str:
    groups = doc.get("groups", {})
    lines = [f"# Benchmark: {doc['bundle']} ({doc['size']['name']} size)", ""]
    lines += _machine(doc)
    lines += _targets(doc, groups.get("greedy"))
    lines += _compared(doc, groups.get("greedy"))
    if doc.get("not_run"):
        lines += ["## Not run", ""] + [f"- **{m}**: not run: {why}" for m, why in doc["not_run"].items()] + [""]
    if "greedy" in groups:
        lines += _main_group("Greedy (T=0)", groups["greedy"])
        lines += _identity(groups)
    if "sampled" in groups:
        lines += _main_group("Sampled (T=1, the same seed per prompt in every method; no identity check)",
                             groups["sampled"])
    lines += _threads(doc)
    if "greedy" in groups:
        lines += _profile(groups["greedy"], doc.get("timeline"),
                          doc.get("threads", {}).get("sd_mirror", {}).get("branch_budget"))
    if "ablations" in groups:
        lines += _ablations(groups["ablations"])
    if "gamma sweep" in groups:
        lines += _sweep("Speedup against gamma", groups["gamma sweep"], "speedup_vs_gamma.png")
    if "exit sweep" in groups:
        lines += _sweep("Speedup against exit layer", groups["exit sweep"], "speedup_vs_exit_layer.png",
                        extra=("exit_head", "exit head"))
    lines += _compressed(doc.get("compressed_draft"))
    lines += _context(doc.get("context"))
    lines += _precision(doc.get("precision"))
    lines += _serving(doc.get("serving"))
    lines += ["## Plots", "", "![tokens/s per method and task](plots/tokens_per_s.png)", "",
              "![timeline of one mirror generation](plots/timeline.png)", ""]
    return "\n".join(lines) + "\n"


def _sd_threads(t: dict[str, Any], sm: dict[str, Any]) -> str:
    """sd's thread split: ar's best target threads (draft and target take turns), or the plan's in older runs."""
    sd = t.get("sd")
    if sd is None:
        return "the same"
    return f"{sd['target']} target + {sd['draft']} draft (ar's best target threads: draft and target take turns)"


def _baseline_windows(found: dict[str, Any] | None) -> str:
    """The settings line's end: the speculative baselines' windows (each its fastest on the probe, where probed)."""
    if not found:
        return " and the speculative baselines"
    chosen = ", ".join(f"{name} {w['chosen']}" for name, w in found.items())
    speeds = "; ".join(f"{name}: " + ", ".join(f"{k} {v:.1f}" if v else f"{k} -" for k, v in w["tokens_per_s"].items())
                       for name, w in found.items())
    prompts = len(next(iter(found.values()))["prompts"])
    return (f"; the speculative OpenVINO GenAI baselines each at its fastest window, timed on {prompts} prompts "
            f"(one per task kind) before the run: {chosen} (median tokens/s by window: {speeds})")


def _machine(doc: dict[str, Any]) -> list[str]:
    m, size, t = doc["machine"], doc["size"], doc.get("threads", {})
    versions = ", ".join(f"{k} {v}" for k, v in m.get("versions", {}).items())
    git = m.get("git") or {}
    sm = t.get("sd_mirror", {})
    return [
        "## Machine and settings", "",
        f"- CPU: {m['cpu']}, {m['cores']} cores ({m.get('cores_usable')} usable), {m.get('ram_gib')} GiB RAM; "
        f"{m['os']}; Python {m['python']}; load average at start {m.get('load_average')}",
        f"- versions: {versions}",
        f"- git commit {git.get('commit', '?')}"
        f"{' (with uncommitted changes in tracked files)' if git.get('dirty') else ''}",
        f"- size: greedy {size['per_kind']} prompt(s) per task kind, T=1 {size['sampled_prompts']} prompt(s), "
        f"{size['max_new_tokens']} new tokens at most (EOS ends earlier); every method runs every prompt once, "
        "in an order that rotates from prompt to prompt, after one warm-up generation each",
        f"- threads: mirror {sm.get('target')} target + {sm.get('draft')} draft ({sm.get('from')}"
        f"{'; draft on ' + sm['draft_runtime'] if 'draft_runtime' in sm else ''}"
        f"{'; branch budget ' + str(sm['branch_budget']) if sm.get('branch_budget') is not None else ''}); sd "
        f"{_sd_threads(t, sm)}; ar at its "
        f"best of 1 and 2 target threads ({doc.get('ar_threads', {}).get('chosen')}); external baselines were given "
        f"{t.get('baselines')} threads; gamma {t.get('gamma')} for sd and mirror"
        + _baseline_windows(doc.get("baseline_windows")),
        *_huge_pages_line(doc.get("huge_pages")),
        f"- elapsed: {doc.get('elapsed_s', 0) / 60:.1f} min", "",
    ]


def _huge_pages_line(loads: dict[str, Any] | None) -> list[str]:
    """The project's pipelines' weights in huge pages (runtime/huge_pages.py), where the run says."""
    if not loads:
        return []
    said = [f"{name} {r['collapsed_mib']} MiB in {r['seconds']:.1f} s" if r and not r.get("skipped")
            else f"{name} {r['skipped'] if r else 'off'}" for name, r in loads.items()]
    return ["- the project's weights in huge pages after load (runtime/huge_pages.py; the baselines as their runtimes "
            "keep them): " + ", ".join(said)]


def _targets(doc: dict[str, Any], greedy: dict[str, Any] | None) -> list[str]:
    rows = []
    for t in doc.get("targets", []):
        if t["measured"] is None:
            verdict = f"not measured ({t['reason']})"
        elif t["met"]:
            verdict = "met"
        else:
            verdict = f"short by {t['target'] - t['measured']:.2f} ({t['short_by_fraction'] * 100:.0f}% below target)"
        rows.append([t["what"], f">= {t['target']:g}", _f(t["measured"]), str(t["prompts"]), verdict])
    lines = ["## Targets (greedy, median over prompts of per-prompt ratios)", ""]
    lines += _table(["target", "wanted", "measured", "prompts", "verdict"], rows) + [""]
    short = [t for t in doc.get("targets", []) if t["measured"] is not None and not t["met"]]
    if short and greedy:
        lines += ["Why the numbers are short: see *Where the time goes* below (per-step phases of each method).", ""]
    return lines


def _compared(doc: dict[str, Any], greedy: dict[str, Any] | None) -> list[str]:
    if not greedy:
        return []
    lines = ["## What is compared", ""]
    base = doc.get("baseline_draft")  # not recorded by runs before it was
    for method in greedy["methods"]:
        what = WHAT.get(method, "an external method")
        lines.append(f"- **{method}**: {what if base else what.replace(' (below)', '')}")
    if base and any(m in greedy["methods"] for m in ("hf-assisted", "ov-genai-sd")):
        lines.append(f"- The baseline draft: {base['path']}, " + (
            "the bundle's own draft." if base["the_bundles_draft"] else
            f"not the bundle's ({base['bundle_draft']}, which has no plain form): a draft of its own weights, so "
            "these rows compare methods with different drafts."))
    return lines + [""]


def _main_group(title: str, g: dict[str, Any]) -> list[str]:
    rows = []
    for method, s in g["summary"].items():
        o = s["overall"]
        rows.append([method, _f(o["tokens_per_s"], 1), _f(g["ratios_to_ar"][method]["overall"]), _ms(o["ttft_s"]),
                     _f(o["mean_accepted_tokens"]), _f(o["acceptance_rate"]),
                     _f(o.get("conditional_acceptance_rate")), _f(o["branch_hit_rate"]),
                     _f(o["draft_hidden_fraction"]), str(o["runs"])])
    lines = [f"## {title}", "", f"{len(g['prompts'])} prompts, {g['max_new_tokens']} new tokens at most.", ""]
    lines += _table(["method", "tokens/s", "x ar", "TTFT ms", "mean accepted tokens/step", "acceptance",
                     "per-token acceptance", "branch hit rate", "draft hidden", "runs"], rows)
    lines += ["", "Tokens/s and (in brackets) the median per-prompt ratio to ar, per task kind:", ""]
    rows = []
    for method, s in g["summary"].items():
        r = g["ratios_to_ar"][method]["per_kind"]
        rows.append([method, *(f"{_f(s['per_kind'][k]['tokens_per_s'], 1)} ({_f(r[k])})" for k in KINDS)])
    lines += _table(["method", *KINDS], rows) + [""]
    if g.get("not_run"):
        lines += [f"- {m}: not run in this group: {why}" for m, why in g["not_run"].items()] + [""]
    return lines


def _identity(groups: dict[str, Any]) -> list[str]:
    lines = ["## Greedy identity with ar", ""]
    for name, g in groups.items():
        if "identity_failures" not in g:
            continue
        checked = sum(1 for r in g["runs"] if r["method"] != "ar")
        failures = g["identity_failures"]
        if not failures:
            lines.append(f"- {name}: all {checked} greedy outputs are token-identical to ar's.")
            continue
        lines.append(f"- {name}: **{len(failures)} of {checked} outputs differ from ar (FAILURE)**:")
        if any(f["method"] not in WHAT or f["method"].startswith(("hf-", "ov-")) for f in failures):
            lines.append("  (an external runtime computes with other kernels, where a near-tie in the logits can "
                         "flip a greedy token; it is still listed, as any difference is)")
        lines += [f"  - {f['method']} on {f['prompt']}: first difference at token {f['first_difference']} "
                  f"(ar {f['expected']}, got {f['got']}; lengths {f['expected_len']} / {f['got_len']})"
                  for f in failures]
    return lines + [""]


def _threads(doc: dict[str, Any]) -> list[str]:
    a = doc.get("ar_threads")
    if not a:
        return []
    speeds = ", ".join(f"{k}: {_f(v, 1)} tokens/s" for k, v in a["tokens_per_s"].items())
    return ["## ar thread setting", "",
            f"ar timed at 1 and 2 target threads on {len(a['prompts'])} prompts ({speeds}); the faster, "
            f"{a['chosen']} thread(s), is the ar every ratio uses.", ""]


def _profile(g: dict[str, Any], timeline: dict[str, Any] | None, branch_budget: int | None = None) -> list[str]:
    """branch_budget: the plan's (0: branch sets off, measured slower at plan time; None: no plan, or adaptive)."""
    lines = ["## Where the time goes", "",
             "Median per target step (ms). prefix + suffix are the target's two graphs; draft is the draft's "
             "forwards (hidden under the suffix when overlapped, so columns need not add up); wait is the main "
             "thread waiting for the draft; step is the whole call's wall time over its target steps.", ""]
    rows = []
    for method, p in g["profile"].items():
        rows.append([method, _ms(p["prefix_s"]), _ms(p["suffix_s"]), _ms(p["draft_s"]), _ms(p["draft_wait_s"]),
                     _ms(p["step_s"]), _f(p["tokens_per_step"])])
    lines += _table(["method", "prefix", "suffix", "draft", "wait", "step", "tokens/step"], rows) + [""]
    prof = g["profile"]
    if "ar" in prof and "mirror" in prof:
        ar, mi = prof["ar"], prof["mirror"]
        lines += [f"Mirror commits {mi['tokens_per_step']:.2f} tokens per step at {mi['step_s'] * 1e3:.1f} ms a step; "
                  f"ar commits 1 at {ar['step_s'] * 1e3:.1f} ms. At this acceptance, mirror would need a step of at "
                  f"most {mi['tokens_per_step'] * ar['step_s'] / 2 * 1e3:.1f} ms to reach 2x ar; "
                  f"the main thread waits {mi['draft_wait_s'] * 1e3:.1f} ms a step for the draft.", ""]
        kinds = mi.get("step_kinds")
        if kinds and kinds["decode_steps"]:
            share = {k: f"{100 * v / kinds['decode_steps']:.0f}%" for k, v in kinds.items()}
            lines += [f"Of mirror's {kinds['decode_steps']} decode steps, {share['with_branch_set']} verified a draft "
                      f"window with a branch set under the suffix, {share['without_branch_set']} a draft window "
                      + ("without one (the plan's branch budget is 0: `mirror-sd plan` measured mirror faster "
                         "without branch sets on this machine), " if branch_budget == 0 else
                         "without one (the branch gate measured that faster: runtime/gate.py), ") +
                      f"{share['copied_window']} a window copied from the text, and {share['target_alone']} ran on "
                      "the target alone.", ""]
    if timeline:
        rows = [[phase, str(v["count"]), _ms(v["median_s"]), _ms(v["total_s"])]
                for phase, v in sorted(timeline["phases"].items())]
        lines += [f"Traced mirror generation ({timeline['prompt']}, {timeline['new_tokens']} tokens, "
                  f"{timeline['total_s']:.2f} s), per phase:", ""]
        lines += _table(["phase", "intervals", "median ms", "total ms"], rows) + [""]
        lines += ["![timeline](plots/timeline.png)", ""]
    return lines


def _ablations(g: dict[str, Any]) -> list[str]:
    rows = []
    for method, s in g["summary"].items():
        o = s["overall"]
        rows.append([method, _f(o["tokens_per_s"], 1), _f(g["ratios_to_ar"][method]["overall"]),
                     _f(o["mean_accepted_tokens"]), _f(o["branch_hit_rate"]), _f(o["draft_hidden_fraction"]),
                     _f(o["draft_tokens_per_forward"])])
    lines = ["## Ablations (mirror with one mechanism off, greedy)", "",
             f"{len(g['prompts'])} prompts; ar and full mirror run again in the same rotation. no-branches: branch "
             "budget 0 (overlap only, every window a serial rollout); no-streaming: one draft token per forward; "
             "logit-lens: the untrained exit head at the same layer (a bundle exported for it); no-overlap: the "
             "same schedule served serially; no-confidence: draft confidence threshold 0 (every window runs to "
             "gamma; the plan's threshold otherwise); no-gate: every step speculates, with a branch set (otherwise the "
             "speculation gate gives a step to the target alone, and the branch gate a step to no branch set, where "
             "that has been measured faster: runtime/gate.py); no-lookup: every "
             "window from the draft (otherwise a window is copied from the text where its last tokens occurred "
             "before: runtime/prompt_lookup.py)."
             + (" branch-sets: the plan turned branch sets off (branch budget 0: measured slower on this machine, "
                "every draft step sd's), so this row gives mirror a budget of kappa, as the logit-lens row and the "
                "sweeps' mirror rows have; no-gate then means every step speculates, without one."
                if "mirror-branch-sets" in g["summary"] else ""), ""]
    lines += _table(["method", "tokens/s", "x ar", "mean accepted", "branch hit", "draft hidden",
                     "draft tokens/forward"], rows) + [""]
    if g.get("not_run"):
        lines += [f"- {m}: not run: {why}" for m, why in g["not_run"].items()] + [""]
    return lines


def _sweep(title: str, g: dict[str, Any], plot: str, extra: tuple[str, str] | None = None) -> list[str]:
    rows = []
    for method, s in g["summary"].items():
        o = s["overall"]
        row = [method, _f(o["tokens_per_s"], 1), _f(g["ratios_to_ar"][method]["overall"]),
               _f(o["mean_accepted_tokens"]), _f(o["branch_hit_rate"]), _f(o["draft_hidden_fraction"])]
        if extra:
            row.append(str(g["methods"].get(method, {}).get(extra[0], "")))
        rows.append(row)
    header = ["method", "tokens/s", "x ar", "mean accepted", "branch hit", "draft hidden"]
    lines = [f"## {title}", "", f"{len(g['prompts'])} prompts, greedy; every step speculates with the draft (no "
             "speculation gate, no prompt lookup), so each setting's own speed shows.", ""]
    lines += _table(header + ([extra[1]] if extra else []), rows) + [""]
    if g.get("not_run"):
        lines += [f"- {m}: not run: {why}" for m, why in g["not_run"].items()] + [""]
    return lines + [f"![{title}](plots/{plot})", ""]


def _compressed(c: dict[str, Any] | None) -> list[str]:
    lines = ["## Compressed draft", ""]
    if not c or "not_run" in c:
        return lines + [f"Not run: {(c or {}).get('not_run', 'no result')}.", ""]
    import json

    return lines + ["```json", json.dumps(c, indent=2, default=str), "```", ""]


def _context(c: dict[str, Any] | None) -> list[str]:
    if not c or not c.get("per_length"):
        return []
    lengths = list(c["per_length"])
    methods = [m for m in ("ar", "sd", "mirror", "ar-openvino", "ov-genai-ar", "ar@1t", "ar@2t", "ov-genai-ar@1t",
                           "ov-genai-ar@2t") if any(m in c["per_length"][n]["methods"] for n in lengths)]

    def cell(n: str, m: str, key: str, scale: float = 1.0, digits: int = 1) -> str:
        row = c["per_length"][n]["methods"].get(m)
        return "–" if not row or row.get(key) is None else f"{row[key] * scale:.{digits}f}"

    sm = c["threads"]["sd_mirror"]
    sd = c["threads"].get("sd", sm)
    lines = ["## Context length (time to first token, decode speed)", "",
             f"Prompts of {', '.join(lengths)} tokens of real text (Python's documentation under a summarisation "
             f"request, chat template applied, another passage for every run), {c['repeats']} prompt(s) per length, "
             f"{c['new_tokens']} new tokens, greedy; medians. ar is the faster of 1 and 2 target threads at each "
             f"length and OpenVINO GenAI ar the faster of its 1 and 2 threads (which one: the @ rows); sd runs "
             f"{sd[0]} target + {sd[1]} draft threads, mirror {sm[0]} + {sm[1]}. Decode tokens/s = (new tokens - 1) "
             "/ (total - TTFT).", ""]
    rows = [[m, *(cell(n, m, "ttft_s", 1e3, 0) for n in lengths)] for m in methods]
    lines += ["TTFT (ms):", ""] + _table(["method", *lengths], rows) + [""]
    rows = [[m, *(cell(n, m, "decode_tokens_per_s") for n in lengths)] for m in methods]
    lines += ["Decode tokens/s:", ""] + _table(["method", *lengths], rows) + [""]
    rows = []
    for n in lengths:
        k = c["per_length"][n].get("kernels", {})
        rows.append([n, _ms(k.get("step_1_s")), _ms(k.get("step_5_s")), _f(k.get("verify_5_over_1")),
                     _ms(k.get("unsplit_step_1_s")), _f(k.get("split_over_unsplit")),
                     _f(k.get("split_over_unsplit_5"))])
    lines += ["The target alone after the prompt (ms per step): 1 and 5 new tokens, and the split target (prefix + "
              "suffix sessions) against one graph of both:", ""]
    lines += _table(["prompt tokens", "1-token step", "5-token step", "5 / 1", "unsplit 1-token", "split / unsplit",
                     "split / unsplit (5)"], rows) + [""]
    verdicts = [(f"{m} at {n}", same) for n in lengths for m, same in c["per_length"][n]["identical_to_ar"].items()]
    differ = [what for what, same in verdicts if same is False]
    unchecked = [what for what, same in verdicts if same is None]
    lines.append("Greedy outputs: " + ("all token-identical to ar's." if not differ else
                                       "**differ from ar: " + ", ".join(differ) + "**")
                 + (f" Not compared (runs missing): {', '.join(unchecked)}." if unchecked else ""))
    lines += _bars("Issue 11's bars, from this run:", c)
    return lines + ["![time to first token and decode speed against prompt length](plots/context_length.png)", ""]


def _precision(p: dict[str, Any] | None) -> list[str]:
    if not p or not p.get("speed"):
        return []
    lengths = list(p["speed"])
    arms = list(dict.fromkeys(a for n in lengths for a in p["speed"][n]))

    def cell(n: str, arm: str, key: str, scale: float = 1.0, digits: int = 1) -> str:
        row = p["speed"][n].get(arm)
        return "–" if not row or row.get(key) is None else f"{row[key] * scale:.{digits}f}"

    lines = ["## Precision (the target's weight formats beside OpenVINO GenAI at its defaults)", "",
             f"Ours: {', '.join(f'{f} ({b})' for f, b in p['bundles'].items())}. OpenVINO GenAI: {p['genai']}, on "
             "the float32 target and on the target with NNCF int8 / int4 weights. ar at "
             f"{p['threads']} threads each, {p['new_tokens']} new tokens, {p['repeats']} prompt(s) per length of "
             "real text, greedy; medians.", ""]
    lines += ["TTFT (ms):", ""] + _table(["arm", *lengths], [[a, *(cell(n, a, "ttft_s", 1e3, 0) for n in lengths)]
                                                            for a in arms]) + [""]
    lines += ["Decode tokens/s:", ""] + _table(["arm", *lengths], [[a, *(cell(n, a, "decode_tokens_per_s")
                                                                          for n in lengths)] for a in arms]) + [""]
    prompts = p["prompts"]
    lines += [f"The benchmark's prompts ({prompts['prompts']}, whole call, prefill included), median tokens/s:", ""]
    lines += _table(["method", "tokens/s"], [[m, _f(v, 1)] for m, v in prompts["tokens_per_s"].items()]) + [""]
    rows = [[f, _f(a["top1_per_position"], 3), _f(a.get("top1_float32_activations"), 3),
             f"{a['greedy_answers_differ']} of {a['answers']}", _f(a["median_first_divergence"], 0)]
            for f, a in p["agreement"].items()]
    lines += ["Agreement with float32 (top-1 per position on float32's greedy answers; the same weights with float32 "
              "activations where the kernel rounds them to int8, which tells the weights' share of the difference "
              "from the kernel's):", ""]
    lines += _table(["format", "top-1", "top-1, float32 activations", "greedy answers that differ",
                     "median first divergence"], rows) + [""]
    for fmt, a in p["agreement"].items():  # issue 57 asks why, where int8 keeps less than its bar
        if a.get("top1_float32_activations") is not None:
            kernel = a["top1_float32_activations"] - a["top1_per_position"]  # what int8 activations cost
            weights = 1.0 - a["top1_float32_activations"]  # what the rounded weights cost
            why = ("the kernel's int8 activations, the path its fast decode takes" if kernel > weights else
                   "its weights' rounding")
            lines += [f"{fmt} keeps float32's token at {_f(a['top1_per_position'], 3)} of positions, its weights with "
                      f"float32 activations at {_f(a['top1_float32_activations'], 3)}: most of the difference is "
                      f"{why}.", ""]
    failures = prompts.get("failures", [])
    lines.append("Each format's planned mode against its own ar: " + (
        "token-identical on every prompt." if not failures else
        "**differs: " + ", ".join(f"{f['format']} on {f['prompt']} at token {f['first_difference']}"
                                  for f in failures) + "**"))
    recommended = p.get("recommended")
    if recommended:
        lines += ["", f"Recommended on this machine: **{recommended['format']}** ({recommended['why']}; top-1 "
                      f"agreement with float32 {_f(recommended['top1_vs_float32'], 3)})."]
    return lines + _bars("Issue 57's bars, from this run:", p)


def _bars(title: str, section: dict[str, Any]) -> list[str]:
    """A section's bars (bench/summary.py verdicts) as a table under `title`, then what did not run."""
    rows = [[t["what"], ("<= " if not t["higher_is_better"] else ">= ") + f"{t['target']:g}", _f(t["measured"]),
             "met" if t["met"] else ("not measured" if t["measured"] is None else "not met")]
            for t in section["targets"]]
    lines = ["", title, ""] + _table(["bar", "wanted", "measured", "verdict"], rows) + [""]
    if section.get("not_run"):
        lines += [f"- not run: {m}: {why}" for m, why in section["not_run"].items()] + [""]
    return lines


SERVING_WHAT = {  # the serving section's series (bench/serving.py)
    "ar": "our server, every request `\"mirror\": {\"mode\": \"ar\"}`",
    "sd": "our server, every request in sd mode (a request alone speculates; several share batched target steps)",
    "mirror": "our server, every request in mirror mode (alone: Mirror-SD; several: batched target steps)",
    "planned": "our server, requests without a mode: the server's default, from the bundle plan",
    "ov-genai-cb": "OpenVINO GenAI's ContinuousBatchingPipeline, the same fp32 target and fp32 KV cache",
    "ov-genai-cb-sd": "OpenVINO GenAI's ContinuousBatchingPipeline with its speculative decoding and the plain "
                      "draft (as ov-genai-sd)",
}


def _serving(s: dict[str, Any] | None) -> list[str]:
    if not s:
        return []
    lines = ["## Serving (concurrent clients)", ""]
    if "points" not in s:
        return lines + [f"Not run: {s.get('not_run', 'no result')}.", ""]
    st, server = s["settings"], s["server"]
    requests = ", ".join(f"{n} at {c}" for c, n in st["requests"].items())
    lines += [f"`{' '.join(server['command'][:3])} ... --max-context {st['max_context']} --max-num-seqs "
              f"{st['max_num_seqs']} --max-queue {st['max_queue']}` in its own process (ready after "
              f"{server['startup_s']:.1f} s; target {server['target_device']}, draft {server['draft_device']}; "
              f"{st['server_threads']['target']} target + {st['server_threads']['draft']} draft threads); clients are "
              "threads of the benchmark speaking HTTP, each sending its next streaming chat request as soon as its "
              f"last is answered (a closed loop), greedy, {st['max_tokens']} new tokens at most; requests per point "
              f"and round: {requests} ({st.get('rounds', 1)} round(s) pooled), over {st['distinct_prompts']} "
              "distinct prompts (the benchmark's own, then each under a "
              "system message), the server's prefix cache flushed before every point. tokens/s = completion tokens "
              "/ the point's wall time; latency = request sent -> last chunk; TTFT = request sent -> first text, "
              "queueing included. The server's default mode (the planned series): "
              f"{server.get('default_mode')}. GenAI: {st['genai_threads']} threads, prefix caching off, "
              f"speculative window {st['genai_gamma']}; its clients are simulated in the loop that steps the "
              "pipeline, in-process (no HTTP), and its times end with the step that gave the token.", ""]
    lines += ["The issue's bars, from this run:", ""]
    rows = [[t["what"], ("<= " if not t["higher_is_better"] else ">= ") + f"{t['target']:g}", _f(t["measured"]),
             "met" if t["met"] else (f"not measured ({t['reason']})" if t["measured"] is None else "not met")]
            for t in s["targets"]]
    lines += _table(["bar", "wanted", "measured", "verdict"], rows) + [""]
    genai = s["points"].get("ov-genai-cb", {})
    for series, points in s["points"].items():
        if not points:
            continue
        lines += [f"**{series}**: {SERVING_WHAT.get(series, series)}", ""]
        rows = []
        for clients, p in points.items():
            base = (genai.get(clients) or {}).get("tokens_per_s")
            rows.append([clients, str(p["requests"]), _f(p["tokens_per_s"], 1),
                         _f(p["tokens_per_s"] / base if base and p["tokens_per_s"] else None),
                         _f(p["latency_s"]["p50"]), _f(p["latency_s"]["p99"]), _ms(p["ttft_s"]["p50"]),
                         _ms(p["ttft_s"]["p99"]), str(p["errors"])])
        lines += _table(["clients", "requests", "tokens/s", "x GenAI CB", "p50 latency s", "p99 latency s",
                         "p50 TTFT ms", "p99 TTFT ms", "errors"], rows) + [""]
    ours = [p for series, points in s["points"].items() if not series.startswith("ov-") for p in points.values()
            if "prefix_cache" in p]
    if ours:
        hits, spared = (sum(p["prefix_cache"][k] for p in ours) for k in ("hits", "tokens"))
        lines += [f"Prefix cache within our points (the flush before each leaves nothing from earlier ones): {hits:g} "
                  f"requests found a head their prompts share cached, sparing {spared:g} of "
                  f"{sum(p['prompt_tokens'] for p in ours)} prompt tokens; GenAI runs these points without prefix "
                  "caching.", ""]
    ident = s["identity"]
    if not ident["failures"]:
        lines.append(f"Greedy identity: all {ident['checked']} answers of ours (every mode, every client count) equal "
                     "their prompt's solo ar output from the library (text and token count).")
    else:
        lines.append(f"Greedy identity: **{len(ident['failures'])} of {ident['checked']} answers differ from their "
                     "prompt's solo ar output (FAILURE)**:")
        lines += [f"  - {f['method']} at {f['clients']} clients on {f['prompt']}: from character "
                  f"{f['first_difference_char']} expected {f['expected']!r}, got {f['got']!r} (tokens "
                  f"{f['expected_tokens']} / {f['got_tokens']})" for f in ident["failures"]]
    if ident.get("genai_differ"):
        lines.append("GenAI's outputs that differ from the same solo ar tokens (another runtime's kernels may flip a "
                     "near-tie): " + ", ".join(f"{k} {v}" for k, v in ident["genai_differ"].items()) + ".")
    lines += [""] + _multi_turn(s.get("multi_turn"))
    if s.get("not_run"):
        lines += [f"- not run: {m}: {why}" for m, why in s["not_run"].items()] + [""]
    return lines + ["![aggregate tokens/s against concurrent clients](plots/serving.png)", ""]


def _multi_turn(m: dict[str, Any] | None) -> list[str]:
    if not m:
        return []
    rows = [[f"ours, {name}", *_turns(r)] for name, r in m["ours"].items()]
    if m.get("genai"):
        rows.append(["OpenVINO GenAI CB", *_turns(m["genai"])])
    return [f"Multi-turn: a chat whose turn 1 is {', '.join(map(str, m['turn1_prompt_tokens']))} prompt tokens of "
            "Python's documentation under a request to summarise it; turn 2 (turn 1, the answer and a follow-up: "
            f"{', '.join(map(str, m['turn2_prompt_tokens']))} tokens) right after it, with the prefix cache, and "
            "again after a flush of every KV slot (nothing cached; GenAI: on its pipeline without prefix caching). "
            "Medians over the chats.", "",
            *_table(["", "turn 1 TTFT ms", "turn 2 TTFT ms", "turn 2 without cache ms", "turn 2 / turn 1",
                     "without cache / turn 1"], rows), ""]


def _turns(r: dict[str, Any]) -> list[str]:
    return [_ms(r["turn1_ttft_s"]), _ms(r["turn2_ttft_s"]), _ms(r["turn2_no_cache_ttft_s"]),
            _f(r["turn2_over_turn1"], 3), _f(r["turn2_no_cache_over_turn1"])]
