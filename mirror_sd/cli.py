"""`mirror-sd`: the command line. Errors a user can cause print one line and exit non-zero, no traceback."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mirror_sd.errors import BadInputError, MirrorSDError, check_int
from mirror_sd.partitions.manifest import DRAFT_WEIGHT_FORMATS, TARGET_DTYPES, TARGET_WEIGHT_FORMATS
from mirror_sd.runtime.config import GenerationConfig, LoadOptions, Options, Spec, specs
from mirror_sd.runtime.perplexity import WINDOW, perplexity
from mirror_sd.serve.defaults import (
    API_KEY_ENV,
    LOG_LEVELS,
    REASONING_PARSERS,
    SERVE_GENERATION,
    TOOL_CALL_PARSERS,
    GenerationSource,
)

if TYPE_CHECKING:
    from mirror_sd.partitions.planner import Plan
    from mirror_sd.runtime.pipeline import Pipeline

# The load options (runtime/config.py LoadOptions) each command takes from its command line; their flags, help and
# defaults come from the options themselves.
LOAD_FLAGS = {
    "generate": ("target_backend", "draft_backend", "target_device", "target_step_width", "prefill_precision",
                 "draft_device", "max_context", "target_threads", "draft_threads", "cache_dir", "huge_pages",
                 "chat_template", "native_attention", "kv_cache_precision", "cuda_graphs"),
    "serve": ("target_threads", "draft_threads", "target_device", "draft_device", "max_context", "target_step_width",
              "prefill_precision", "max_num_seqs", "kv_cache_gb", "kv_cache_precision", "window_rows",
              "scheduling_policy", "chat_template", "enable_prefix_caching", "native_attention", "cuda_graphs"),
    "plan": ("target_device", "draft_device"),
}
LOAD_FLAGS["chat"] = LOAD_FLAGS["generate"]  # one conversation at a time, on the batching engine's prefix cache
LOAD_FLAGS["perplexity"] = tuple(f for f in LOAD_FLAGS["generate"] if f != "chat_template")  # it scores plain text
# one generation is not worth the longer load that huge pages take; the Python API and serve keep them on
GENERATE_LOAD_DEFAULTS = {"huge_pages": False}
# the defaults `serve` shows for them where not the library's: a request without max_tokens runs to the context's end
SERVE_SHOWN = {"max_new_tokens": "what the prompt leaves of the context"}
# `serve`'s flags that mean something only with --ray, by their argparse destination
RAY_FLAGS = {"--replicas": "replicas", "--ray-address": "ray_address", "--num-cpus": "num_cpus",
             "--num-gpus": "num_gpus"}


def add_options(parser: argparse.ArgumentParser, cls: type[Options], names: Collection[str] | None = None,
                defaults: Mapping[str, Any] | None = None, shown: Mapping[str, str] | None = None) -> None:
    """A flag for each command-line option of `cls` (or of those in `names`), named, typed and explained by the
    option's metadata (runtime/config.py). A flag not given stays out of the namespace, so that the option keeps
    its default from elsewhere (the bundle's plan), unless this command sets one in `defaults`; `shown` words the
    default for the help where the command's own comes from elsewhere. `given` reads them back."""
    defaults, shown = defaults or {}, shown or {}
    known = {s.name for s in specs(cls) if s.flag}
    if names is not None and set(names) - known:
        raise ValueError(f"no command-line option {sorted(set(names) - known)} in {cls.__name__}")
    for spec in specs(cls):
        if spec.flag is None or (names is not None and spec.name not in names):
            continue
        default = defaults.get(spec.name, argparse.SUPPRESS)
        kw: dict[str, Any] = {"dest": spec.name, "default": default,
                              "help": _help(spec, spec.default if default is argparse.SUPPRESS else default,
                                            shown.get(spec.name))}
        if spec.kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif spec.kind is tuple:
            kw.update(action="append", metavar="TEXT")
        elif spec.kind is list:
            kw.update(action="append", metavar="ID", type=int)
        elif spec.kind is dict:
            kw.update(action="append", metavar="ID:NUMBER", type=_token_number)
        else:
            kw["type"] = _parser_of(spec)
            if spec.option.choices:
                kw["metavar"] = "{" + ",".join(map(str, spec.option.choices)) + "}"
        parser.add_argument(spec.flag, *spec.option.aliases, **kw)
        for flag, value in spec.option.switches:
            same = (f"--{'' if value else 'no-'}{spec.flag[2:]}" if isinstance(value, bool)
                    else f"{spec.flag} {value}")
            parser.add_argument(flag, dest=spec.name, action="store_const", const=value, default=argparse.SUPPRESS,
                                help=f"the same as {same}")


def given(args: argparse.Namespace, cls: type[Options]) -> dict[str, Any]:
    """The options of `cls` the command line set (add_options' flags), by name."""
    return {s.name: getattr(args, s.name) for s in specs(cls) if hasattr(args, s.name)}


def _help(spec: Spec, default: Any, shown: str | None = None) -> str:
    o = spec.option
    if shown is not None:
        words = shown
    elif default is None:
        words = o.none
    elif isinstance(default, bool):
        words = "on" if default else "off"
    else:
        words = "" if default == () else str(default)
    if o.planned:
        words = f"the bundle's plan, else {words}"
    return (o.help + (f" (default: {words})" if words else "")).replace("%", "%%")


def _parser_of(spec: Spec) -> Callable[[str], Any]:
    """argparse's type for an option: its kind, or None where the option has a word for it ("auto")."""
    word = spec.option.none_word
    if word is None:
        return spec.kind

    def parse(text: str) -> Any:
        if text == word:
            return None
        try:
            return spec.kind(text)
        except ValueError:
            what = "an integer" if spec.kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {what} or {word!r}, got {text!r}") from None
    return parse


def _token_number(text: str) -> tuple[int, float]:
    """argparse's type for one entry of a token map option (--logit-bias 5:-100)."""
    token, _, number = text.partition(":")
    try:
        return int(token), float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID:NUMBER such as 5:-100, got {text!r}") from None


def _check_plan_depth(plan: dict, model: str) -> None:
    """A plan measured on a model of other depth advises exit layers of that model's, not this one's."""
    from transformers import AutoConfig

    from mirror_sd.partitions.plan_file import check_depth

    try:
        layers = getattr(AutoConfig.from_pretrained(model), "num_hidden_layers", None)
    except (OSError, ValueError):  # the export itself says what is wrong with the model
        return
    if layers is not None:
        check_depth(plan, layers, option="plan")


def _export(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from mirror_sd.export.bundle import DEFAULT_TOP_K, ExportOptions, export_bundle

    exit_layer, top_k = args.exit_layer, args.top_k
    if args.plan is not None:  # the plan's advice fills what was not given (an exit adapter sets its own layer)
        from mirror_sd.partitions.plan_file import export_advice, read_plan

        plan = read_plan(args.plan)
        _check_plan_depth(plan, args.model)
        advice = export_advice(plan)
        if exit_layer is None and args.exit_adapter is None:
            exit_layer = advice.exit_layer
        top_k = advice.top_k if top_k is None else top_k
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    export_bundle(ExportOptions(model=args.model, draft=args.draft, out=Path(args.out), exit_layer=exit_layer,
                                top_k=DEFAULT_TOP_K if top_k is None else top_k, force=args.force,
                                exit_adapter=args.exit_adapter, exit_vocab=args.exit_vocab,
                                draft_weights=args.draft_weights, target_dtype=args.target_dtype,
                                target_weights=args.target_weights))
    return 0


def _package(args: argparse.Namespace) -> int:
    from mirror_sd.package.build import PackageOptions, build_package

    build_package(PackageOptions(
        bundle=Path(args.bundle), out=Path(args.out), device=args.device, weights=args.weights,
        group_size=args.group_size, max_prompt=args.max_prompt, max_context=args.max_context,
        max_gamma=args.max_gamma, batch=args.batch, tokens_per_forward=args.tokens_per_forward,
        prefill_chunk=args.prefill_chunk, force=args.force), report=lambda line: print(line, file=sys.stderr))
    return 0


def _prompt_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise MirrorSDError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def _load(args: argparse.Namespace, **fixed: Any) -> Pipeline:
    """The command's pipeline (its load flags, and the load options it fixes), with its plan's note (measured on
    another machine) on stderr."""
    from mirror_sd.runtime.pipeline import Pipeline

    pipe = Pipeline.load(args.bundle, **given(args, LoadOptions), **fixed)
    if pipe.plan_note:
        print(f"note: {pipe.plan_note}", file=sys.stderr)
    return pipe


def _generate(args: argparse.Namespace) -> int:
    import json

    pipe = _load(args)
    prompt = _prompt_ids(args.prompt_ids) if args.prompt_ids is not None else args.prompt
    # what was not given keeps the pipeline's config: the built-in defaults, with the bundle plan's merged in; but
    # a chat model gets its text as a user turn of its chat template, as OpenVINO GenAI's generate gives it
    config = pipe.generation_config.updated(**{"apply_chat_template": True, **given(args, GenerationConfig)})

    def show(_token: int, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    # a beam search's text is whole only at its end, and samples come together: nothing streamed
    beams, samples = config.num_beams > 1, config.num_beams == 1 and config.num_return_sequences > 1
    result = pipe.generate(prompt, config, streamer=None if args.json or beams or samples else show)
    if args.json:
        doc = {"token_ids": result.token_ids, "text": result.text, "stats": result.stats.as_dict()}
        if result.seed is not None:  # sampled: the seed it drew with (the given one, or one drawn for it)
            doc["seed"] = result.seed
        if result.beams is not None:  # --num-return-sequences N: the best N beams, best first
            doc["beams"] = [{"token_ids": b.token_ids, "text": b.text, "score": b.score,
                             "finish_reason": b.finish_reason} for b in result.beams]
        if result.samples is not None:  # --num-return-sequences N sampled: each sample, seed + i
            doc["samples"] = [{"token_ids": r.token_ids, "text": r.text, "finish_reason": r.finish_reason}
                              for r in result.samples]
        if result.logprobs is not None:  # --logprobs K: each token's, with its K likeliest alternatives
            doc["logprobs"] = [{"token_id": lp.token, "logprob": lp.logprob, "top": [list(t) for t in lp.top]}
                               for lp in result.logprobs]
        if result.prompt_logprobs is not None:  # --prompt-logprobs K: each prompt token's (null for the first)
            doc["prompt_logprobs"] = [lp and {"token_id": lp.token, "logprob": lp.logprob, "rank": lp.rank,
                                              "top": [list(t) for t in lp.top]} for lp in result.prompt_logprobs]
        print(json.dumps(doc))
    elif beams:  # each returned beam's text, best first, a blank line between them
        print("\n\n".join(b.text for b in result.beams))
        print(f"[beam] {len(result.beams)} of {config.num_beams} beams, scores "
              f"{', '.join(f'{b.score:.3f}' for b in result.beams)}, {result.stats.wall_s:.2f} s", file=sys.stderr)
    elif samples:  # each sample's text, in seed order, a blank line between them
        print("\n\n".join(r.text for r in result.samples))
        print(f"[{result.stats.mode}] {len(result.samples)} samples, seeds {result.samples[0].seed} to "
              f"{result.samples[-1].seed}, {sum(r.stats.new_tokens for r in result.samples)} tokens, "
              f"{max(r.stats.wall_s for r in result.samples):.2f} s", file=sys.stderr)
    else:
        s = result.stats
        seed = "" if result.seed is None else f", seed {result.seed}"  # sampled: the one to give to repeat it
        print()
        print(f"[{s.mode}] {s.new_tokens} tokens, {s.tokens_per_second:.1f} tok/s, ttft {s.ttft_s * 1000:.1f} ms, "
              f"{s.mean_accepted_tokens:.2f} tokens/step, acceptance {s.acceptance_rate:.2f}, "
              f"branch hits {s.branch_hit_rate:.2f}, draft hidden {s.draft_hidden_fraction:.2f}, "
              f"fallbacks {s.fallbacks} ({result.finish_reason}){seed}", file=sys.stderr)
    return 0


def _chat(args: argparse.Namespace) -> int:
    from mirror_sd.chat import chat

    # one conversation: one KV slot, which keeps the earlier turns for the next, and no second copy of the target for
    # rows verifying windows side by side
    options = given(args, GenerationConfig)
    # before the load: a chat streams each answer, and a beam search has none to stream; several texts have no one
    # answer to keep for the next turn
    for name, what in (("num_beams", "a beam search"), ("num_return_sequences", "several samples")):
        if options.get(name, 1) > 1:
            raise BadInputError(f"chat streams one answer a turn: {what} ({name} above 1) runs in `mirror-sd "
                                "generate`", option=name)
    pipe = _load(args, max_num_seqs=1, window_rows=0)
    if sys.stdin is None:
        raise MirrorSDError("chat reads its turns from the standard input, which is closed")
    # a line that is not UTF-8 is still a turn (its bad bytes as U+FFFD), not the end of the conversation
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="replace")
    tty = sys.stdin.isatty()
    if tty:
        print("mirror-sd chat: /help lists the commands", file=sys.stderr)
    try:
        return chat(pipe, pipe.generation_config.updated(**options), sys.stdin, system=args.system,
                    max_new_tokens=options.get("max_new_tokens"), prompt="> " if tty else "")
    finally:
        pipe.close()


def server_access(args: argparse.Namespace) -> tuple[str | None, tuple[str, ...]]:
    """`serve`'s API key (--api-key, else $MIRROR_SD_API_KEY, else none) and CORS origins (--cors-origin, each
    repeatable or a comma-separated list)."""
    from mirror_sd.errors import BadInputError

    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if api_key is not None and not api_key.strip():
        raise BadInputError("--api-key is empty")
    return api_key, tuple(o.strip() for arg in args.cors_origin for o in arg.split(",") if o.strip())


def _perplexity(args: argparse.Namespace) -> int:
    import json

    try:
        text = Path(args.file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise MirrorSDError(f"cannot read --file {args.file}: {e}") from None
    if not text.strip():
        raise MirrorSDError(f"--file {args.file} holds no text")
    pipe = _load(args)

    def progress(done: int, total: int) -> None:
        print(f"\rwindow {done}/{total}", end="" if done < total else "\n", file=sys.stderr, flush=True)

    try:
        result = perplexity(pipe, pipe.prompt_ids(text), args.window, args.stride, progress)
    finally:
        pipe.close()
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        windows = f"{result.windows} window{'s' if result.windows > 1 else ''}"
        print(f"perplexity {result.perplexity:.4f} (mean NLL {result.nll:.4f} nats over {result.tokens} tokens, "
              f"{windows} of {result.window}, stride {result.stride})")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from mirror_sd.errors import BadInputError, check_int
    from mirror_sd.serve.app import create_app, listen, open_server, serve
    from mirror_sd.serve.tls import server_context

    check_int("--max-queue", args.max_queue, 0)
    check_int("--stored-responses", args.stored_responses, 0)
    if not 0 < args.port < 65536:
        raise BadInputError(f"--port must be in 1..65535, got {args.port}")
    source = _checked_app_flags(args)
    api_key, origins = server_access(args)
    tls = server_context(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, args.ssl_cert_reqs)
    if args.ray:  # each replica loads the bundle in its own process (serve/ray_app.py); none is loaded here
        if tls is not None:
            raise BadInputError("--ssl-*: not with --ray, whose HTTP proxy is Ray's: put TLS in front of it (a load "
                                "balancer, an ingress)")
        return _serve_on_ray(args, api_key, origins, source)
    ray_only = [flag for flag, dest in RAY_FLAGS.items() if getattr(args, dest) is not None]
    if ray_only:
        raise BadInputError(f"{', '.join(ray_only)}: only with --ray")
    sock = listen(args.host, args.port)
    pipe, settings = open_server(args.bundle, LoadOptions().updated(**given(args, LoadOptions)),
                                 _server_settings(args, api_key, origins), given(args, GenerationConfig), source)
    name = settings.model_name
    app = create_app(pipe, settings)
    engine = pipe.engine()
    mode = settings.defaults.get("mode", pipe.generation_config.mode)
    print(f"mirror-sd: serving {name!r} on http{'s' if tls else ''}://{args.host}:{args.port}/v1 ({mode}; "
          f"target {pipe.target.device}, draft {pipe.draft.device}; up to {engine.max_num_seqs} generations at "
          f"once, each up to {pipe.context_limit} tokens; API key {'required' if api_key else 'not required'})",
          file=sys.stderr)
    serve(app, sock, args.log_level, tls)  # SIGTERM: open generations stop at their next step, exit 0
    return 0


def _serve_on_ray(args: argparse.Namespace, api_key: str | None, origins: tuple[str, ...],
                  source: GenerationSource) -> int:
    from mirror_sd.serve.ray_app import Placement, ReplicaSpec, run

    spec = ReplicaSpec(args.bundle, _server_settings(args, api_key, origins),
                       LoadOptions().updated(**given(args, LoadOptions)), given(args, GenerationConfig),
                       source=source, log_level=args.log_level)
    placement = Placement(1 if args.replicas is None else args.replicas,
                          1.0 if args.num_cpus is None else args.num_cpus, args.num_gpus or 0.0)
    run(spec, placement, args.ray_address or "local", args.host, args.port,
        report=lambda line: print(line, file=sys.stderr))  # SIGINT, SIGTERM: the application goes, then exit 0
    return 0


def _server_settings(args: argparse.Namespace, api_key: str | None, origins: tuple[str, ...]) -> dict[str, Any]:
    """ServerSettings' fields from `serve`'s flags, but the defaults, which come with the bundle (open_server)."""
    return _app_settings(args, max_queue=args.max_queue, api_key=api_key, cors_origins=origins,
                         stored_responses=args.stored_responses)


def _app_settings(args: argparse.Namespace, **fixed: Any) -> dict[str, Any]:
    """ServerSettings' fields from the flags `serve` and `run-batch` share (_add_app_flags), and `fixed`."""
    names = args.model_name or [Path(args.bundle).resolve().name]
    return {"model_name": names[0], "model_aliases": tuple(names[1:]), "request_timeout_s": args.request_timeout,
            "tool_call_parser": args.tool_call_parser, "reasoning_parser": args.reasoning_parser, **fixed}


def _checked_app_flags(args: argparse.Namespace) -> GenerationSource:
    """The shared flags checked before the bundle loads; where request defaults come from (--generation-config)."""
    if any(not name.strip() for name in args.model_name or ()):
        raise BadInputError("--model-name: a served model name cannot be empty")
    GenerationConfig().updated(**given(args, GenerationConfig))  # an option out of range, before a load's wait
    if not args.request_timeout > 0:
        raise BadInputError(f"--request-timeout must be > 0, got {args.request_timeout}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:  # vLLM's rule, and its words
        raise BadInputError(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(TOOL_CALL_PARSERS)}): the "
                            "format the model writes its calls in")
    return GenerationSource.given(args.generation_config, args.override_generation_config)


def _run_batch(args: argparse.Namespace) -> int:
    from mirror_sd.serve.app import log_to_stderr
    from mirror_sd.serve.batch_file import check_models, check_output_file, read_batch

    source = _checked_app_flags(args)
    # no responses kept: the lines run at once, so one line's previous_response_id could not name another's
    fields = _app_settings(args, stored_responses=0)
    # a file the Batch API would refuse is refused before the load, as is one asking for another model
    lines = read_batch(Path(args.input_file))
    check_models(Path(args.input_file), lines, (fields["model_name"], *fields["model_aliases"]))
    out = Path(args.output_file)
    check_output_file(out, inputs=(args.input_file, args.bundle))
    restore_logging = log_to_stderr(args.log_level)
    try:
        summary = _answer_batch(args, fields, source, lines, out)
    finally:
        restore_logging()
    failed = {status: n for status, n in sorted(summary.statuses.items()) if status != 200}
    errors = [f"{sum(failed.values())} answered with an error ({', '.join(f'{n} x {s}' for s, n in failed.items())})"
              ] if failed else []
    errors += [f"{summary.failed} with no answer (see each line's error)"] if summary.failed else []
    print(f"mirror-sd: wrote {out}: {summary.statuses[200]} of {summary.requests} requests succeeded"
          f"{''.join(', ' + e for e in errors)}; {summary.completion_tokens} tokens in {summary.elapsed_s:.1f} s "
          f"({summary.tokens_per_s:.1f} tokens/s; generations at once: {summary.most_running} at most)",
          file=sys.stderr)
    return 0


def _answer_batch(args: argparse.Namespace, fields: dict[str, Any], source: GenerationSource, lines: list,
                  out: Path):
    """run-batch's load and run: the server's app over the bundle, the lines through it, the pipeline closed."""
    import asyncio
    import dataclasses

    from mirror_sd.serve.app import create_app, open_server
    from mirror_sd.serve.batch_file import batch_bounds, run_batch

    pipe, settings = open_server(args.bundle, LoadOptions().updated(**given(args, LoadOptions)), fields,
                                 given(args, GenerationConfig), source)
    tty = sys.stderr.isatty()
    try:
        engine = pipe.engine()
        in_flight, queue = batch_bounds(engine.max_num_seqs)
        app = create_app(pipe, dataclasses.replace(settings, max_queue=queue))
        print(f"mirror-sd: {len(lines)} requests from {args.input_file} to {settings.model_name!r} "
              f"(target {pipe.target.device}, draft {pipe.draft.device}; up to {engine.max_num_seqs} at once)",
              file=sys.stderr)
        return asyncio.run(run_batch(app, lines, out, in_flight, _progress(tty), lambda: engine.running))
    except KeyboardInterrupt:
        if tty:  # off the progress line
            print(file=sys.stderr)
        raise
    finally:
        pipe.close()


def _progress(tty: bool) -> Callable[[int, int], None]:
    """run-batch's progress on stderr: a line rewritten in a terminal, else a line at each tenth of the batch."""
    def show(done: int, total: int) -> None:
        if tty:
            print(f"\rrequests answered: {done}/{total}", end="" if done < total else "\n", file=sys.stderr,
                  flush=True)
        elif done * 10 // total > (done - 1) * 10 // total:
            print(f"requests answered: {done}/{total}", file=sys.stderr, flush=True)
    return show


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def _splits(text: str) -> tuple[tuple[int, int], ...]:
    try:
        pairs = tuple(tuple(int(n) for n in part.split("+")) for part in text.split(",") if part.strip())
    except ValueError:
        pairs = ()
    if not pairs or any(len(p) != 2 for p in pairs):
        raise argparse.ArgumentTypeError(f"expected target+draft thread pairs such as 1+1,2+1, got {text!r}")
    return pairs  # type: ignore[return-value]


def iter_table(plans: list[Plan], rows: int) -> list[str]:
    """The head of the planner's ranked table (`mirror-sd plan`) as text lines."""
    lines = [f"{'rank':>4} {'l_e':>4} {'k':>3} {'gamma':>5} {'budget':>6} {'threads':>7} {'tok/s':>8} "
             f"{'step ms':>8} {'tok/step':>8} {'hit':>5} {'hidden':>6}"]
    for i, p in enumerate(plans[:rows]):
        c, t = p.choice, p.terms
        lines.append(f"{i + 1:>4} {c.exit_layer:>4} {c.kappa:>3} {c.gamma:>5} {c.branch_budget:>6} "
                     f"{f'{c.target_threads}+{c.draft_threads}':>7} {p.predicted_tokens_per_second:>8.1f} "
                     f"{t.step_s * 1000:>8.2f} {t.tokens_per_step:>8.2f} {t.hit_rate:>5.2f} "
                     f"{'yes' if t.draft_hidden else 'no':>6}")
    return lines


def _plan(args: argparse.Namespace) -> int:
    import json

    from mirror_sd.outputs import check_apart, write_whole
    from mirror_sd.partitions.package_format import is_package
    from mirror_sd.partitions.plan_file import PLAN_FILE
    from mirror_sd.runtime.profile import ProfileOptions, plan_bundle

    check_int("rows", args.rows, 1)
    defaults = ProfileOptions()
    options = ProfileOptions(
        calibration=args.calibration, max_new_tokens=args.max_new_tokens, gammas=args.gammas or defaults.gammas,
        kappas=args.kappas, splits=args.splits, repeats=args.repeats, **given(args, LoadOptions))
    if args.save and is_package(args.bundle):  # before the measuring, not after
        raise BadInputError("--save writes a bundle's plan.json; a package's files are checked against its digests: "
                            "plan its bundle with --save and package that again", option="save")
    outs = [Path(args.out).expanduser()] if args.out else []
    outs += [Path(args.bundle) / PLAN_FILE] if args.save else []
    bundle = Path(args.bundle).expanduser().resolve()
    for out in outs:  # where the plan cannot be written, it is not measured
        if out.is_dir():
            raise BadInputError(f"{out} is a directory: name the plan file to write", option="out")
        check_apart(out, "plan", [args.bundle] if not args.save else [])
        inside = bundle in out.resolve().parents
        if inside and (is_package(bundle) or out.resolve() != bundle / PLAN_FILE):  # its files are the bundle's
            raise BadInputError(f"--out {out} is inside {args.bundle}: write the plan elsewhere, or into a bundle "
                                f"as {PLAN_FILE} with --save", option="out")
    report = (lambda _line: None) if args.json else (lambda line: print(line, file=sys.stderr))
    result = plan_bundle(args.bundle, options, report)
    doc = result.document
    for out in outs:
        try:
            write_whole(out, json.dumps(doc, indent=2) + "\n")
        except OSError as e:
            raise MirrorSDError(f"cannot write {out}: {e}") from None
    if args.json:
        print(json.dumps(doc))
        return 0
    chosen, best = result.chosen, result.plans[0]
    c, t = chosen.choice, chosen.terms
    m = doc["runtime"]["measured"]
    print("\n".join(iter_table(result.plans, args.rows)))
    print()
    swept = ", ".join(f"{t}: {v:.1f}" for t, v in m["tokens_per_second_by_draft_confidence_threshold"].items())
    print(f"runtime (this bundle, exit layer {c.exit_layer}): gamma {doc['runtime']['gamma']}, kappa {c.kappa}, "
          f"branch budget {doc['runtime']['branch_budget']}, threads "
          f"{doc['runtime']['target_threads']}+{doc['runtime']['draft_threads']}, draft confidence threshold "
          f"{doc['runtime']['draft_confidence_threshold']} on each {doc['runtime']['draft_confidence_rule']} "
          f"(measured tok/s by threshold: {swept})")
    if "tokens_per_second_by_draft_backend" in m:
        runtimes = ", ".join(f"{n}: {v:.1f}" for n, v in m["tokens_per_second_by_draft_backend"].items())
        print(f"  draft on {doc['runtime']['draft_backend']} (the draft runs on the CPU; measured tok/s: {runtimes})")
    if "tokens_per_second_by_branch_budget" in m:
        budgets = ", ".join(f"{n}: {v:.1f}" for n, v in m["tokens_per_second_by_branch_budget"].items())
        kept = "with branch sets" if doc["runtime"]["branch_budget"] else "without branch sets (every draft step sd's)"
        print(f"  mirror {kept} (measured tok/s by branch budget: {budgets})")
    if "tokens_per_second_by_gamma" in m:
        gammas = ", ".join(f"{n}: {v:.1f}" for n, v in m["tokens_per_second_by_gamma"].items())
        print(f"  gamma {doc['runtime']['gamma']} (the model's {c.gamma}; measured tok/s by gamma: {gammas})")
    print(f"  step {t.step_s * 1e3:.2f} ms = prefix {t.prefix_s * 1e3:.2f} + rendezvous {t.rendezvous_s * 1e3:.2f} "
          f"+ hit {t.hit_rate:.2f} x max(suffix {t.suffix_wall_s * 1e3:.2f}, branches {t.draft_wall_s * 1e3:.2f}) "
          f"+ miss x (suffix + rollout {t.draft_rollout_s * 1e3:.2f}); {t.tokens_per_step:.2f} tokens/step "
          f"(alpha {t.alpha:.2f})")
    ratio = m["predicted_over_measured"]
    verdict = "" if ratio is None else f", predicted/measured {ratio:.2f}" + (
        "" if abs(ratio - 1) <= 0.15 else " [outside 15%]")
    modelled = m.get("modelled_setting_tokens_per_second", m["tokens_per_second"])
    print(f"  predicted {chosen.predicted_tokens_per_second:.1f} tok/s, measured {modelled:.1f} tok/s with its "
          f"branch sets (decode){verdict}; kept: {m['tokens_per_second']:.1f} tok/s "
          f"({m['end_to_end_tokens_per_second']:.1f} with prefill)")
    if "end_to_end_tokens_per_second_by_mode" in m:
        modes = ", ".join(f"{n}: {v:.1f}" for n, v in m["end_to_end_tokens_per_second_by_mode"].items())
        print(f"  mode {doc['runtime']['mode']} for generations that name none (measured tok/s as generations run, "
              f"prefill included: {modes})")
    if best.needs_export:
        print(f"export advice: exit layer {best.choice.exit_layer}, top_k {best.choice.kappa} predicts "
              f"{best.predicted_tokens_per_second:.1f} tok/s (needs a new export: mirror-sd export ... --plan FILE)")
    else:
        print(f"export advice: keep exit layer {best.choice.exit_layer} (top_k {best.choice.kappa} is enough)")
    for out in outs:
        print(f"wrote {out}")
    return 0


def _add_app_flags(parser: argparse.ArgumentParser, request_timeout: float, log_level: str) -> None:
    """The flags of the server's app that `serve` and `run-batch` share: its model names, deadline, logging, parsers,
    generation defaults and load options."""
    parser.add_argument("--model-name", "--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the model id requests name, and any further names they may use (answers give the "
                             "first) (default: the bundle's folder name)")
    parser.add_argument("--request-timeout", type=float, default=request_timeout,
                        help=f"seconds a request may take, queueing included (default {request_timeout:g})")
    parser.add_argument("--log-level", default=log_level, choices=LOG_LEVELS,
                        help=f"the server's logging to stderr; info logs one line per request (default: {log_level})")
    parser.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                        help="read answers to tool_choice auto (OpenAI's default with tools) for calls in this format: "
                             "hermes (<tool_call> JSON </tool_call>: Qwen2.5, Qwen3, Hermes), llama3_json (an answer "
                             "of JSON calls: Llama 3.1-3.3), pythonic ([f(x=1), g()]: Llama 3.2, Llama 4), mistral "
                             "([TOOL_CALLS] and its calls: Mistral, Mixtral), qwen3_coder (<tool_call><function=f>"
                             "<parameter=x>: Qwen3-Coder, Qwen3.5) (default: none, auto refused)")
    parser.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                        help="read a reasoning model's <think> block as the chat message's reasoning (and "
                             "reasoning_content), the rest as its content: deepseek_r1 (DeepSeek-R1, its "
                             "distillations, QwQ), qwen3 (Qwen3; chat_template_kwargs enable_thinking false: "
                             "content) (default: none)")
    parser.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                        help="where the sampling defaults of requests come from: auto, the bundle's "
                             "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
                             "max_new_tokens); vllm, none (OpenAI's); or a folder holding a generation_config.json "
                             "(default: auto)")
    parser.add_argument("--override-generation-config", default=None, metavar="JSON",
                        help="generation_config.json keys over that source's, e.g. '{\"temperature\": 0.6}'")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="vLLM's switch for tool_choice auto, taken for its command lines: here --tool-call-parser "
                             "turns auto on (this flag needs one)")
    add_options(parser, GenerationConfig, SERVE_GENERATION, shown=SERVE_SHOWN)  # a request's own value wins
    add_options(parser, LoadOptions, LOAD_FLAGS["serve"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mirror-sd", description="Mirror Speculative Decoding: export, plan and run.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("export", help="export a target + draft pair to a validated bundle")
    p.add_argument("--model", required=True, help="target: Hugging Face id or local directory")
    p.add_argument("--draft", required=True, help="draft: Hugging Face id or local directory, same vocabulary")
    p.add_argument("--out", required=True, help="bundle directory to write (must not exist or be empty)")
    p.add_argument("--exit-layer", type=int, default=None,
                   help="early-exit layer l_e (default: the plan's, else num_layers // 2)")
    p.add_argument("--top-k", type=int, default=None,
                   help="early-exit candidates per position k (default: the plan's, else 8)")
    p.add_argument("--plan", default=None, help="a plan file from `mirror-sd plan`: exit layer and k where not given")
    p.add_argument("--exit-adapter", default=None,
                   help="trained exit adapter directory (replaces the logit lens; sets the exit layer)")
    p.add_argument("--exit-vocab", default="draft", choices=("draft", "full"),
                   help="the early-exit head's vocabulary: the draft's own where it has a reduced one (default; the "
                        "head then reads those rows of the LM head only) or the full vocabulary")
    p.add_argument("--draft-weights", default="int8", choices=DRAFT_WEIGHT_FORMATS,
                   help="the draft graph's MatMul weights: int8 (default: 8-bit blocks, a forward several times faster "
                        "on CPU; the output is the target's either way) or float32")
    p.add_argument("--target-dtype", default="float32", choices=TARGET_DTYPES,
                   help="what the target graphs compute in: float32 (default; CPU and OpenVINO) or float16 (the CUDA "
                        "execution provider, whose fused attention has no float32 kernel)")
    p.add_argument("--target-weights", default="float32", choices=TARGET_WEIGHT_FORMATS,
                   help="the target's MatMul weights: float32 (default), or int8 / int4 blocks (a decode step reads "
                        "a quarter / an eighth of the bytes; sd and mirror stay exact against the target so "
                        "compressed, and the export records how often it agrees with the float32 model)")
    p.add_argument("--force", action="store_true", help="replace an earlier bundle at --out")
    p.set_defaults(func=_export)

    g = sub.add_parser("generate", help="generate text from a bundle (ar, sd or mirror decoding)")
    g.add_argument("bundle", help="bundle directory written by export, or a package (directory or .tar)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 5,17,33")
    add_options(g, GenerationConfig, shown={"apply_chat_template": "on"})
    add_options(g, LoadOptions, LOAD_FLAGS["generate"], GENERATE_LOAD_DEFAULTS)
    g.add_argument("--json", action="store_true", help='print {"token_ids", "text", "stats"} (and "logprobs" with '
                   '--logprobs, "prompt_logprobs" with --prompt-logprobs) as one JSON object')
    g.set_defaults(func=_generate)

    c = sub.add_parser("chat", help="a conversation with a bundle in the terminal: each line a user turn, the "
                       "answer streamed, earlier turns kept by the prefix cache")
    c.add_argument("bundle", help="bundle directory written by export, or a package (directory or .tar)")
    c.add_argument("--system", default=None, help="a system prompt that opens the conversation")
    # logprobs are not shown in a terminal's conversation, and a scored prompt would pass the prefix cache by;
    # every line is a turn of the chat template already
    add_options(c, GenerationConfig, [s.name for s in specs(GenerationConfig)
                                      if s.flag and s.name not in ("logprobs", "prompt_logprobs",
                                                                   "apply_chat_template")],
                shown={"max_new_tokens": "what the context leaves after the conversation"})
    add_options(c, LoadOptions, LOAD_FLAGS["chat"], GENERATE_LOAD_DEFAULTS)
    c.set_defaults(func=_chat)

    px = sub.add_parser("perplexity", help="the perplexity of a text file under a bundle's target (its precision "
                        "as deployed), in overlapping windows (transformers' strided recipe)")
    px.add_argument("bundle", help="bundle directory written by export, or a package (directory or .tar)")
    px.add_argument("--file", required=True, help="UTF-8 text, read as it is (no chat template)")
    px.add_argument("--window", type=int, default=None,
                    help=f"tokens per window (default {WINDOW}, or what the target's context holds)")
    px.add_argument("--stride", type=int, default=None,
                    help="tokens from one window's start to the next's, below the window (default: half of it); each "
                         "token after the first window is scored with at least window - stride tokens before it")
    add_options(px, LoadOptions, LOAD_FLAGS["perplexity"], GENERATE_LOAD_DEFAULTS)
    px.add_argument("--json", action="store_true", help='print {"perplexity", "nll", "tokens", "windows", "window", '
                    '"stride"} as one JSON object')
    px.set_defaults(func=_perplexity)

    pk = sub.add_parser("package", help="package a bundle for static-shape devices (NPU): static draft IR")
    pk.add_argument("bundle", help="bundle directory written by export")
    pk.add_argument("--out", required=True, help="package directory, or a file ending in .tar")
    pk.add_argument("--device", default="NPU", help="intended draft device: NPU (default), CPU or GPU")
    pk.add_argument("--weights", default=None,
                    help="draft weights: fp16, fp32, int8, int8_asym, int4 (default: int8 for a bundle whose draft has "
                         "int8 weights, the export's default, which allows no other; fp16 otherwise)")
    pk.add_argument("--group-size", type=int, default=64, help="int4 weights per quantisation group (default 64)")
    pk.add_argument("--max-prompt", type=int, default=None, help="longest prompt in tokens (default 1024)")
    pk.add_argument("--max-context", type=int, default=None, help="prompt + new tokens (default 2048)")
    pk.add_argument("--max-gamma", type=int, default=8, help="longest draft window (default 8)")
    pk.add_argument("--batch", type=int, default=8, help="rows of the branch graph (default 8)")
    pk.add_argument("--tokens-per-forward", type=int, default=None,
                    help="new tokens per draft forward (default: the draft's own, 1 + streams)")
    pk.add_argument("--prefill-chunk", type=int, default=32, help="prompt tokens per prefill forward (default 32)")
    pk.add_argument("--force", action="store_true", help="replace an earlier package at --out")
    pk.set_defaults(func=_package)

    pl = sub.add_parser("plan", help="measure a bundle and pick exit layer, k, gamma, branch budget and threads")
    pl.add_argument("bundle", help="bundle directory written by export")
    pl.add_argument("--calibration", type=int, default=6, help="calibration prompts (default 6)")
    pl.add_argument("--max-new-tokens", type=int, default=48, help="tokens per calibration prompt (default 48)")
    pl.add_argument("--gammas", type=_int_list, default=None, help="windows to measure, e.g. 2,4,6 (default)")
    pl.add_argument("--kappas", type=_int_list, default=None,
                    help="candidates per position to measure (default: the bundle's top_k and half of it)")
    pl.add_argument("--splits", type=_splits, default=None,
                    help="target+draft thread counts to measure, e.g. 1+1,2+1 (default: powers of two that fit)")
    pl.add_argument("--repeats", type=int, default=7, help="timed calls per measurement (default 7)")
    pl.add_argument("--rows", type=int, default=10, help="rows of the ranked table to print (default 10)")
    add_options(pl, LoadOptions, LOAD_FLAGS["plan"])
    pl.add_argument("--out", default=None, help="write the plan as JSON to this file")
    pl.add_argument("--save", action="store_true",
                    help="also write it into the bundle as plan.json: the runtime's defaults then come from it")
    pl.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    pl.set_defaults(func=_plan)

    sv = sub.add_parser("serve", help="serve a bundle over HTTP: OpenAI-compatible chat and completions")
    sv.add_argument("bundle", help="bundle directory written by export, or a package (directory or .tar)")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    sv.add_argument("--port", type=int, default=8000, help="default 8000")
    sv.add_argument("--max-queue", type=int, default=16, help="requests that may wait for a free generation slot "
                    "(--max-num-seqs) (default 16); more get 429 with Retry-After")
    sv.add_argument("--stored-responses", type=int, default=1024,
                    help="Responses API answers kept in memory for previous_response_id and GET /v1/responses/{id}, "
                         "the least recently used dropped (default 1024; 0: none; with --ray none are kept)")
    sv.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' on every route (401 "
                    f"otherwise) but /health, /metrics and /version (default: ${API_KEY_ENV} where set, else none)")
    sv.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                    help="a browser origin allowed to call the server, e.g. https://app.example.com or * for any "
                         "(repeatable, or comma-separated; default: none, no CORS headers)")
    sv.add_argument("--ssl-certfile", default=None, metavar="PEM",
                    help="serve HTTPS with this certificate chain (and its key, unless --ssl-keyfile) (default: HTTP)")
    sv.add_argument("--ssl-keyfile", default=None, metavar="PEM", help="the certificate's private key, unencrypted")
    sv.add_argument("--ssl-ca-certs", default=None, metavar="PEM",
                    help="authorities whose client certificates are taken (with --ssl-cert-reqs)")
    sv.add_argument("--ssl-cert-reqs", type=int, default=None, metavar="0|1|2",
                    help="client certificates: 0 not asked for (default), 1 checked where sent, 2 required")
    _add_app_flags(sv, request_timeout=600.0, log_level="info")
    sv.add_argument("--ray", action="store_true",
                    help="serve on Ray Serve: --replicas replicas, each loading the bundle in a process of its own, "
                         "behind Ray's HTTP proxy on --host:--port (needs pip install 'mirror-sd[ray]')")
    sv.add_argument("--replicas", type=int, default=None, help="with --ray: replicas to run (default 1)")
    sv.add_argument("--ray-address", default=None,
                    help="with --ray: local (default: a Ray instance of this command's own), auto (the cluster "
                         "`ray start` runs on this machine) or a cluster's address, e.g. 10.0.0.5:6379")
    sv.add_argument("--num-cpus", type=float, default=None,
                    help="with --ray: the CPUs Ray reserves for each replica (default 1; its target + draft threads "
                         "keep replicas off each other's cores)")
    sv.add_argument("--num-gpus", type=float, default=None,
                    help="with --ray: the GPUs for each replica (default 0; 1: a replica per GPU, with "
                         "--target-device cuda)")
    sv.set_defaults(func=_serve)

    rb = sub.add_parser("run-batch", help="answer a file of OpenAI Batch API requests offline, batched (as vllm "
                        "run-batch): chat completions, completions and responses")
    rb.add_argument("bundle", help="bundle directory written by export, or a package (directory or .tar)")
    rb.add_argument("-i", "--input-file", required=True,
                    help="JSON Lines, a request per line: {\"custom_id\": ..., \"method\": \"POST\", \"url\": "
                         "\"/v1/chat/completions\" (or /v1/completions, /v1/responses), \"body\": {...}}")
    rb.add_argument("-o", "--output-file", required=True,
                    help="JSON Lines, a line per request in the input's order: {\"id\", \"custom_id\", \"response\": "
                         "{\"status_code\", \"request_id\", \"body\"}, \"error\"}; written whole when the run ends")
    _add_app_flags(rb, request_timeout=86400.0, log_level="warning")
    rb.set_defaults(func=_run_batch)

    from mirror_sd.bench.cli import add_parser as add_bench_parser

    add_bench_parser(sub)
    return parser


def _terminated(*_: object) -> None:
    raise SystemExit(128 + signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # SIGTERM (a job's timeout, `kill`, systemd) unwinds as Ctrl-C does, so that nothing half-written is left (an
    # export's or a package's staging folder); `serve` installs handlers of its own
    previous = signal.signal(signal.SIGTERM, _terminated) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        return args.func(args)
    except MirrorSDError as e:
        print(f"mirror-sd: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("mirror-sd: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
