"""Serving simulation: requests through one pool (aggregated) or a prefill and a decode pool
(disaggregated), and the latencies and throughput that come out (docs/serving.md).

Aggregated: one continuous-batching pool runs mixed steps (decode rows and prompt chunks).
Disaggregated: a prefill pool (its own devices and layout) runs the prompts and samples each
request's first token; the request's KV cache then crosses the fabric to the decode pool
(`kv_transfer_s`, one transfer at a time per pool pair), which decodes it. Both pools' steps
come from the same engines (`perfmodel.serve.costs`); the pools advance in time order, the one
whose next step starts first stepping next.

Metrics per request: TTFT = first token - arrival (for disaggregated serving, the prefill
pool's sample, as DistServe counts it: the KV transfer lands in the second token's latency);
TPOT = (finish - first token) / (output tokens - 1), for requests of two or more output tokens;
E2E = finish - arrival. Throughput = generated tokens / (last finish - first arrival).
"""
from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass

import numpy as np

from perfmodel.engine.terms import call_s, launch_s
from perfmodel.serve.costs import shared
from perfmodel.serve.kv import kv_cache, weight_bytes_per_device
from perfmodel.serve.scheduler import Pool, Requests, Scheduler
from perfmodel.serve.workload import Workload
from perfmodel.spec.arch import ModelSpec
from perfmodel.spec.deployment import Deployment, cache_bytes_per_seq, validate
from perfmodel.spec.hardware import Hardware
from perfmodel.util import limits
from perfmodel.util.errors import SpecError, require

PERCENTILES = (50, 90, 99)
SERIES_POINTS = 400   # KV occupancy samples kept per pool in the output


def chips(hw: Hardware, d: Deployment) -> int:
    return math.ceil(d.devices / hw.cores_per_chip)


def kv_transfer_s(model: ModelSpec, hw: Hardware, prefill: Deployment, decode: Deployment, tokens: int) -> float:
    """Moving one sequence's cache of `tokens` tokens from the prefill to the decode pool: every
    layer's unique cache bytes (`cache_bytes_per_seq` at tp 1) over the links of as many devices
    as the smaller pool's attention replica has (min of the two tp), each at the chip's link
    bandwidth per direction shared by its cores (the spec sheet), plus one link latency."""
    lanes = min(prefill.tp, decode.tp)
    per_device = hw.link_bandwidth_bytes_per_s / hw.cores_per_chip
    return hw.link_latency_s + cache_bytes_per_seq(model, tokens, 1) / (lanes * per_device)


def _pool_deployment(model, hw, d: Deployment) -> Deployment:
    """A pool's deployment, checked: its scheduler sets each step's rows and context."""
    d = dataclasses.replace(d, batch=1, context=0, spec=None, steps_per_call=1)
    require(d.pp == 1, "pp", d.pp, "the serving simulator does not pipeline steps over stages (pp must be 1)")
    validate(model, hw, d)
    return d


def _pool(name: str, model, hw, d: Deployment, sched: Scheduler, reqs: Requests, role: str, longest: int) -> Pool:
    d = _pool_deployment(model, hw, d)
    kv = kv_cache(model, hw, d, sched.block_tokens, sched.memory_utilization)
    need = kv.bytes_for(longest)
    if need > kv.capacity_bytes / d.dp:
        raise SpecError("requests", f"{longest} tokens", f"one request's cache ({need / 1e9:.2f} GB per device) exceeds "
                        f"the {name} pool's KV capacity ({kv.capacity_bytes / d.dp / 1e9:.2f} GB per device)")
    return Pool(name, shared(model, hw, d), kv, sched, reqs, longest, role)


