"""Where a sweep's chunks run: in this process, in a pool of local processes (the default; the
standard library only), or on a Ray cluster (`pip install 'perfmodel[ray]'`). Every executor
returns the chunks' results in chunk order, so the same design gives the same output anywhere.
"""
from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Callable, Iterable, Iterator

from perfmodel.util.errors import SpecError, require

EXECUTORS = ("local", "ray")


def run(fn: Callable, chunks: Iterable, executor: str = "local", jobs: int | None = None,
        address: str | None = None) -> Iterator:
    """`fn(chunk)` for every chunk, yielded in order. local: `jobs` processes (1: this process;
    default: one per CPU); ray: the cluster at `address` (default: RAY_ADDRESS or a new local one)."""
    require(executor in EXECUTORS, "--executor", executor, f"must be one of {EXECUTORS}")
    require(jobs is None or (isinstance(jobs, int) and jobs > 0), "--jobs", jobs, "must be a positive integer")
    require(address is None or executor == "ray", "--address", address, "needs --executor ray")
    if executor == "ray":
        return _ray(fn, chunks, address)
    jobs = jobs or os.cpu_count() or 1
    if jobs == 1:
        return map(fn, chunks)
    return _pool(fn, chunks, jobs)


def _windowed(submit: Callable, get: Callable, chunks: Iterable, window: int) -> Iterator:
    """Keep at most `window` chunks in flight (a design may have millions of points) and yield
    their results in order."""
    flight: deque = deque()
    for c in chunks:
        flight.append(submit(c))
        if len(flight) >= window:
            yield get(flight.popleft())
    while flight:
        yield get(flight.popleft())


def _pool(fn, chunks, jobs: int) -> Iterator:
    # spawn: workers start clean (no copy of the parent's threads, e.g. the progress bar's); they
    # ignore Ctrl-C (the terminal sends it to every process) and the parent ends them on any exit
    try:
        pool = ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn"), initializer=_worker_init,
                                   initargs=(os.getpid(),))
    except OSError as e:  # e.g. no room for its semaphores (/dev/shm full, a file-size limit)
        raise SpecError("--jobs", jobs, f"cannot start worker processes ({e.strerror or e}); "
                                        "--jobs 1 runs in this process") from None
    try:
        yield from _windowed(lambda c: pool.submit(fn, c), lambda f: f.result(), chunks, 4 * jobs)
    except BaseException:
        workers = list((pool._processes or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for w in workers:
            w.terminate()
        for w in workers:
            w.join(5)
        raise
    pool.shutdown()


def _worker_init(parent: int) -> None:
    """A worker ignores Ctrl-C and ends itself when its parent is gone (even SIGKILLed: the
    pool's pipes stay open in the workers, so they would wait for work forever)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def _ray_get(ray, ref):
    """A task's result; bad input found on a worker is raised as itself (one line), not as Ray's
    wrapper with the remote traceback."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, SpecError):
            raise e.cause from None
        raise


def _reachable(address: str, timeout_s: float = 3.0) -> None:
    """Refuse a `host:port` (or ray://host:port) nobody answers at, before Ray retries for minutes."""
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if address == "auto" or not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise SpecError("--address", address, f"no Ray cluster answers there ({e.strerror or e})") from None


def _ray(fn, chunks, address: str | None) -> Iterator:
    try:
        import ray
    except ImportError:
        raise SpecError("--executor", "ray", "Ray is not installed: pip install 'perfmodel[ray]'") from None
    started = not ray.is_initialized()
    if started and address:
        _reachable(address)
    if started:
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        except ConnectionError as e:
            raise SpecError("--address", address, f"no Ray cluster there, or it refused us ({e}); a cluster with "
                            "token authentication needs RAY_AUTH_MODE=token and its token (docs/sweep.md)") from None
    try:
        remote = ray.remote(fn)
        window = 4 * max(1, int(ray.cluster_resources().get("CPU", 1)))
        yield from _windowed(lambda c: remote.remote(c), lambda ref: _ray_get(ray, ref), chunks, window)
    finally:
        if started:
            ray.shutdown()
