"""Scale-out on Ray Serve: `mirror-sd serve BUNDLE --ray --replicas N`, or
`serve run mirror_sd.serve.ray_app:build bundle=BUNDLE replicas=N` (Ray's application-builder pattern).

Each replica is a Ray actor that owns one Pipeline, loaded with the LoadOptions `mirror-sd serve` takes, and the
devices it names, and serves the single-process server's own FastAPI app (serve/app.py create_app) through
`@serve.ingress`: every route, error body and metric is `mirror-sd serve`'s; /health and /metrics describe the replica
that answered, which every response names in its `x-mirror-sd-replica` header.

Routing: Ray's HTTP proxy (one per node) sends each request to the less loaded of two replicas drawn at random (Ray
Serve's power-of-two-choices router, on the requests each replica has in flight). A replica takes at most its slots
(max_num_seqs, or what kv_cache_gb holds) + max_queue requests at once (`max_ongoing_requests`): what its engine runs
plus its FIFO, the bound a single server keeps before it answers 429 (a request of n choices counts once here, n times
there). Beyond that a proxy holds up to max_queue requests until a replica has room (`max_queued_requests`), then
answers 429 with Retry-After, as a full single server does.

Failure: Ray replaces a replica whose actor dies (its process crashed or was killed) or whose health check fails
(`check_health`: the batching engine's thread has stopped). Requests in flight on it fail (the proxy answers 500, or
a stream breaks off); the others go on, and the proxies route new requests to the replicas alive meanwhile.

Ray is imported inside the functions that use it: the runtime and `mirror-sd serve` without --ray install without it
(pyproject.toml's `ray` extra).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from mirror_sd.errors import BadInputError, MirrorSDError, check_int
from mirror_sd.partitions.manifest import Manifest
from mirror_sd.partitions.package_format import is_package
from mirror_sd.runtime.config import GenerationConfig, LoadOptions, Spec, specs
from mirror_sd.runtime.kv_slots import slots_for
from mirror_sd.runtime.pipeline import Pipeline
from mirror_sd.runtime.target import GPU_STEP_WIDTH, kv_element, kv_positions
from mirror_sd.serve.app import ServerSettings, create_app, listen, open_server
from mirror_sd.serve.defaults import API_KEY_ENV, LOG_LEVELS, SERVE_GENERATION, GenerationSource, server_defaults

APP_NAME = "mirror-sd"  # the Serve application `mirror-sd serve --ray` runs (serve run names its own)
DEPLOYMENT_NAME = "MirrorSD"
REPLICA_HEADER = "x-mirror-sd-replica"  # every response names the replica that answered it
INSTALL_HINT = "pip install 'mirror-sd[ray]'"
# A health check only reads whether the engine's thread runs; every few seconds costs nothing and notices a dead
# engine soon. A replica process that dies is noticed at once, without a health check.
HEALTH_CHECK_PERIOD_S = 5.0
HEALTH_CHECK_TIMEOUT_S = 10.0
# How long a stopping replica (SIGTERM, a redeploy, scale-down) lets its requests finish before Ray kills it; the
# single server's own bar (bench/soak.py SIGTERM_EXIT_BAR_S) is a stop within 5 s.
GRACEFUL_SHUTDOWN_S = 5.0
# A replica that cannot load its bundle (a path missing on one node, a device absent) fails alike every time: a few
# tries say so sooner than Ray's default 20.
CONSTRUCTOR_RETRIES = 3
PROXY_TIMEOUT_MARGIN_S = 30.0  # proxy_timeout_s: a replica at its deadline still sends its answer


@dataclass(frozen=True)
class ReplicaSpec:
    """What every replica loads and serves: what `mirror-sd serve` takes. Plain data, as Ray sends it to each
    replica's process."""

    bundle: str  # a bundle or package path that every node running a replica can read
    # ServerSettings' fields but `defaults`: those the replica makes, as `mirror-sd serve` does, from the bundle it
    # loaded and `generation`
    settings: Mapping[str, Any]
    load: LoadOptions = field(default_factory=LoadOptions)
    generation: Mapping[str, Any] = field(default_factory=dict)  # the serve command's SERVE_GENERATION given
    # where the sampling defaults come from (--generation-config; a folder every node can read)
    source: GenerationSource = field(default_factory=GenerationSource)
    log_level: str = "warning"  # the replica's logging (its stderr reaches the driver and Ray's log files)

    def __post_init__(self) -> None:
        # a copy Ray can pickle (no mappingproxy); a replica's kept Responses answers are its own, and Ray's router
        # may send the next turn to another: none are kept (docs/scale-out.md)
        object.__setattr__(self, "settings", {**self.settings, "stored_responses": 0})
        object.__setattr__(self, "generation", dict(self.generation))
        if self.log_level not in LOG_LEVELS:
            raise BadInputError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}",
                                option="log_level")
        self.settings_without_bundle()  # bad settings or options are refused here, before any replica starts

    def settings_without_bundle(self) -> ServerSettings:
        """The server settings as far as they are known without the bundle (its generation_config.json aside)."""
        return ServerSettings(**self.settings, defaults=server_defaults(None, self.generation, self.source))

    def server(self) -> tuple[Pipeline, ServerSettings]:
        """The pipeline and the settings `mirror-sd serve` would make of the same command (mirror_sd/cli.py)."""
        return open_server(self.bundle, self.load, self.settings, self.generation, self.source)


