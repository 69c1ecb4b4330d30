"""Where a sweep's chunks run: in this process and a pool of local processes (the default; the
standard library only), or on a Ray cluster (`pip install 'perfmodel[ray]'`). Every executor
returns the chunks' results in chunk order, so the same design gives the same output anywhere.

The local executor runs the first chunks in this process, then the others in worker processes
forked from it (on Linux, when this process runs a single thread): a worker starts with what the
first chunk loaded (modules, presets, the simulator's compiled loops) instead of loading it all
again, which would cost about a second per worker. Elsewhere workers are spawned fresh. The pool
starts once the chunks after the first have taken as long here as starting it would
(POOL_START_S), so a short sweep never pays for one.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import warnings
from collections import deque
from typing import Callable, Iterable, Iterator

from perfmodel.util.errors import SpecError, require

EXECUTORS = ("local", "ray")
# seconds to start a local pool and get its first result back (forked workers: measured here,
# 2-core VM; spawned ones import numpy, perfmodel and numba afresh)
POOL_START_S = {"fork": 0.1, "spawn": 1.0}


def run(fn: Callable, chunks: Iterable, executor: str = "local", jobs: int | None = None,
        address: str | None = None) -> Iterator:
    """`fn(chunk)` for every chunk, yielded in order. local: the first chunks here, the rest in
    `jobs` processes (default: one per CPU this process may use) if the sweep lasts long enough
    (1: all here); ray: the cluster at `address` (default: RAY_ADDRESS or a new local one)."""
    require(executor in EXECUTORS, "--executor", executor, f"must be one of {EXECUTORS}")
    require(jobs is None or (isinstance(jobs, int) and jobs > 0), "--jobs", jobs, "must be a positive integer")
    require(address is None or executor == "ray", "--address", address, "needs --executor ray")
    if executor == "ray":
        return _ray(fn, chunks, address)
    jobs = jobs or cpus()
    if jobs == 1:
        return map(fn, chunks)
    return _local(fn, iter(chunks), jobs)


def cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _windowed(submit: Callable, get: Callable, chunks: Iterable, window: int, started: list = ()) -> Iterator:
    """Keep at most `window` chunks in flight (a design may have millions of points), after those
    `started`, and yield their results in order."""
    flight: deque = deque(started)
    for c in chunks:
        flight.append(submit(c))
        if len(flight) >= window:
            yield get(flight.popleft())
    while flight:
        yield get(flight.popleft())


def _local(fn, chunks: Iterator, jobs: int) -> Iterator:
    """Chunks in this process until, after the first (which loads what a chunk needs), they have
    taken as long as starting a pool would: a sweep that short is done sooner here. The rest in
    a pool of `jobs` processes."""
    # fork only where no other Python thread runs (a child inherits none, but the locks they
    # held); the pool forks all its workers before it starts its own thread
    fork = sys.platform.startswith("linux") and threading.active_count() == 1
    first = next(chunks, None)
    if first is None:
        return
    yield fn(first)
    spent = 0.0
    while (c := next(chunks, None)) is not None:
        if spent >= POOL_START_S["fork" if fork else "spawn"]:
            yield from _pool(fn, c, chunks, jobs, fork)
            return
        t = time.perf_counter()
        out = fn(c)
        spent += time.perf_counter() - t
        yield out


def _pool(fn, first, chunks: Iterator, jobs: int, fork: bool) -> Iterator:
    # workers ignore Ctrl-C (the terminal sends it to every process) and the parent ends them on
    # any exit
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context
    try:
        pool = ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("fork" if fork else "spawn"),
                                   initializer=_worker_init, initargs=(os.getpid(),))
        # the native threads left (numpy's BLAS and Arrow's idle pools) reset themselves at fork:
        # Python's warning about forking a multi-threaded process is silenced for this call
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
            started = [pool.submit(fn, first)]  # the pool starts its workers here
    except OSError as e:  # e.g. no room for its semaphores (/dev/shm full, a file-size limit)
        raise SpecError("--jobs", jobs, f"cannot start worker processes ({e.strerror or e}); "
                                        "--jobs 1 runs in this process") from None
    try:
        yield from _windowed(lambda c: pool.submit(fn, c), lambda f: f.result(), chunks, 4 * jobs, started)
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
    """A worker ignores Ctrl-C, ends at once on SIGTERM / SIGHUP (a forked one inherits the
    CLI's handlers for them) and ends itself when its parent is gone (even SIGKILLed: the pool's
    pipes stay open in the workers, so they would wait for work forever)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)

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
    # a local instance we start keeps its session files in a directory of ours, removed with it
    # (Ray's default, /tmp/ray, would stay behind)
    own = tempfile.mkdtemp(prefix="perfmodel-ray-") if started and not (address or os.environ.get("RAY_ADDRESS")) \
        else None
    try:
        if started:
            try:
                ray.init(address=address, logging_level="ERROR", log_to_driver=False,
                         **({"_temp_dir": own} if own else {}))
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
    finally:
        if own:
            shutil.rmtree(own, ignore_errors=True)
