"""GraphserveReplica: one Ray Serve replica is one graphserve engine: the engine-core process
(engine/core/process.py; its GPUs are its tensor-parallel ranks) and the same FastAPI app as
`graphserve serve` (server/app.py: every route, SSE, errors, metrics), served in this process through
call_asgi. Ray Serve places, restarts and scales the replicas; this class gives it:

- readiness: the constructor returns once the app's /health says ok (model loaded, warmed up), so a
  starting replica gets no traffic;
- health: check_health raises once the engine has died (kill -9 of the core included); Ray then
  replaces the replica. Its open streams have already ended with an error event, and requests that
  reach it meanwhile get a 503 `engine_dead` before any byte, which the ingress retries elsewhere;
- routing stats: queue, running requests and KV-cache use, for the request router (ray_app/router.py);
- routing info: the prefix cache's block size and hash root, and the tokenizer's files, so the ingress
  computes the same block keys as the engine (ray_app/routing_keys.py)."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray import serve

from graphserve.engine.config import EngineConfig
from graphserve.engine.stats import EngineStats
from graphserve.server.ray_app.asgi_call import call_asgi
from graphserve.server.ray_app.forwarded import ForwardedRequest, ReplicaQuery, ResponseHead
from graphserve.server.settings import ServerSettings

logger = logging.getLogger("graphserve.server")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
READY_POLL_S = 0.1


@dataclass(frozen=True)
class RoutingInfo:
    model_name: str
    base_models: frozenset[str]  # every name a request's model gives the base model by (the rest: adapters)
    block_size: int
    prefix_cache_root: bytes | None  # None: prefix caching is off
    tokenizer_files: dict[str, bytes]  # name -> contents, those of TOKENIZER_FILES the model has


@dataclass(frozen=True)
class ReplicaStatus:
    replica_id: str
    node_id: str  # the Ray node it runs on
    engine_core_pid: int
    status: str  # server/state.py's: ok, loading, draining, dead, failed
    stats: EngineStats


class GraphserveReplica:
    async def __init__(self, server: ServerSettings, engine: EngineConfig):
        from graphserve.engine.async_engine import AsyncEngine
        from graphserve.engine.core.process import start_core_process
        from graphserve.server.app import create_app_from_settings

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.stopped = False
        self.core, self.core_address, self.core_failure = start_core_process(engine)
        self.app = create_app_from_settings(AsyncEngine(engine, core_address=self.core_address, core_pid=self.core.pid),
                                            server, engine)
        self.state = self.app.state.graphserve
        self.lifespan = self.app.router.lifespan_context(self.app)
        await self.lifespan.__aenter__()
        try:
            await self._wait_ready()
        except BaseException:
            await self._stop()
            raise
        logger.info("replica %s ready: engine core pid %d, model %s", self.replica_id, self.core.pid,
                    self.state.model_name)

    async def _wait_ready(self) -> None:
        while (status := self.state.health()) != "ok":
            if status in ("failed", "dead"):
                from graphserve.server.supervisor import start_failure_cause

                cause = start_failure_cause(self.core_failure) or repr(self.state.startup_error)
                raise RuntimeError(f"graphserve: the engine could not start: {cause}")
            await asyncio.sleep(READY_POLL_S)

    async def handle_http(self, request: ForwardedRequest) -> AsyncIterator[ResponseHead | bytes]:
        """The app's response to one request: its head (with this replica's id), then its body chunks."""
        async for item in call_asgi(self.app, _scope(request), request.body):
            if isinstance(item, tuple):
                status, headers = item
                yield ResponseHead(status, headers, self.replica_id)
            else:
                yield item

    def check_health(self) -> None:
        """Ray's health check: raise once the engine has died, so that Ray replaces this replica."""
        if self.state.status() in ("failed", "dead"):
            raise RuntimeError(f"replica {self.replica_id}: the engine has stopped")

    def record_routing_stats(self) -> dict[str, Any]:
        """Polled by Ray's controller; the request router reads it as each replica's routing_stats."""
        stats = self.state.engine.stats()
        return {"engine_ok": self.state.status() == "ok", "waiting": stats.num_waiting,
                "running": stats.num_running, "kv_usage": stats.kv_cache_usage}

    def routing_info(self) -> RoutingInfo:
        info = self.state.engine.info
        folder = Path(info.model_path)
        files = {name: (folder / name).read_bytes() for name in TOKENIZER_FILES if (folder / name).is_file()}
        engine = self.state.engine
        base_models = frozenset({self.state.model_name, engine.model_name, engine.model_path})
        return RoutingInfo(self.state.model_name, base_models, info.block_size, info.prefix_cache_root, files)

    def replica_status(self, query: ReplicaQuery) -> ReplicaStatus:
        """Which replica this is, its engine-core process and the engine's figures; `query.exclude` lets a
        caller reach each replica in turn (the router passes over those)."""
        return ReplicaStatus(self.replica_id, ray.get_runtime_context().get_node_id(), self.core.pid,
                             self.state.status(), self.state.engine.stats())

    async def __del__(self) -> None:
        await self._stop()

    async def _stop(self) -> None:
        """Ray stops this replica (scale-down, replacement, shutdown): the app's lifespan shuts the engine
        client down, then the core process is stopped (it would die with this process anyway)."""
        if self.stopped:
            return
        self.stopped = True
        try:
            await self.lifespan.__aexit__(None, None, None)
        except Exception:
            logger.exception("replica %s: the app's shutdown failed", self.replica_id)
        from graphserve.engine.core.process import remove_core_address
        from graphserve.server.supervisor import stop_process

        await asyncio.to_thread(stop_process, self.core, signal.SIGTERM)
        remove_core_address(self.core_address)


def _scope(request: ForwardedRequest) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},  # below 2.4: responses listen for the disconnect
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "root_path": "",
        "query_string": request.query_string,
        "headers": request.headers,
        "client": None,
        "server": None,
        "state": {},
    }