@dataclass(frozen=True)
class Placement:
    """How many replicas, and what each one reserves from Ray's scheduler (its ray_actor_options)."""

    replicas: int = 1
    # Ray places no more replicas on a node than its CPUs allow: set this to the replica's threads (target +
    # draft) so that replicas do not share cores
    num_cpus: float = 1.0
    # 1: a replica per GPU (Ray sets its CUDA_VISIBLE_DEVICES; the target runs with target_device cuda)
    num_gpus: float = 0.0
    # custom node resources, e.g. {"NPU": 1} on nodes started with `ray start --resources '{"NPU": 1}'`
    resources: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_int("replicas", self.replicas, 1)
        for name in ("num_cpus", "num_gpus"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise BadInputError(f"{name} must be a number >= 0, got {value!r}", option=name)
        if not all(isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
                   for k, v in self.resources.items()):
            raise BadInputError(f"resources must map names to numbers >= 0, got {dict(self.resources)!r}",
                                option="resources")

    def actor_options(self) -> dict[str, Any]:
        out: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.resources:
            out["resources"] = dict(self.resources)
        return out


class _ReplicaHeader:
    """ASGI middleware adding REPLICA_HEADER to every response: which replica answered (a stream's headers come
    before its first token, so a client knows which replica holds it while it runs)."""

    def __init__(self, app: Callable, replica: str) -> None:
        self.app, self.replica = app, replica.encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (REPLICA_HEADER.encode(), self.replica)]
            await send(message)

        await self.app(scope, receive, send_named)


class Replica:
    """One replica: a Pipeline of its own and the single server's app over it (`serve.ingress()` late-binds the
    app: it is built in the replica's process, over the pipeline that process loaded)."""

    def __init__(self, spec: ReplicaSpec) -> None:
        _log_to_stderr(spec.log_level)
        self.pipe, self.settings = spec.server()
        self.engine = self.pipe.engine()  # started here: the first request does not pay for it, and health reads it

    def __serve_build_asgi_app__(self) -> Any:
        app = create_app(self.pipe, self.settings)
        app.add_middleware(_ReplicaHeader, replica=_serve().get_replica_context().replica_id.unique_id)
        return app

    def check_health(self) -> None:
        """Ray calls this every HEALTH_CHECK_PERIOD_S; raising marks the replica unhealthy and Ray replaces it."""
        if not self.engine.alive:
            raise RuntimeError("the batching engine's thread has stopped")