@dataclass
class ServeResult:
    """A simulation's requests (arrays, one entry each) and its pools."""
    model: str
    hardware: str
    workload: Workload
    pools: list[Pool]
    chips: int
    input_len: np.ndarray
    output_len: np.ndarray
    arrival_s: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    preemptions: np.ndarray
    transfer_s: float   # summed KV transfer seconds (disaggregated)

    @property
    def ttft_s(self) -> np.ndarray:
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> np.ndarray:
        return self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> np.ndarray:
        m = self.output_len > 1
        return (self.finish_s[m] - self.first_token_s[m]) / (self.output_len[m] - 1)

    @property
    def duration_s(self) -> float:
        return float(self.finish_s.max() - self.arrival_s.min())

    @property
    def throughput_tokens_per_s(self) -> float:
        return float(self.output_len.sum()) / self.duration_s

    @property
    def offered_requests_per_s(self) -> float | None:
        """Arrivals per second over the arrivals' span (None for a closed loop, whose arrivals
        follow the completions, or a single request)."""
        span = float(self.arrival_s.max() - self.arrival_s.min())
        if self.workload.concurrency or not span:
            return None
        return (len(self.arrival_s) - 1) / span

    @property
    def in_system_mean(self) -> float:
        """Time-average requests in the system, from the pools' queues (Little's L)."""
        return sum(p.area for p in self.pools) / self.duration_s

    def json(self, series: bool = True) -> dict:
        n = len(self.arrival_s)
        out = {"requests": n, "chips": self.chips, "duration_s": self.duration_s,
               "ttft_s": stats(self.ttft_s), "tpot_s": stats(self.tpot_s), "e2e_s": stats(self.e2e_s),
               "throughput_tokens_per_s": self.throughput_tokens_per_s,
               "tokens_per_s_per_chip": self.throughput_tokens_per_s / self.chips,
               "input_tokens_per_s": float(self.input_len.sum()) / self.duration_s,
               "requests_per_s": n / self.duration_s, "offered_requests_per_s": self.offered_requests_per_s,
               "preemptions": int(self.preemptions.sum()),
               "littles_law": {"in_system_mean": self.in_system_mean,
                               "throughput_x_mean_e2e": n / self.duration_s * float(self.e2e_s.mean())},
               "pools": [pool_json(p, series) for p in self.pools]}
        if len(self.pools) > 1:
            out["kv_transfer_s_mean"] = self.transfer_s / n
        return out


def stats(x: np.ndarray) -> dict:
    """p50, p90, p99 and mean of `x` (None when empty)."""
    if not len(x):
        return {f"p{q}": None for q in PERCENTILES} | {"mean": None}
    return {f"p{q}": float(v) for q, v in zip(PERCENTILES, np.percentile(x, PERCENTILES))} | {"mean": float(x.mean())}


