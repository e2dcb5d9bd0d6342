"""The Ray Serve application: GraphserveIngress (HTTP, prefix keys) in front of GraphserveReplica ×N
(one engine each), the replicas' handle routed by PrefixAffinityRouter. Ray Serve runs it:

    graphserve serve --ray --replicas 2                   # this file's serve_on_ray
    serve run configs/ray-serve.yaml                      # Ray's CLI; build_app reads the config's args

Replication, placement, restarts and autoscaling are Ray's; this file only says what a replica needs
(CPUs, GPUs = tensor-parallel ranks) and how its requests are routed."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve import Application

from graphserve.engine.config import EngineConfig
from graphserve.server.ray_app.ingress import GraphserveIngress, ingress_options
from graphserve.server.ray_app.replica import GraphserveReplica
from graphserve.server.ray_app.router import DEFAULT_IMBALANCE_THRESHOLD, PrefixAffinityRouter
from graphserve.server.settings import (
    ENGINE_KEYS,
    SERVER_KEYS,
    ServerSettings,
    SettingsError,
    default_config_path,
    merge_settings,
    read_config_file,
    resolve_config_path,
)

logger = logging.getLogger("graphserve.server")

APP_NAME = "graphserve"
REPLICA_DEPLOYMENT = "GraphserveReplica"
HEALTH_CHECK_PERIOD_S = 2.0  # a replica whose engine died is replaced within about this long
ROUTING_STATS_PERIOD_S = 1.0  # how often each replica's queue and KV use reach the router
# Ray Serve's throughput mode: replica code on the replica's own event loop, gRPC between the ingress and the
# replicas, the router in the caller's loop. On the 2-core machine it took Ray's processes from 0.37 to 0.27
# cores at 8 streams (docs/scaling.md). Without its direct ingress (the ingress replica's own HTTP server),
# which made every stop of an ingress replica (shutdown, redeploy) take 30 s. A Ray cluster started by hand
# takes these from its nodes' environment (deploy/ray-service.yaml sets them).
RAY_SERVE_MODE = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}


# the request routers a deployment can take: graphserve's, and Ray Serve's default (RequestRouterConfig's own
# default, named as Ray names it), for comparison
ROUTERS = {"prefix-affinity": PrefixAffinityRouter,
           "power-of-two": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"}


@dataclass(frozen=True)
class Scaling:
    """A fixed number of replicas, or Ray Serve autoscaling between min and max on ongoing requests; and how
    requests are routed to them."""

    replicas: int | None = None
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    imbalance_threshold: int = DEFAULT_IMBALANCE_THRESHOLD  # ray_app/router.py
    router: str = "prefix-affinity"  # a name in ROUTERS

    def __post_init__(self) -> None:
        autoscaling = (self.min_replicas, self.max_replicas, self.target_ongoing_requests)
        if self.replicas is not None and any(v is not None for v in autoscaling):
            raise SettingsError("give --replicas or --min-replicas/--max-replicas/--target-ongoing-requests, not both")
        if self.replicas is not None and self.replicas < 1:
            raise SettingsError(f"--replicas must be >= 1, got {self.replicas}")
        low, high = self.min_replicas or 0, self.max_replicas
        if high is not None and (high < 1 or high < low):
            raise SettingsError(f"--max-replicas must be >= 1 and >= --min-replicas, got {high}")
        if self.imbalance_threshold < 0:
            raise SettingsError(f"the imbalance threshold must be >= 0, got {self.imbalance_threshold}")
        if self.router not in ROUTERS:
            raise SettingsError(f"--router must be one of {', '.join(ROUTERS)}, got {self.router!r}")

    def router_config(self) -> RequestRouterConfig:
        kwargs = {"imbalance_threshold": self.imbalance_threshold} if self.router == "prefix-affinity" else {}
        return RequestRouterConfig(request_router_class=ROUTERS[self.router], request_router_kwargs=kwargs,
                                   request_routing_stats_period_s=ROUTING_STATS_PERIOD_S)

    def deployment_options(self) -> dict[str, Any]:
        if self.replicas is not None or all(v is None for v in (self.min_replicas, self.max_replicas,
                                                                 self.target_ongoing_requests)):
            return {"num_replicas": self.replicas or 1}
        autoscaling = {"min_replicas": self.min_replicas or 1, "max_replicas": self.max_replicas or 1}
        if self.target_ongoing_requests is not None:
            autoscaling["target_ongoing_requests"] = self.target_ongoing_requests
        return {"autoscaling_config": autoscaling}


def replica_resources(engine: EngineConfig) -> dict[str, float]:
    """What Ray reserves for one replica: its engine's GPUs (one per tensor-parallel rank) when it runs on
    CUDA, else its torch threads' cores (at least one)."""
    on_gpu = engine.device.startswith("cuda") or (engine.device == "auto" and Path("/proc/driver/nvidia").exists())
    if on_gpu:
        return {"num_cpus": 1, "num_gpus": engine.tensor_parallel_size}
    return {"num_cpus": engine.num_threads or 1}


