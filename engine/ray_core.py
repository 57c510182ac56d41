"""Engine cores as Ray actors: the core loop of engine/core_process.py in an actor on any node of a Ray cluster, behind
the same EngineCoreClient (engine/core_client.py), over tcp instead of ipc. Needs the `ray` extra.

The client binds its two ZeroMQ sockets on its node's address (the one Ray uses between nodes) and asks the actor to
run the core against them. That call lasts as long as the core: its end (a return, or a RayActorError when the actor's
process dies) is the client's death sentinel, as a child process's exit is for a local core. The actor is created with
`max_restarts`: Ray starts a killed actor again (kill -9, an OOM kill, a lost node: on another node), and the client's
restart path runs the core in it with fresh sockets, as it does for a local core. A core that stops on request exits
its actor on purpose, which Ray does not restart.
"""
from __future__ import annotations

import os
import threading

import ray
import zmq

from engine.core_process import run_engine_core


class EngineCoreActor:
    """One engine core (model, scheduler, KV cache) in a Ray actor; `run` lasts as long as the core (`pid` is called
    before it: the actor runs one call at a time)."""

    def run(self, engine_args: dict, input_addr: str, output_addr: str) -> None:
        run_engine_core(engine_args, input_addr, output_addr)
        ray.actor.exit_actor()      # stopped on request (or for good): Ray must not start it again

    def pid(self) -> int:
        return os.getpid()


class RayLauncher:
    """Where one engine replica runs: a Ray actor placed by Ray (spread over the nodes), restarted by Ray when it dies.
    `num_cpus` is what Ray reserves for it: the core's thread count."""

    def __init__(self, num_cpus: int, max_restarts: int = -1) -> None:
        self.node_ip = ray.util.get_node_ip_address()
        self.actor = ray.remote(EngineCoreActor).options(
            num_cpus=num_cpus, max_restarts=max_restarts, max_task_retries=0, scheduling_strategy="SPREAD").remote()

    def socket_dir(self) -> None:
        return None         # tcp: no ipc socket files to keep

    def bind(self, sock: zmq.Socket, directory: None, name: str) -> str:
        port = sock.bind_to_random_port(f"tcp://{self.node_ip}")
        return f"tcp://{self.node_ip}:{port}"

    def launch(self, engine_args: dict, input_addr: str, output_addr: str) -> "RayCoreProcess":
        # first wait until the actor is up: a call to an actor Ray is still restarting fails at once unless it may be
        # retried, and `run` must not be (a retry would run a core against the sockets of a client that moved on)
        pid = ray.get(self.actor.pid.options(max_task_retries=-1).remote())
        return RayCoreProcess(self.actor, self.actor.run.remote(engine_args, input_addr, output_addr), pid)


class RayCoreProcess:
    """The process-like handle EngineCoreClient watches (multiprocessing.Process's `pid`, `sentinel`, `exitcode`,
    `join`, `is_alive`, `kill`) for one `run` of the core in its actor."""

    def __init__(self, actor, run_ref, pid: int) -> None:
        self.actor, self._run_ref, self.pid = actor, run_ref, pid      # pid: the actor's worker process
        self.exitcode: int | str | None = None
        self._read_fd, self._write_fd = os.pipe()
        self._done = threading.Event()
        threading.Thread(target=self._watch, name="rtserve-ray-core-watch", daemon=True).start()

    @property
    def sentinel(self) -> int:
        return self._read_fd

    def _watch(self) -> None:
        try:
            ray.get(self._run_ref)
            self.exitcode = 0
        except Exception as exc:        # RayActorError: the actor's process died, or it exited on purpose
            self.exitcode = type(exc).__name__
        os.write(self._write_fd, b"x")
        self._done.set()

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def is_alive(self) -> bool:
        return not self._done.is_set()

    def kill(self) -> None:
        """For good (a core that would not stop, or one that failed to load): Ray does not start it again."""
        ray.kill(self.actor, no_restart=True)

    def __del__(self) -> None:
        for fd in (self._read_fd, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass
