"""rtserve on a Ray cluster (`rtserve serve --ray`): the gateway is a Ray Serve ingress deployment (the same starlette
app, Realtime WebSockets included, behind Serve's HTTP proxy) and its engine cores are Ray actors on any node
(engine/ray_core.py), behind the same Router as `--data-parallel-size` on one host: session affinity, prefix routing,
per-replica caps, a replica that dies ends only its sessions and is started again (by Ray).

Why actors behind the gateway's router, and not one Serve deployment per engine: a Realtime session's turns must reach
the engine that holds its pinned KV, and Serve routes each request on its own. The router keeps the session -> replica
table, so the ingress runs as one replica; the engine cores, where the compute is, scale out. The ingress reserves no
CPU of Ray's (like Serve's proxy it only moves bytes); each engine actor reserves its core's threads.

Needs the `ray` extra (`pip install 'rtserve[ray]'`), installed alike on every node (the model too, at the same path).
"""
from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time

import ray
from ray import serve

import kernels
from engine.heap import freeze_startup_heap
from engine.ray_core import RayLauncher
from gateway import logs, memory
from gateway.app import Settings, blas_on_one_thread, create_app
from gateway.router import Router

log = logging.getLogger("rtserve")
APP_NAME = "rtserve"
# Serve's cap on requests one replica holds at once: every Realtime session is one for as long as it is open, so the
# cap is the gateway's session capacity (the router queues what the engines cannot run yet)
MAX_ONGOING_REQUESTS = 4096


def start_router(settings: Settings) -> Router:
    """`settings.data_parallel_size` engine cores as Ray actors (blocking until all are loaded)."""
    return Router.start(settings.data_parallel_size, settings.model, settings.engine_args, policy=settings.router,
                        launcher=lambda args: RayLauncher(num_cpus=args["num_threads"]))


@serve.deployment(name="rtserve", num_replicas=1, max_ongoing_requests=MAX_ONGOING_REQUESTS,
                  ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Gateway:
    async def __init__(self, settings: Settings, log_level: str = "info", log_format: str = "text") -> None:
        # this replica's process is set up as `rtserve serve` sets up its own (gateway/cli.py, gateway/app.py
        # `_load`): its log lines in the server's format (Ray streams the replica's stderr to the driver), the memory
        # thresholds, numpy's BLAS on one thread, the audio stage loaded before the first session (an app given its
        # engine would load it on first use), then the startup heap frozen
        logs.configure(log_level, log_format)
        memory.fix_thresholds()
        blas_on_one_thread()
        self.router = await asyncio.to_thread(start_router, settings)
        self.served_app = create_app(settings, engine=self.router)
        if self.served_app.state.audio is not None:
            t0 = time.monotonic()
            await self.served_app.state.audio.warmup()
            log.info("audio stage ready in %.1f s (VAD, Whisper, piper voice)", time.monotonic() - t0)
        freeze_startup_heap("Ray Serve ingress")

    def __serve_build_asgi_app__(self):
        return self.served_app

    async def __del__(self) -> None:
        if self.served_app.state.audio is not None:
            await asyncio.to_thread(self.served_app.state.audio.close)
        await asyncio.to_thread(self.router.shutdown)


def run(settings: Settings, host: str, port: int, log_level: str = "info", log_format: str = "text") -> int:
    """`rtserve serve --ray`: join the cluster (RAY_ADDRESS, else one started by `ray start` on this host, else a new
    one-node cluster), deploy the gateway (logging at `log_level` in `log_format`), serve until SIGINT / SIGTERM, then
    delete the application."""
    settings.engine_args.setdefault("num_threads", kernels.default_thread_count())   # split over the replicas
    ray.init(include_dashboard=False, log_to_driver=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):     # after ray.init, whose own SIGTERM handler only dumps and dies
        signal.signal(sig, lambda *_: stop.set())
    try:
        log.info("Ray cluster: %d CPUs, %d node(s); deploying the gateway with %d engine replica(s) ...",
                 int(ray.cluster_resources().get("CPU", 0)), len(ray.nodes()), settings.data_parallel_size)
        # one proxy, on the head node: clients have one address whatever node the ingress lands on
        serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": port})
        serve.run(Gateway.bind(settings, log_level, log_format), name=APP_NAME, route_prefix="/")
        log.info("ready on %s  (realtime: %s/v1/realtime; Ray Serve application %r)", settings.public_url,
                 settings.public_url.replace("http", "ws", 1), APP_NAME)
        while not stop.wait(1.0):
            pass
        log.info("deleting the Ray Serve application %r", APP_NAME)
        serve.delete(APP_NAME)
    finally:
        ray.shutdown()
    return 0
