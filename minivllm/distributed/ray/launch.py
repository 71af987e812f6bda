"""`minivllm serve --replicas N [--ray-address ADDR]`: start (or join) a Ray cluster, deploy N engine
replicas as a Ray Serve application, and serve today's HTTP (and gRPC) front on a RayEngineClient.

The front is not a Serve ingress: it is the same FastAPI app as a single server (every route, error
shape and SSE/WebSocket stream unchanged), running in this process and calling the replicas through a
DeploymentHandle with the least-loaded router (router.py). Serve's own HTTP proxy is disabled.
Each front deploys an application of its own name, so several fronts can share one cluster.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any
from urllib.parse import urlsplit

from minivllm.config import EngineArgs, cpu_count
from minivllm.engine.tokenizer import get_tokenizer
from minivllm.entrypoints.metrics import ServerMetrics
from minivllm.entrypoints.server_args import ServerArgs, uvicorn_limits
from minivllm.entrypoints.serving import served_model_name
from minivllm.model_config import ModelConfig

logger = logging.getLogger(__name__)

_CONNECT_TIMEOUT_S = 3.0
_READY_TIMEOUT_S = 120.0


def check_reachable(address: str) -> None:
    """Fail fast (ValueError) when nothing listens at a Ray address (ray.init would retry for a minute)."""
    if address == "auto":
        return  # ray.init(address="auto") fails at once when no local cluster runs
    parts = urlsplit(address if "://" in address else f"gcs://{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if not host or not port:
        raise ValueError(f"ray_address: expected HOST:PORT, ray://HOST:PORT or auto, got {address!r}")
    try:
        socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise ValueError(f"ray_address: no Ray cluster reachable at {address} ({e}); start one with `ray start "
                         "--head` there, or leave --ray-address out to start a local cluster") from None


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ValueError("--replicas needs Ray Serve: pip install -e '.[ray]'") from None
    return ray


def _loopback_only() -> None:
    """Make the local cluster this process starts listen on loopback only.

    Ray binds its servers (GCS, raylet, object manager, workers' and agents' gRPC) to the node's address, and
    turns a loopback node address given to ray.init or `ray start` into the machine's outward address, so every
    port is reachable from the network, with no authentication a client has to know about. Its single-machine
    mode (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, the default on Windows and macOS) takes 127.0.0.1 as the node
    address instead. The environment variable reaches the processes Ray starts; the constant is the value this
    process read when it imported ray (possibly before this call)."""
    import ray._private.ray_constants as ray_constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def _connect(ray: Any, address: str | None, num_cpus: int) -> bool:
    """Join the cluster at `address` (whose network its operator secures), or start a local one bound to
    loopback (True: this process owns it)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no telemetry calls from an offline machine
    if address:
        check_reachable(address)
        ray.init(address=address, logging_level=logging.WARNING, configure_logging=False)
        return False
    _loopback_only()
    ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING, configure_logging=False,
             _node_ip_address="127.0.0.1")
    return True


def _wait_reports(board: Any, n: int) -> dict[str, dict[str, Any]]:
    import ray

    deadline = time.time() + _READY_TIMEOUT_S
    while True:
        reports = ray.get(board.snapshot.remote())
        if sum(1 for r in reports.values() if r.get("running")) >= n or time.time() > deadline:
            return reports
        time.sleep(0.2)


def run_replicated_server(engine_args: EngineArgs, server_args: ServerArgs) -> None:
    """Deploy the replicas, serve the front until interrupted, then remove the application (and stop the
    cluster if this process started it)."""
    n = server_args.replicas
    assert n is not None
    if engine_args.tensor_parallel_size > 1:
        raise ValueError("tensor_parallel_size > 1 with replicas is not supported: each replica would spawn its "
                         "own process group; serve tensor-parallel replicas one server each instead")
    if engine_args.enable_lora:
        raise ValueError("enable_lora with replicas is not supported yet: the front routes by load, not by adapter, "
                         "and cannot load adapters into the replicas; serve LoRA adapters from one server")
    # What the replicas would fail on, checked here in a second rather than after the cluster starts.
    assert engine_args.model is not None  # EngineArgs.__post_init__ fills in the default model
    ModelConfig.from_pretrained(engine_args.model)
    tokenizer = get_tokenizer(engine_args.model)
    if engine_args.num_threads is None:  # the cores shared between the replicas of a local cluster
        engine_args.num_threads = max(1, cpu_count() // n)
    threads = engine_args.num_threads
    ray = _import_ray()
    owns_cluster = _connect(ray, server_args.ray_address, max(cpu_count(), n * threads))
    app_name = f"minivllm-{socket.gethostname()}-{os.getpid()}"
    try:
        import uvicorn
        from ray import serve
        from ray.serve.config import RequestRouterConfig

        from minivllm.distributed.ray.client import RayEngineClient
        from minivllm.distributed.ray.metrics import ReplicaCollector, RouterMetrics
        from minivllm.distributed.ray.replica import EngineReplica, ReplicaBoard
        from minivllm.distributed.ray.router import LeastLoadedRouter
        from minivllm.entrypoints.api_server import build_app

        serve.start(proxy_location="Disabled")  # the front below is the only ingress
        board = ReplicaBoard.remote()  # type: ignore[attr-defined]  # an actor class (@ray.remote), typed as the class
        model_name = served_model_name(str(engine_args.model), server_args)
        # (Serve's overloads type deployment(cls, **options) as a decorator factory; given a class it is a Deployment)
        deployment: Any = serve.deployment(
            EngineReplica, name="EngineReplica", num_replicas=n,
            # Serve's per-replica cap on calls in flight: above what the engine admits, so that its own 429
            # (max_waiting) answers overload rather than calls queueing unseen in the router.
            max_ongoing_requests=engine_args.max_num_seqs + engine_args.max_waiting,
            health_check_period_s=2.0, health_check_timeout_s=30.0, graceful_shutdown_timeout_s=5.0,
            ray_actor_options={"num_cpus": threads},
            # (request_router_class takes a class or an import path; ray's pydantic model reaches mypy as taking a dict)
            request_router_config=RequestRouterConfig(request_router_class=LeastLoadedRouter))  # type: ignore[arg-type]
        logger.info("deploying %d replica(s) of %s (%d thread(s) each) as Serve application %s", n,
                    engine_args.model, threads, app_name)
        handle = serve.run(deployment.bind(engine_args, model_name, board), name=app_name, route_prefix=None)
        info = handle.describe.remote().result()
        reports = _wait_reports(board, n)
        metrics = ServerMetrics(model_name, info["num_speculative_tokens"], engine_metrics=False)
        collector = ReplicaCollector()
        metrics.registry.register(collector)
        client = RayEngineClient(handle, board, info, tokenizer, RouterMetrics(metrics.registry, model_name, n),
                                 collector)
        client.update(reports)
        app = build_app(client, server_args, metrics)
        logger.info("serving %s from %d replica(s) on http://%s:%d", model_name, n, server_args.host,
                    server_args.port)
        uvicorn.run(app, host=server_args.host, port=server_args.port, log_level=server_args.log_level,
                    timeout_graceful_shutdown=5, **uvicorn_limits(server_args))
    finally:
        _teardown(ray, app_name, owns_cluster)


def _teardown(ray: Any, app_name: str, owns_cluster: bool) -> None:
    from ray import serve

    try:
        if owns_cluster:
            serve.shutdown()
        else:
            serve.delete(app_name)
    except Exception:  # noqa: BLE001 - the cluster may already be gone
        logger.exception("could not remove the Serve application %s", app_name)
    ray.shutdown()
