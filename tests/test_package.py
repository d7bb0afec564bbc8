"""NPU packages (make package): static draft IR, exact output, compressed drafts, and every bad input.

Packages are built from the session's tiny bundles (tests/conftest.py) and run on OpenVINO CPU with exactly the
static shapes an NPU would get.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from conftest import fails_on

from mirror_sd.errors import BadInputError, PackageError
from mirror_sd.outputs import write_whole
from mirror_sd.package.build import PackageOptions, build_package
from mirror_sd.partitions.package_format import PACKAGE_FILE, PackageInfo
from mirror_sd.runtime.engines import open_engine
from mirror_sd.runtime.pipeline import Pipeline

PROMPT = [5, 17, 33, 40, 2]
QUIET = dict(report=lambda _line: None)


def _build(bundle: Path, out: Path, **options) -> Path:
    build_package(PackageOptions(bundle=bundle, out=out, **options), **QUIET)
    return out


@pytest.fixture(scope="module")
def built(bundle_factory, tmp_path_factory):
    """Packages shared by the module: fp16 of a self-draft (high acceptance) and of a streaming draft, int8, int4,
    an fp32 one with small bounds (for the engine check and the bound errors), and a .tar."""
    root = tmp_path_factory.mktemp("packages")
    self_draft = bundle_factory("llama", self_draft=True)
    streaming = bundle_factory("llama", streaming=True, draft_weights="float32")  # packages compress fp32 weights
    return {
        "self_draft": self_draft, "streaming": streaming,
        "fp16": _build(self_draft, root / "fp16"),
        "streaming_fp16": _build(streaming, root / "streaming-fp16"),
        "int8": _build(self_draft, root / "int8", weights="int8"),
        "int4": _build(self_draft, root / "int4", weights="int4", group_size=32),
        "small": _build(streaming, root / "small", weights="fp32", max_prompt=8, max_context=40, max_gamma=4,
                        batch=3, prefill_chunk=6),
        "tar": _build(streaming, root / "streaming.tar"),
    }


# -- exactness -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["fp16", "streaming_fp16"])
def test_package_gives_the_bundles_tokens_from_the_static_draft(built, which):
    bundle = built["self_draft" if which == "fp16" else "streaming"]
    want = Pipeline.load(bundle).generate(PROMPT, mode="ar", max_new_tokens=24).token_ids
    pipe = Pipeline.load(built[which])
    for mode in ("ar", "sd", "mirror"):
        for overlap in (True, False):
            out = pipe.generate(PROMPT, mode=mode, max_new_tokens=24, overlap=overlap, branch_budget=None)
            assert out.token_ids == want, (mode, overlap)
            s = out.stats
            assert (s["draft_graph"], s["draft_weights"]) == ("static-ir", "fp16")
            assert s["draft_static_shapes"]["branch"] == "8x" + str(pipe.draft.spec.tokens_per_forward)
            if mode != "ar":
                assert s["draft_graph_forwards"] > 0 and s["fallbacks"] == 0 and s["draft_failures"] == 0


def test_compressed_drafts_stay_exact_and_report_acceptance(built):
    from mirror_sd.bench.compressed import compressed_draft_acceptance

    packages = {w: built[w] for w in ("fp16", "int8", "int4")}
    report = compressed_draft_acceptance(built["self_draft"], packages, [PROMPT, [9, 8, 7, 6]], max_new_tokens=20,
                                         gamma=4)
    assert set(report) == {"bundle", "fp16", "int8", "int4"}
    for weights, row in report.items():
        assert row["tokens_identical_to_ar"] and row["identical_prompts"] == 2, weights
        assert row["proposed_tokens"] > 0 and 0 <= row["acceptance_rate"] <= 1
        assert row["draft_graph"] == ("dynamic-onnx" if weights == "bundle" else "static-ir")
    # the self-draft is the target: its fp32 windows are all accepted; fp16 weights cannot flip clear-cut choices
    assert report["bundle"]["acceptance_rate"] == 1.0 and report["bundle"]["draft_weights"] == "float32"
    assert report["fp16"]["acceptance_vs_bundle"] > 0.9
    info = {w: PackageInfo.load(built[w]) for w in ("int8", "int4")}
    assert (info["int8"].weights, info["int4"].weights, info["int4"].group_size) == ("int8_sym", "int4_sym", 32)


def test_static_engine_matches_dynamic_engine_with_holes_splits_chunks_and_compaction(built):
    """fp32 package: the static graphs, fed rows that read the context lane up to different lengths, own pasts with
    holes, a batch above the branch graph's rows, a feed wider than one forward and an own past too long for the
    static slots, give the dynamic graph's logits."""
    from mirror_sd.partitions.manifest import Manifest
    from mirror_sd.runtime.kv import positions

    pipe = Pipeline.load(built["small"])
    static = pipe.draft
    dynamic = open_engine(built["streaming"], Manifest.load(built["streaming"]), "draft")
    rng = np.random.default_rng(0)
    engines = (dynamic, static)
    lanes = [engine.context_lane() for engine in engines]
    context = rng.integers(3, 300, 14)
    for engine, lane in zip(engines, lanes):  # the lane read in chunks of 5, as a prompt is (wider than T = 4)
        for lo in range(0, context.size, 5):
            part = context[None, lo:lo + 5]
            own, mask = engine.empty_own(1), np.ones(part.shape, np.int64)
            _, kv = engine.run(part, positions(np.array([lane.length]), own, mask), lane, np.array([lane.length]),
                               own, mask)
            lane.append(kv, part[0])
    rows = 5  # the branch graph has 3 rows: one full group and one padded
    shared = rng.integers(1, 15, rows)
    owns = [engine.empty_own(rows) for engine in engines]
    x = rng.integers(3, 300, (rows, 6))
    for _ in range(6):  # 6 x 6 slots pass the 4 * (4 + 4) = 32 own slots: the static engine must compact
        mask = (rng.random((rows, 6)) > 0.5).astype(np.int64)  # about 3.5 real tokens a step: within the bounds
        mask[:, -1] = 1
        outs = [engine.run(x, positions(shared, own, mask), lane, shared, own, mask)
                for engine, lane, own in zip(engines, lanes, owns)]
        (want, want_kv), (got, got_kv) = outs
        keep = mask.astype(bool)
        np.testing.assert_allclose(got["logits"][keep], want["logits"][keep], atol=1e-4, rtol=1e-4)
        assert (got["stream_ids"][keep] == want["stream_ids"][keep]).mean() > 0.95
        owns = [own.extended(kv, mask) for own, kv in zip(owns, (want_kv, got_kv))]
        x = want["logits"][:, -1:].argmax(-1).repeat(6, axis=1) % 300 + 3
    assert owns[0].slots == 6 * 6 > pipe.package.info.bounds.own_slots


