"""The Prometheus endpoints of the control plane: `/metrics` (the plane) and `/metrics/queue` (the cluster's queue).

Open without a credential only where nobody but this host can reach them: the plane listens on loopback (its
default) and the scrape comes from loopback. Otherwise a scrape needs the operator's bearer credential, which is
what Prometheus's `authorization` scrape setting sends (`credentials_file: operator.token`). A queue the plane
cannot reach answers 503, so Prometheus records the scheduler as down (`up == 0`) instead of stale figures.
"""

from __future__ import annotations

import ipaddress
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from aisched_prefect.control.metrics import PlaneMetrics, instrument

logger = logging.getLogger("aisched_prefect.control")


def loopback(host: str | None) -> bool:
    """Whether `host` (an address or `localhost`) is this machine's loopback."""
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _token(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None


def add_metrics_routes(app: FastAPI, plane: Any, run: Any) -> PlaneMetrics | None:
    """Add `/metrics` and `/metrics/queue` to the plane's app; count the plane's decisions from now on."""
    metrics = getattr(plane, "metrics", None)
    if metrics is None and hasattr(plane, "pipeline"):  # one registry per plane, however many apps are built over it
        metrics = plane.metrics = PlaneMetrics(plane)
        instrument(plane, metrics)

    def _allowed(request: Request) -> None:
        peer = request.client.host if request.client else None
        if loopback(getattr(plane, "listen_host", None)) and loopback(peer):
            return
        plane.credentials.authenticate(_token(request), "operator")  # raises Unauthorized (401/403) with its fix

    @app.get("/metrics")
    async def plane_metrics(request: Request) -> Response:
        _allowed(request)
        if metrics is None:
            return Response(b"# this plane keeps no metrics\n", status_code=503, media_type="text/plain")
        return Response(await run(metrics.exposition), media_type=CONTENT_TYPE_LATEST)

    @app.get("/metrics/queue")
    async def queue_metrics(request: Request) -> Response:
        _allowed(request)
        if metrics is None or not getattr(plane, "queue", True):
            return Response(b"# no cluster queue: aisched serve --no-queue\n", media_type=CONTENT_TYPE_LATEST)
        try:
            body = await run(metrics.queue.exposition)
        except Exception as exc:  # the scheduler is gone or slow: down, said as such
            logger.info("metrics: the cluster's queue did not answer: %s: %s", type(exc).__name__, exc)
            return Response(f"# the Dask scheduler's queue does not answer ({type(exc).__name__})\n".encode(),
                            status_code=503, media_type="text/plain")
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return metrics