def graphserve_application(server: ServerSettings, engine: EngineConfig, scaling: Scaling | None = None) -> Application:
    scaling = scaling or Scaling()
    if server.allow_runtime_lora_updating:
        raise SettingsError("allow_runtime_lora_updating: a load or unload would reach one replica of several; list "
                            "the adapters in lora_modules (every replica loads them)")
    replica = serve.deployment(
        GraphserveReplica,
        name=REPLICA_DEPLOYMENT,
        ray_actor_options=replica_resources(engine),
        # Ray's own bound on a replica's requests; graphserve's queue (--max-queue-len, 429) is the real one
        max_ongoing_requests=engine.max_num_seqs + server.max_queue_len,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_timeout_s=server.shutdown_timeout,
        request_router_config=scaling.router_config(),
        **scaling.deployment_options(),
    )
    ingress = serve.deployment(GraphserveIngress, **ingress_options())
    return ingress.bind(replica.bind(server, engine), server.max_body_bytes, server.chat_content_special_tokens)


def build_app(args: dict[str, Any]) -> Application:
    """`serve run` / a RayService's serveConfigV2: the application's `args` are graphserve's settings (the
    flag names with underscores, as in a TOML config), `config` naming a TOML file or preset; the replica
    count and resources are the deployments' options in the same YAML."""
    settings = dict(args or {})
    config = settings.pop("config", None)
    unknown = sorted(set(settings) - SERVER_KEYS - ENGINE_KEYS)
    if unknown:
        raise SettingsError(f"unknown graphserve settings in the application's args: {', '.join(unknown)}")
    path = resolve_config_path(config) if config else default_config_path()
    server, engine = merge_settings(read_config_file(path) if path else {}, settings)
    return graphserve_application(server, engine)


def serve_on_ray(server: ServerSettings, engine: EngineConfig, scaling: Scaling, address: str | None) -> int:
    """`graphserve serve --ray`: join the Ray cluster at `address` (default: RAY_ADDRESS, else a Ray started
    for this command), run the app on server.host:server.port, print the ready line, and serve until
    SIGINT / SIGTERM, which takes the app down (running requests get --shutdown-timeout)."""
    import ray

    if address is None and not os.environ.get("RAY_ADDRESS"):  # a Ray of our own: its processes inherit these
        for name, value in RAY_SERVE_MODE.items():
            os.environ.setdefault(name, value)
    ray.init(address=address, log_to_driver=True)
    try:
        serve.start(http_options={"host": server.host, "port": server.port})
        serve.run(graphserve_application(server, engine, scaling), name=APP_NAME, route_prefix="/")
        url = f"http://{server.host}:{server.port}"
        count = scaling.deployment_options().get("num_replicas", "autoscaling")
        print(f"graphserve ready: {url}/v1 (model {served_model(url, server.api_key)}; Ray Serve, replicas: {count})",
              flush=True)
        stop = {signal.SIGINT, signal.SIGTERM}
        signal.pthread_sigmask(signal.SIG_BLOCK, stop)
        signal.sigwait(stop)
        logger.info("stopping the Ray Serve application")
        serve.delete(APP_NAME)
        serve.shutdown()
    finally:
        ray.shutdown()
    return 0


def served_model(url: str, api_key: str | None) -> str:
    """The model id /v1/models answers through the endpoint (HTTP, so it works whatever the Ray Serve mode)."""
    request = urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)["data"][0]["id"]


def scaling_from_args(args: Any) -> Scaling:
    fields = {f.name for f in dataclasses.fields(Scaling)}
    return Scaling(**{k: v for k, v in vars(args).items() if k in fields and v is not None})