def pool_json(p: Pool, series: bool = True) -> dict:
    d = p.costs.d
    occ = np.array([s[1] for s in p.series]) if p.series else np.zeros(1)
    out = {"name": p.name, "role": p.role, "devices": d.devices, "tp": d.tp, "ep": d.expert_groups,
           "engine": d.engine, "steps": p.steps, "busy_s": p.busy_s,
           "mean_step_s": p.busy_s / p.steps if p.steps else None,
           "mean_decode_rows": p.decode_rows / p.steps if p.steps else None,
           "prefill_tokens": p.prefill_tokens, "preemptions": p.preemptions,
           "step_shapes_costed": p.costs.misses,
           "kv": {"capacity_bytes_per_device": p.kv.capacity_bytes / d.dp, "block_tokens": p.kv.block_tokens,
                  "occupancy_mean": float(occ.mean()), "occupancy_max": float(occ.max())},
           "scheduler": dataclasses.asdict(p.sched)}
    if series:
        keep = p.series[::max(1, -(-len(p.series) // SERIES_POINTS))]
        out["kv"]["series"] = {"t_s": [s[0] for s in keep], "occupancy": [s[1] for s in keep],
                               "running": [s[2] for s in keep], "waiting": [s[3] for s in keep]}
    return out


def step_floor_s(model: ModelSpec, hw: Hardware, d: Deployment) -> float:
    """A lower bound of one step's seconds on deployment `d` (no step is shorter): a device's
    weights at the chip's peak HBM bandwidth, a kernel launch per layer (multi-kernel), the
    device call's dispatch, and 1 us."""
    weights = weight_bytes_per_device(model, d) / hw.core_hbm_bandwidth_bytes_per_s
    launches = launch_s(hw) * len(model.layers) if d.engine == "multikernel" else 0.0
    return max(weights, launches, call_s(hw), 1e-6)


def estimate_steps(inp: np.ndarray, out: np.ndarray, arrivals: np.ndarray | None, concurrency: int | None,
                   scheduler: Scheduler, floor_s: float) -> tuple[float, float]:
    """(steps, requests in flight) a simulation of these requests takes, estimated before it runs.
    Alone, a request takes one step per prompt chunk and one per output token; `in flight`
    requests share each step (at most max_batch). In flight: a closed loop's clients, or
    Little's law over the arrivals (arrival rate x a request's time alone at `floor_s` a step, a
    lower bound of a step's seconds, so the estimate errs high)."""
    cap = min(scheduler.prefill_chunk or scheduler.max_tokens_per_step, scheduler.max_tokens_per_step)
    chunks = -(-inp // cap) if scheduler.chunked_prefill else np.ones_like(inp)
    alone = chunks + out
    total = float(alone.sum())
    if concurrency is not None:
        flight = float(concurrency)
    else:
        span = float(arrivals[-1] - arrivals[0]) if len(arrivals) > 1 else 0.0
        flight = len(alone) * float(alone.mean()) * floor_s / span if span > 0 else float(len(alone))
    flight = min(max(flight, 1.0), scheduler.max_batch, len(alone))
    return total / flight, flight


def simulate(model: ModelSpec, hw: Hardware, d: Deployment, workload: Workload,
             scheduler: Scheduler = Scheduler(), prefill: Deployment | None = None,
             prefill_scheduler: Scheduler | None = None, progress: bool | None = False) -> ServeResult:
    """Serve `workload` on deployment `d` (aggregated), or with `prefill` as a separate prefill
    pool and `d` as the decode pool (disaggregated). `progress`: a bar on stderr (None: when it
    is a terminal)."""
    if d.engine == "megakernel" or (prefill is not None and prefill.engine == "megakernel"):
        from perfmodel.engine import megakernel_sim
        megakernel_sim.compile_loops()  # thousands of step shapes: worth the compiler's start
    inp, out, arrivals = workload.draw()
    longest = int((inp + out).max())
    if not scheduler.chunked_prefill:
        require(int(inp.max()) <= scheduler.max_tokens_per_step, "max_tokens_per_step", scheduler.max_tokens_per_step,
                f"without chunked prefill a step must hold the longest prompt ({int(inp.max())} tokens)")
    n = workload.requests
    floor = min(step_floor_s(model, hw, _pool_deployment(model, hw, p)) for p in ([d] if prefill is None else [prefill, d]))
    steps, flight = estimate_steps(inp, out, arrivals, workload.concurrency, scheduler, floor)
    limits.refuse("requests", n, f"{n} requests of {float(inp.mean()):.0f} + {float(out.mean()):.0f} tokens on "
                  f"average, about {flight:.3g} in flight (a step of at least {floor * 1e6:.3g} us)",
                  steps, limits.MAX_SERVE_STEPS, "serving steps (estimated)",
                  "fewer requests or output tokens, larger prefill chunks, or more traffic at once")
    q = Requests(n)
    if prefill is None:
        pools = [_pool("mixed", model, hw, d, scheduler, q, "both", longest)]
    else:
        ps = prefill_scheduler or scheduler
        pools = [_pool("prefill", model, hw, prefill, ps, q, "prefill", int(inp.max()) + 1),
                 _pool("decode", model, hw, d, scheduler, q, "decode", longest)]
    entry, last = pools[0], pools[-1]

    def new_request(at: float) -> None:
        i = q.count
        entry.arrive(q.add(at, int(inp[i]), int(out[i])), at)

    if arrivals is None:
        for _ in range(min(workload.concurrency, n)):
            new_request(0.0)
    else:
        for a in arrivals.tolist():
            new_request(a)
    from tqdm import tqdm
    transfer, link_free = 0.0, 0.0
    done = 0
    with tqdm(total=n, unit="req", file=sys.stderr, desc="serve", disable=None if progress is None else not progress,
              mininterval=0.5) as bar:
        while done < n:
            pool = min(pools, key=Pool.next_time)
            if pool.next_time() == math.inf:  # nothing left to run while requests are not done
                raise RuntimeError(f"serving simulation stalled with {done} of {n} requests done")
            stepped = pool.steps
            left, before = pool.step().tolist(), done
            if pool.steps > stepped:
                limits.spend("serve_steps")
                if sum(p.steps for p in pools) > limits.MAX_SERVE_STEPS:  # preemptions beyond the estimate
                    raise SpecError("requests", n, f"the simulation took more than {limits.MAX_SERVE_STEPS:,} "
                                    f"serving steps (the limit) with {done} of {n} requests done: its KV cache "
                                    "preempts and recomputes requests; fewer at once (--max-batch) or more memory")
            for i in left:
                if pool is not last:  # prefill pool -> KV over the fabric -> decode pool
                    if q.generated[i] >= q.output_len[i]:  # a one-token request ends at the prefill pool
                        q.finish_s[i] = pool.now
                        done += 1
                        if arrivals is None and q.count < n:  # its client sends the next one
                            new_request(pool.now)
                        continue
                    q.handoff_s[i] = pool.now
                    start = max(pool.now, link_free)
                    link_free = start + kv_transfer_s(model, hw, prefill, d, int(q.computed[i]))
                    transfer += link_free - pool.now
                    q.computed[i] = q.tokens[i] - 1  # the prompt's cache arrived; the first token is next
                    last.arrive(i, link_free)
                    continue
                q.finish_s[i] = pool.now
                done += 1
                if arrivals is None and q.count < n:
                    new_request(pool.now)
            if done > before:
                bar.update(done - before)
    n_chips = sum(chips(hw, p.costs.d) for p in pools)
    return ServeResult(model.name, hw.name, workload, pools, n_chips, q.input_len, q.output_len, q.arrival_s,
                       q.first_token_s, q.finish_s, q.preemptions, transfer)