def test_perplexity_keeps_to_a_packages_bounds(built):
    """The default window is the longest prompt the package's static shapes take; a longer one is refused by name."""
    pipe = Pipeline.load(built["small"], huge_pages=False)
    text = "the quick brown fox jumps over the lazy dog " * 4
    assert pipe.longest_prompt == 8
    # what an answer without max_new_tokens runs to (the server's chat, mirror-sd chat): the package's bound
    assert pipe.longest_context == 40 < pipe.context_limit
    got = pipe.perplexity(text)
    assert got.window == 8 and got.tokens == len(pipe.prompt_ids(text)) - 1
    with pytest.raises(BadInputError, match="does not fit") as caught:
        pipe.perplexity(text, window=9)
    assert caught.value.option == "window"
    pipe.close()


def test_tar_package_loads_and_generates(built):
    want = Pipeline.load(built["streaming"]).generate(PROMPT, mode="ar", max_new_tokens=12).token_ids
    pipe = Pipeline.load(built["tar"], cache_dir=built["tar"].parent / "ov-cache")
    out = pipe.generate(PROMPT, mode="mirror", max_new_tokens=12)
    assert out.token_ids == want and out.stats["draft_graph"] == "static-ir"
    assert any((built["tar"].parent / "ov-cache").iterdir())  # the compile cache was written


# -- bad input -------------------------------------------------------------------------------------------------
def test_bounds_are_refused_before_any_device_work(built):
    pipe = Pipeline.load(built["small"])
    forwards = pipe.draft.forwards
    with pytest.raises(BadInputError, match="MAX_PROMPT"):
        pipe.generate(list(range(3, 12)), max_new_tokens=2)  # 9 tokens > max_prompt 8
    with pytest.raises(BadInputError, match="MAX_CONTEXT"):
        pipe.generate(PROMPT, max_new_tokens=36)  # 5 + 36 > 40
    with pytest.raises(BadInputError, match="max_gamma"):
        pipe.generate(PROMPT, mode="sd", max_new_tokens=4, gamma=5)
    assert pipe.draft.forwards == forwards
    ok = pipe.generate(list(range(3, 11)), mode="mirror", max_new_tokens=32, gamma=4)  # exactly at both bounds
    assert len(ok.token_ids) == 32 or ok.finish_reason == "eos"