def _log_to_stderr(level: str) -> None:
    """The project's loggers (errors, and at info one line per request: serve/access_log.py) to the replica's
    stderr, as `mirror-sd serve` writes them to its own; Ray configures only its own loggers in a replica."""
    logger = logging.getLogger("mirror_sd")
    logger.setLevel(level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False  # not twice through a root handler


# -- Ray ----------------------------------------------------------------------------------------------------------
def _ray() -> ModuleType:
    try:
        import ray
    except ImportError:
        raise MirrorSDError(f"serving on Ray needs Ray Serve, which is not installed: {INSTALL_HINT}") from None
    return ray


def _serve() -> ModuleType:
    _ray()
    try:
        from ray import serve
    except ImportError:
        raise MirrorSDError(f"Ray is installed without Ray Serve: {INSTALL_HINT}") from None
    return serve


def replica_slots(spec: ReplicaSpec) -> int:
    """The generations a replica's engine runs at once: max_num_seqs, fewer where kv_cache_gb holds fewer KV slots
    (each counted at the widest a target's buffers get, GPU_STEP_WIDTH's padding: never more than the replica has).
    A package's replicas are left at max_num_seqs."""
    load = spec.load
    if load.kv_cache_gb is None or is_package(spec.bundle):
        return load.max_num_seqs
    manifest = Manifest.load(spec.bundle)
    positions = kv_positions(manifest, load.max_context, GPU_STEP_WIDTH)[1]
    return slots_for(manifest, positions, load.max_num_seqs, load.kv_cache_gb,
                     kv_element(manifest, load.kv_cache_precision))


def application(spec: ReplicaSpec, placement: Placement) -> Any:
    """The Serve application (`serve.run` takes it): `placement.replicas` replicas of `spec`."""
    serve = _serve()
    settings = spec.settings_without_bundle()
    deployment = serve.deployment(
        serve.ingress()(Replica), name=DEPLOYMENT_NAME, num_replicas=placement.replicas,
        ray_actor_options=placement.actor_options(),
        max_ongoing_requests=replica_slots(spec) + settings.max_queue,
        # Ray takes -1 (no limit) or a positive count: max_queue 0 (none wait at a replica) still lets one wait at
        # each proxy
        max_queued_requests=max(settings.max_queue, 1),
        backpressure_config={"status_code": 429, "retry_after_s": settings.retry_after_s},
        health_check_period_s=HEALTH_CHECK_PERIOD_S, health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
        graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S, max_constructor_retry_count=CONSTRUCTOR_RETRIES,
        # Ray's own replica logging at the same level; the project's access log (serve/access_log.py) already
        # writes a line per request at info
        logging_config={"log_level": spec.log_level.upper(), "enable_access_log": False})
    return deployment.bind(spec)


def running_replicas(app_name: str = APP_NAME) -> int:
    """Replicas of the application's deployment that Ray reports RUNNING (0 where it has none yet)."""
    app = _serve().status().applications.get(app_name)
    deployment = app.deployments.get(DEPLOYMENT_NAME) if app else None
    return deployment.replica_states.get("RUNNING", 0) if deployment else 0


def proxy_timeout_s(settings: ServerSettings) -> float:
    """Ray's proxies' limit on a request, past the replica's own deadline (request_timeout_s, by which it has
    answered): it cuts only a request whose replica will never answer, with a 408. Without it such a request waits
    on: one in flight on a killed replica did, now and then, until its client gave up (bench/soak.py's Ray phase)."""
    return settings.request_timeout_s + PROXY_TIMEOUT_MARGIN_S


class _Stop(Exception):
    """SIGINT or SIGTERM arrived (raised by the handler `run` installs, wherever the main thread is)."""


def run(spec: ReplicaSpec, placement: Placement, address: str, host: str, port: int,
        report: Callable[[str], None] = print) -> None:
    """`mirror-sd serve --ray`: start a local Ray instance (address "local") or join a cluster (an address, or
    "auto": the one `ray start` runs on this machine), serve the application on host:port of every node's proxy
    until SIGINT or SIGTERM, then delete it (and stop the local instance). A signal while the replicas still start
    (a deployment Ray cannot place waits for resources for ever) stops it as well."""
    ray, serve = _ray(), _serve()
    _check_bundle(spec.bundle)
    if address == "local":  # this command's own proxy binds host:port: a port in use is refused before Ray starts
        listen(host, port).close()
    settings = spec.settings_without_bundle()
    try:
        ray.init(address=address, logging_level="WARNING")
    except ConnectionError as e:
        raise MirrorSDError(f"cannot join the Ray cluster at {address!r}: {e}") from None
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # this process's part: no progress lines at info

    def stop(*_: Any) -> None:
        raise _Stop

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}  # ray.init sets its own
    try:
        # a cluster whose Serve already runs keeps its proxies' options (Ray says so in a warning)
        serve.start(http_options={"host": host, "port": port, "request_timeout_s": proxy_timeout_s(settings)},
                    logging_config={"log_level": "WARNING"})
        serve.run(application(spec, placement), name=APP_NAME, route_prefix="/")
        n = running_replicas()
        report(f"mirror-sd: serving {settings.model_name!r} on http://{host}:{port}/v1 from {n} replica"
               f"{'' if n == 1 else 's'} on Ray (cluster {ray.get_runtime_context().gcs_address}; API key "
               f"{'required' if settings.api_key else 'not required'})")
        while True:
            time.sleep(3600)
    except _Stop:
        report("mirror-sd: stopping the replicas")
    finally:
        for sig in previous:  # a second signal must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        try:
            if address == "local":
                serve.shutdown()
            else:  # a shared cluster: take away this application only
                serve.delete(APP_NAME)
        finally:
            ray.shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)


