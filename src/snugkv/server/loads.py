"""What a router or an orchestrator reads to place work on this server: its load and its readiness.

    GET /v1/loads   the queue, the KV usage and the generation rate, in the shape Shepherd Model
                    Gateway (`smg`) polls from its workers (SGLang's `/v1/loads`): a list with one
                    entry per data-parallel rank (snugkv has one), every figure taken from the
                    scheduler's stats and the server's metrics at the time of the call; beside
                    SGLang's fields, the host tier's cached tokens and hit rate (snugkv's own)
    GET /ready      200 while the engine is healthy and awake, 503 while it sleeps or is broken:
                    the readiness signal (send no traffic here now), beside `/health`, the liveness
                    one (this process still works; a supervisor restarts it when that fails)

A sleeping engine is alive (it wakes on request), so `/health` stays 200 through a sleep and a
Kubernetes liveness probe never restarts it; `/ready` is what takes it out of a Service or a
router's rotation meanwhile. This module reads the engine and the metrics; it changes neither.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from snugkv.core.engine_client import EngineClient
from snugkv.server.errors import SERVER_ERROR, APIError
from snugkv.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


def load_report(client: EngineClient, metrics: ServerMetrics) -> dict[str, Any]:
    """One load entry for this server (SGLang's field names, which smg reads)."""
    info = client.server_info()  # the sizing report (replaced on every resize) and the scheduler's stats
    stats = info.stats
    running, waiting = stats.num_running_requests, stats.num_queued_requests
    total_tokens = info.startup.max_total_num_tokens
    usage = stats.kv_cache_usage
    tier = stats.host_tier
    return {
        "dp_rank": 0,
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_total_reqs": running + waiting,
        "num_used_tokens": round(usage * total_tokens),
        "max_total_num_tokens": total_tokens,
        "token_usage": usage,
        "gen_throughput": metrics.recent_tokens_per_s(),
        "cache_hit_rate": stats.prefix_cache_hit_rate,
        "utilization": usage,
        "max_running_requests": info.startup.max_running_requests,
        # the prefix cache's host tier (0 without one): a router may count a hit there as cached
        "num_host_cached_tokens": 0 if tier is None else tier.cached_tokens,
        "host_tier_max_tokens": 0 if tier is None else tier.capacity_tokens,
        "host_cache_hit_rate": 0.0 if tier is None else tier.host_hit_rate,
    }


def install_load_routes(app: FastAPI, client: EngineClient, metrics: ServerMetrics) -> None:
    @app.get("/v1/loads")
    async def loads() -> Any:
        try:
            entry = load_report(client, metrics)
        except Exception as exc:
            logger.exception("Reading the engine's load failed")
            raise APIError(
                503, "The engine's load cannot be read; see the server log.", type=SERVER_ERROR
            ) from exc
        now = datetime.datetime.now(datetime.UTC).isoformat()
        return {"timestamp": now, "dp_rank_count": 1, "loads": [entry]}

    @app.get("/ready")
    async def ready() -> Any:
        try:
            healthy = client.check_health()
        except Exception:
            logger.exception("The engine's health check raised")
            healthy = False
        if not healthy:
            raise APIError(503, "The engine is not healthy; see the server log.", type=SERVER_ERROR)
        if client.is_sleeping():
            raise APIError(
                503,
                "The engine is asleep; wake it (POST /wake_up) to take traffic again.",
                type=SERVER_ERROR,
                code="engine_asleep",
            )
        return JSONResponse({"status": "ready"})