def test_no_genai_baseline_of_a_model_its_pipeline_would_not_run_as_itself(tmp_path):
    from mirror_sd.errors import ExportError
    from mirror_sd.export import openvino_genai
    from mirror_sd.models.tiny import make_pair

    for arch, overrides, words in (("gemma2", {"sliding_window": 4096}, "soft-capped"),  # no window in its context
                                   ("mistral", {"sliding_window": 16}, "sliding")):
        target, _ = make_pair(tmp_path / arch, arch, **overrides)
        with pytest.raises(ExportError, match=words):
            openvino_genai.convert(target, tmp_path / f"ov-{arch}")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, copy_function=shutil.copy2)
    return dst


def test_tampered_unknown_version_escaping_and_unlisted_packages_are_refused(built, tmp_path):
    bad = _copy(built["streaming_fp16"], tmp_path / "tampered")
    with open(bad / "draft" / "decode.xml", "ab") as f:
        f.write(b" ")
    with pytest.raises(PackageError, match="sha256"):
        Pipeline.load(bad)

    old = _copy(built["streaming_fp16"], tmp_path / "future")
    doc = json.loads((old / PACKAGE_FILE).read_text())
    (old / PACKAGE_FILE).write_text(json.dumps({**doc, "format_version": 99}))
    with pytest.raises(PackageError, match="format_version 99"):
        Pipeline.load(old)

    for name in ("../outside.json", "/etc/passwd", "draft/../../x"):
        esc = _copy(built["streaming_fp16"], tmp_path / f"escape{len(name)}")
        doc = json.loads((esc / PACKAGE_FILE).read_text())
        doc["files"][name] = "0" * 64
        (esc / PACKAGE_FILE).write_text(json.dumps(doc))
        with pytest.raises(PackageError, match="outside the package"):
            Pipeline.load(esc)

    link = _copy(built["streaming_fp16"], tmp_path / "symlink")
    (link / "tokenizer.json").unlink()
    (link / "tokenizer.json").symlink_to(built["streaming_fp16"] / "tokenizer.json")
    with pytest.raises(PackageError, match="symbolic link"):
        Pipeline.load(link)

    extra = _copy(built["streaming_fp16"], tmp_path / "extra")
    (extra / "unlisted.txt").write_text("x")
    with pytest.raises(PackageError, match="does not list"):
        Pipeline.load(extra)


def _tar_with(path: Path, source: Path, member: tarfile.TarInfo, data: bytes = b"") -> Path:
    with tarfile.open(path, "w") as tar:
        for f in sorted(p for p in source.rglob("*") if p.is_file()):
            tar.add(f, arcname=f.relative_to(source).as_posix())
        tar.addfile(member, io.BytesIO(data) if data else None)
    return path


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink", "hardlink"])
def test_tar_members_outside_the_package_are_refused_before_extraction(built, tmp_path, kind):
    target = tmp_path / "victim.txt"
    member = tarfile.TarInfo({"dotdot": f"../{target.name}", "absolute": str(target)}.get(kind, "tokenizer2.json"))
    data = b"pwned"
    if kind in ("symlink", "hardlink"):
        member.type = tarfile.SYMTYPE if kind == "symlink" else tarfile.LNKTYPE
        member.linkname, data = str(target), b""
    else:
        member.size = len(data)
    (tmp_path / "evil").mkdir()
    tar = _tar_with(tmp_path / "evil" / "p.tar", built["streaming_fp16"], member, data)
    with pytest.raises(PackageError, match="outside the package|link"):
        Pipeline.load(tar)
    assert not target.exists() and not (tmp_path / "evil" / target.name).exists()


def test_absent_device_is_a_clear_error(built):
    import openvino as ov

    available = ov.Core().available_devices
    absent = next(d for d in ("NPU", "GPU", "NPU.7") if d not in available)
    with pytest.raises(BadInputError, match="available"):
        Pipeline.load(built["streaming_fp16"], draft_device=absent)