# -- `serve run mirror_sd.serve.ray_app:build key=value ...` ------------------------------------------------------
def build(args: Mapping[str, Any]) -> Any:
    """Ray's application builder: `serve run mirror_sd.serve.ray_app:build bundle=DIR replicas=2 num_cpus=2
    target_threads=1`, or a Serve config file's `import_path: mirror_sd.serve.ray_app:build` with these keys under
    `args`. Keys: bundle (required); replicas, num_cpus, num_gpus, resources (JSON: {"NPU": 1}); model_name (a list:
    several names), max_queue, request_timeout, cors_origins (comma-separated), log_level, tool_call_parser,
    reasoning_parser, generation_config, override_generation_config (JSON); every load option of `mirror-sd serve
    --help` by its name (target_device, target_threads, max_num_seqs, ...); mode and max_new_tokens. Values may be text
    (the command line's) or typed (a config file's). The API key, if any, comes from $MIRROR_SD_API_KEY where the
    builder runs, as `mirror-sd serve` reads it: never from a command line."""
    spec, placement = parse_build_args(args, os.environ.get(API_KEY_ENV) or None)
    _check_bundle(spec.bundle)
    return application(spec, placement)


def parse_build_args(args: Mapping[str, Any], api_key: str | None = None) -> tuple[ReplicaSpec, Placement]:
    """The builder's arguments as a ReplicaSpec and a Placement; an unknown key or a bad value is a BadInputError
    naming it."""
    args = dict(args)
    if "bundle" not in args:
        raise BadInputError("the builder needs bundle=PATH (a bundle directory or a package)", option="bundle")
    load_specs = {s.name: s for s in specs(LoadOptions) if s.flag}
    gen_specs = {s.name: s for s in specs(GenerationConfig) if s.name in SERVE_GENERATION}
    own = {"bundle", "replicas", "num_cpus", "num_gpus", "resources", "model_name", "max_queue", "request_timeout",
           "cors_origins", "log_level", "tool_call_parser", "reasoning_parser", "generation_config",
           "override_generation_config"}
    unknown = sorted(set(args) - own - set(load_specs) - set(gen_specs))
    if unknown:
        raise BadInputError(f"unknown builder argument(s) {', '.join(unknown)}; known: "
                            f"{', '.join(sorted(own | set(load_specs) | set(gen_specs)))}")
    bundle = str(args["bundle"])
    max_queue = _number(args, "max_queue", int, ServerSettings.max_queue)
    check_int("max_queue", max_queue, 0)
    timeout = _number(args, "request_timeout", float, ServerSettings.request_timeout_s)
    if not timeout > 0:
        raise BadInputError(f"request_timeout must be > 0, got {timeout}", option="request_timeout")
    origins = args.get("cors_origins") or ()
    if isinstance(origins, str):
        origins = tuple(o.strip() for o in origins.split(",") if o.strip())
    # an unknown parser is refused by ServerSettings (ReplicaSpec checks its settings when made)
    names = args.get("model_name") or Path(bundle).resolve().name  # a config file's list: the first, then aliases
    names = [str(n) for n in names] if isinstance(names, list | tuple) else [str(names)]
    settings = {"model_name": names[0], "model_aliases": tuple(names[1:]), "max_queue": max_queue,
                "request_timeout_s": timeout, "api_key": api_key, "cors_origins": tuple(origins),
                "tool_call_parser": args.get("tool_call_parser") or None,
                "reasoning_parser": args.get("reasoning_parser") or None}
    load = LoadOptions().updated(**{k: _option(load_specs[k], v) for k, v in args.items() if k in load_specs})
    generation = {k: _option(gen_specs[k], v) for k, v in args.items() if k in gen_specs}
    resources = args.get("resources") or {}
    if isinstance(resources, str):
        try:
            resources = json.loads(resources)
        except ValueError:
            raise BadInputError(f"resources must be a JSON object such as '{{\"NPU\": 1}}', got {resources!r}",
                                option="resources") from None
    if not isinstance(resources, dict):
        raise BadInputError(f"resources must be a JSON object, got {resources!r}", option="resources")
    placement = Placement(_number(args, "replicas", int, 1), _number(args, "num_cpus", float, 1.0),
                          _number(args, "num_gpus", float, 0.0), resources)
    source = GenerationSource.given(args.get("generation_config"), args.get("override_generation_config"))
    spec = ReplicaSpec(bundle, settings, load, generation, source, str(args.get("log_level", "warning")))
    return spec, placement


def _number(args: Mapping[str, Any], name: str, kind: type, default: Any) -> Any:
    value = args.get(name, default)
    if isinstance(value, str):
        try:
            return kind(value)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise BadInputError(f"{name} must be {what}, got {value!r}", option=name) from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _option(spec: Spec, value: Any) -> Any:
    """A builder argument for an option: text converted as the command line converts its flag (its kind, "auto"
    and the like for None, true/false for a switch); a typed value (from a config file) as it is. The option's own
    checks run when the options object is made."""
    if not isinstance(value, str):
        return value
    if spec.option.none_word is not None and value == spec.option.none_word:
        return None
    if spec.kind is str:
        return value
    if spec.kind is bool:
        if value.lower() in ("true", "1", "yes", "on"):
            return True
        if value.lower() in ("false", "0", "no", "off"):
            return False
        raise BadInputError(f"{spec.name} must be true or false, got {value!r}", option=spec.name)
    if spec.kind is tuple:
        return (value,)
    try:
        return spec.kind(value)
    except ValueError:
        raise BadInputError(f"{spec.name} must be {'an integer' if spec.kind is int else 'a number'}, got "
                            f"{value!r}", option=spec.name) from None


def _check_bundle(bundle: str) -> None:
    """A missing or unreadable bundle is this command's error, not a replica's that Ray retries: checked where the
    application is built (on a cluster, every node running a replica needs the same path)."""
    if not Path(bundle).exists():
        raise BadInputError(f"no bundle or package at {bundle}", option="bundle")
    if not is_package(bundle):
        Manifest.load(bundle)  # ManifestError: not a bundle, or a broken one