def test_build_refusals_leave_nothing_behind(built, tmp_path):
    bundle = built["streaming"]
    for options in (dict(weights="int3"), dict(max_context=10_000), dict(max_prompt=50, max_context=40),
                    dict(tokens_per_forward=2), dict(device="TPU"), dict(batch=0)):
        with pytest.raises(BadInputError if "weights" not in options else PackageError):
            build_package(PackageOptions(bundle=bundle, out=tmp_path / "out", **options), **QUIET)
    with pytest.raises(BadInputError, match="not empty"):
        build_package(PackageOptions(bundle=bundle, out=built["small"]), **QUIET)
    with pytest.raises(BadInputError, match="exists"):
        build_package(PackageOptions(bundle=bundle, out=built["tar"]), **QUIET)
    with pytest.raises(BadInputError, match="is a package already"):
        build_package(PackageOptions(bundle=built["small"], out=tmp_path / "out"), **QUIET)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(BadInputError, match="not a package"):  # --force replaces an earlier package only
        build_package(PackageOptions(bundle=bundle, out=mine, force=True), **QUIET)
    assert (mine / "notes.txt").read_text() == "mine"
    with pytest.raises(BadInputError, match="holds an input"):
        build_package(PackageOptions(bundle=bundle, out=bundle, force=True), **QUIET)
    with pytest.raises(BadInputError, match="lies inside an input"):  # the bundle stays as the user gave it
        build_package(PackageOptions(bundle=bundle, out=bundle / "package"), **QUIET)
    assert not (bundle / "package").exists()
    shutil.rmtree(mine)
    for options, option in ((dict(weights="int4", group_size=0), "group_size"), (dict(device="TPU"), "device")):
        with pytest.raises(BadInputError) as err:  # before any NNCF work, naming the option
            build_package(PackageOptions(bundle=bundle, out=tmp_path / "new" / "out", **options), **QUIET)
        assert err.value.option == option
    assert list(tmp_path.iterdir()) == []  # no OUT, no staging directory, no folder made for them


def test_a_prompt_chunk_wider_than_the_rows_own_past_still_drafts(built, tmp_path):
    """The static graphs take a row's own past and a chunk's tokens in inputs of their own: a package whose prompt
    chunk is wider than its own past (a small max_gamma) reads a long prompt and drafts, exact, as its bundle."""
    pkg = _build(built["streaming"], tmp_path / "narrow", weights="fp32", max_gamma=1, max_prompt=48, max_context=64)
    info = PackageInfo.load(pkg)
    assert info.bounds.prefill_chunk > info.bounds.own_slots
    prompt = [5 + (7 * i) % 90 for i in range(info.bounds.prefill_chunk + 8)]
    want = Pipeline.load(built["streaming"]).generate(prompt, mode="ar", max_new_tokens=12).token_ids
    out = Pipeline.load(pkg).generate(prompt, mode="sd", max_new_tokens=12, gamma=1)
    assert out.token_ids == want
    assert out.stats["draft_failures"] == 0 and out.stats["draft_graph_forwards"] > 0


def test_a_static_draft_drafts_again_after_a_failure(built):
    """A draft failure resets the drafter's caches: its next window reads the context a prompt chunk at a time, as
    after a prompt, rather than all of it in one request, which the static graphs refused on every later step."""
    pipe = Pipeline.load(built["streaming_fp16"])
    prompt = [5 + (7 * i) % 90 for i in range(90)]
    want = Pipeline.load(built["streaming"]).generate(prompt, mode="ar", max_new_tokens=30).token_ids
    pipe.draft.run = fails_on(4, pipe.draft.run, "injected draft failure")
    out = pipe.generate(prompt, mode="sd", max_new_tokens=30, adaptive_speculation=False, overlap=False)
    assert out.token_ids == want
    assert out.stats["draft_failures"] == 1 and out.stats["fresh_rollouts"] >= 3


def test_a_draft_whose_sliding_window_the_static_graphs_would_misplace_is_refused(tmp_path):
    """The static graphs hold the context lane and a padded own past before the new tokens: a sliding window that
    measures by slot index would see another context than the bundle's draft (it drafted nothing useful). The export
    records the draft's window and a package's context past it is refused before any device work, whatever its
    weights; a bundle without the record (exported before it) is compared after a filled lane (fp32 weights) and
    refused as well. Nothing is left behind."""
    from mirror_sd.export.bundle import ExportOptions, export_bundle
    from mirror_sd.models.tiny import make_pair
    from mirror_sd.partitions import Manifest

    target, _ = make_pair(tmp_path / "pair", "mistral", sliding_window=4)
    bundle = tmp_path / "bundle"
    export_bundle(ExportOptions(model=str(target), draft=str(target), out=str(bundle), exit_layer=3,
                                draft_weights="float32"), report=lambda *_: None)
    assert Manifest.load(bundle).partition("draft").extra["sliding_window"] == 4
    for weights in ("fp32", "int8"):
        with pytest.raises(BadInputError, match="sliding window of 4 tokens"):
            build_package(PackageOptions(bundle=bundle, out=tmp_path / "out", weights=weights, max_prompt=64,
                                         max_context=128), **QUIET)
    doc = json.loads((bundle / "manifest.json").read_text())  # the record taken out: the comparison still refuses
    for part in doc["partitions"]:
        part.get("extra", {}).pop("sliding_window", None)
    (bundle / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(PackageError, match="sliding window"):
        build_package(PackageOptions(bundle=bundle, out=tmp_path / "out", weights="fp32", max_prompt=64,
                                     max_context=128), **QUIET)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle", "pair"]


def test_a_saved_plan_is_a_new_file_and_a_package_linked_to_the_old_keeps_it(tmp_path):
    """`mirror-sd plan --save` writes plan.json whole, as a new file: a package whose build hard-linked the bundle's
    (it links the files it takes unchanged) keeps its own, which its digests cover."""
    bundle_plan, package_plan = tmp_path / "plan.json", tmp_path / "package-plan.json"
    bundle_plan.write_text("old")
    os.link(bundle_plan, package_plan)
    write_whole(bundle_plan, "new")
    assert (bundle_plan.read_text(), package_plan.read_text()) == ("new", "old")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["package-plan.json", "plan.json"]


# -- CLI -------------------------------------------------------------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("mirror-sd")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "mirror_sd.cli"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300)


def test_cli_package_then_generate(built, tmp_path):
    out = tmp_path / "cli-package"
    done = _cli("package", str(built["streaming"]), "--out", str(out), "--weights", "int8", "--max-context", "64")
    assert done.returncode == 0, done.stderr
    done = _cli("generate", str(out), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "12", "--json",
                "--mode", "mirror")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    want = Pipeline.load(built["streaming"]).generate(PROMPT, mode="ar", max_new_tokens=12).token_ids
    assert result["token_ids"] == want and result["stats"]["draft_weights"] == "int8_sym"


def test_cli_bad_inputs_exit_2_without_traceback(built, tmp_path):
    tampered = _copy(built["small"], tmp_path / "tampered")
    (tampered / "tokenizer.json").write_text((tampered / "tokenizer.json").read_text() + " ")
    future = _copy(built["small"], tmp_path / "future")
    doc = json.loads((future / PACKAGE_FILE).read_text())
    (future / PACKAGE_FILE).write_text(json.dumps({**doc, "format_version": doc["format_version"] + 1}))
    small = str(built["small"])
    garbage = tmp_path / "garbage.tar"
    garbage.write_text("not an archive")
    truncated = _copy(built["streaming"], tmp_path / "truncated")
    graph = truncated / "target_prefix.onnx"
    graph.write_bytes(graph.read_bytes()[:graph.stat().st_size // 2])
    planned = _copy(built["streaming"], tmp_path / "planned")
    manifest = json.loads((planned / "manifest.json").read_text())["target"]
    write_whole(planned / "plan.json", json.dumps({
        "format": "mirror-sd-plan", "version": 1, "export": {},
        "bundle": {"exit_layer": manifest["exit_layer"], "top_k": manifest["top_k"]},
        "runtime": {"gamma": 6, "kappa": 1, "target_threads": 1, "draft_threads": 1}}))
    backup = tmp_path / "backup.tar"  # a user's archive, not a package
    with tarfile.open(backup, "w") as tar:
        tar.add(__file__, arcname="notes.txt")
    typed = _copy(built["streaming"], tmp_path / "typed")
    doc = json.loads((typed / "manifest.json").read_text())
    doc["target"]["num_layers"] = str(doc["target"]["num_layers"])
    (typed / "manifest.json").write_text(json.dumps(doc))
    cases = [
        (["generate", str(truncated), "--prompt-ids", "5"], "cannot load this graph"),
        (["generate", str(typed), "--prompt-ids", "5"], "malformed"),
        (["package", small, "--out", str(tmp_path / "x")], "is a package already"),
        (["plan", small, "--save"], "--save writes a bundle's plan.json"),
        (["generate", str(garbage), "--prompt-ids", "5"], "cannot read package"),
        (["generate", small, "--prompt-ids", ",".join(["5"] * 9)], "MAX_PROMPT"),
        (["generate", small, "--prompt-ids", "5,6", "--max-new-tokens", "39"], "MAX_CONTEXT"),
        (["generate", str(tampered), "--prompt-ids", "5"], "sha256"),
        (["generate", str(future), "--prompt-ids", "5"], "format_version"),
        (["generate", small, "--prompt-ids", "5", "--draft-device", "NPU.7"], "available"),
        (["package", str(built["streaming"]), "--out", str(tmp_path / "x"), "--weights", "int3"], "unknown weights"),
        (["plan", str(built["tar"]), "--save"], "--save writes a bundle's plan.json"),
        (["package", str(built["tar"]), "--out", str(tmp_path / "x")], "is a package already"),
        (["package", str(built["streaming"]), "--out", str(backup), "--force"], "not a package archive"),
        (["generate", small, "--prompt-ids", "5", "--cache-dir", "/proc/no-such/cache"], "cannot use cache_dir"),
    ]
    for argv, message in cases:
        done = _cli(*argv)
        assert done.returncode == 2, (argv, done.stderr)
        assert done.stderr.startswith("mirror-sd: error:") and message in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
    assert not (tmp_path / "x").exists()
    # a package whose windows are narrower than the plan's (or the built-in) gamma runs them at its max_gamma; the
    # bundle's generation_config.json (the server's sampling defaults) goes with it
    from mirror_sd.serve.defaults import bundle_defaults

    (planned / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    assert _cli("package", str(planned), "--out", str(tmp_path / "narrow"), "--max-gamma", "2").returncode == 0
    pipe = Pipeline.load(tmp_path / "narrow")
    assert pipe.generation_config.gamma == 2 and pipe.generate([5, 6, 7], mode="sd", max_new_tokens=4).token_ids
    assert bundle_defaults(tmp_path / "narrow") == {"temperature": 0.3}


def test_benchmark_package_cache_rebuilds_a_stale_package(bundle_factory, tmp_path):
    """bench/compressed.ensure_package reuses a package made from the bundle's current draft and rebuilds one made
    from another draft (package.json records a digest of the draft graph's files, external data included)."""
    from mirror_sd.bench.compressed import ensure_package
    from mirror_sd.partitions import Manifest
    from mirror_sd.partitions.package_format import PACKAGE_FILE, PackageInfo, graph_sha256

    bundle = bundle_factory("llama", streaming=True, draft_weights="float32")
    said: list[str] = []
    out = ensure_package(bundle, "fp16", tmp_path, rebuild=False, report=said.append)
    draft = Manifest.load(bundle).partition("draft")
    draft_sha = graph_sha256(bundle, (draft.file, *draft.data_files))
    # the digest covers every file of a graph: new weights in an external-data file change it
    graph = tmp_path / "graph"
    graph.mkdir()
    (graph / "g.onnx").write_bytes(b"graph")
    (graph / "g.onnx.data").write_bytes(b"weights 1")
    before = graph_sha256(graph, ("g.onnx", "g.onnx.data"))
    (graph / "g.onnx.data").write_bytes(b"weights 2")
    assert graph_sha256(graph, ("g.onnx", "g.onnx.data")) != before
    assert graph_sha256(graph, ("g.onnx",)) != before  # the data file is part of it
    assert PackageInfo.load(out).source_draft_sha256 == draft_sha
    built = (out / PACKAGE_FILE).stat().st_mtime_ns
    assert ensure_package(bundle, "fp16", tmp_path, rebuild=False, report=said.append) == out
    assert (out / PACKAGE_FILE).stat().st_mtime_ns == built and not any("rebuilding" in s for s in said)

    record = json.loads((out / PACKAGE_FILE).read_text())
    record["source_draft_sha256"] = "0" * 64  # as if made from an earlier draft
    (out / PACKAGE_FILE).write_text(json.dumps(record))
    ensure_package(bundle, "fp16", tmp_path, rebuild=False, report=said.append)
    assert any("rebuilding" in s for s in said)
    assert PackageInfo.load(out).source_draft_sha256 == draft_sha
