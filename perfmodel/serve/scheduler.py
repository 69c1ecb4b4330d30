"""A continuous-batching engine: one pool of devices, its queues, KV blocks and steps.

The rules (vLLM V1's scheduler; docs/serving.md):
- a request holds `tokens` (prompt + tokens generated so far) of which `computed` are in the KV
  cache; a step gives it `tokens - computed` new tokens (1 for a decoding request, a chunk of
  its prompt otherwise), and when a step completes its tokens it samples the next one;
- each step first serves the running requests in the order they were admitted, then admits
  waiting requests first come first served, within `max_tokens_per_step` new tokens and
  `max_batch` running requests; a prompt chunk takes what budget is left, at most
  `prefill_chunk` tokens (without chunked prefill a prompt is taken whole or waits);
- a request's new tokens need KV blocks first; when a running request cannot get them, the
  last admitted running request is preempted (its blocks freed, its tokens recomputed from the
  start when it is admitted again, ahead of the other waiting requests), until they fit; no
  waiting request is admitted in a step that preempted; a waiting request whose blocks do not
  fit waits, and so does everything behind it;
- a step costs what the engines say for its shape (`perfmodel.serve.costs`); requests that
  arrive during a step join at the next.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from perfmodel.serve.costs import StepCosts
from perfmodel.serve.kv import BLOCK_TOKENS, MEMORY_UTILIZATION, KVCache
from perfmodel.util.errors import require

MAX_BATCH = 256              # vLLM's default max_num_seqs (EngineArgs.get_batch_defaults)
MAX_TOKENS_PER_STEP = 8192   # vLLM's default max_num_batched_tokens for its API server on >= 70 GiB GPUs


@dataclass(frozen=True)
class Scheduler:
    """A pool's scheduling limits (module doc) and its KV cache's block size and memory share."""
    max_batch: int = MAX_BATCH
    max_tokens_per_step: int = MAX_TOKENS_PER_STEP
    prefill_chunk: int | None = None
    chunked_prefill: bool = True
    block_tokens: int = BLOCK_TOKENS
    memory_utilization: float = MEMORY_UTILIZATION

    def __post_init__(self):
        for name in ("max_batch", "max_tokens_per_step", "block_tokens"):
            v = getattr(self, name)
            require(isinstance(v, int) and not isinstance(v, bool) and v > 0, name, v, "must be a positive integer")
        require(self.prefill_chunk is None or (isinstance(self.prefill_chunk, int) and self.prefill_chunk > 0),
                "prefill_chunk", self.prefill_chunk, "must be a positive integer")
        require(isinstance(self.memory_utilization, (int, float)) and 0 < self.memory_utilization <= 1,
                "memory_utilization", self.memory_utilization, "must be in (0, 1]")


class Requests:
    """Every request of a simulation as arrays, one entry per request id: lengths, progress
    (`tokens` = prompt + generated so far, `computed` of them in the KV cache, `held` cache
    bytes per device) and timestamps (seconds; NaN until they happen)."""

    def __init__(self, n: int):
        self.count = 0
        self.arrival_s, self.entered_s, self.first_token_s, self.finish_s, self.handoff_s = (
            np.full(n, np.nan) for _ in range(5))
        self.input_len, self.output_len, self.tokens, self.computed, self.generated, self.preemptions = (
            np.zeros(n, np.int64) for _ in range(6))
        self.held = np.zeros(n)

    def add(self, arrival_s: float, input_len: int, output_len: int) -> int:
        i = self.count
        self.count += 1
        self.arrival_s[i] = self.entered_s[i] = arrival_s
        self.input_len[i] = self.tokens[i] = input_len
        self.output_len[i] = output_len
        return i


class Pool:
    """One engine (module doc). `role`: "both" serves requests to their end; "prefill" hands a
    request on once its first token is sampled; "decode" receives requests whose prompt is in
    its cache (`computed` = prompt) and decodes them. Its clock `now` is the start of its next
    step; `incoming` holds request ids by the time they reach it; `running` is in admission order."""

    def __init__(self, name: str, costs: StepCosts, kv: KVCache, sched: Scheduler, reqs: Requests,
                 longest: int, role: str = "both"):
        self.name, self.costs, self.kv, self.sched, self.reqs, self.role = name, costs, kv, sched, reqs, role
        self.dp = costs.d.dp
        bt = kv.block_tokens
        self.table = np.array([kv.bytes_for(b * bt) for b in range(-(-longest // bt) + 2)])  # bytes by blocks
        self.waiting: deque[int] = deque()
        self.running = np.zeros(0, np.int64)
        self.incoming: list[tuple[float, int]] = []
        self.now = 0.0
        self.steps = self.preemptions = self.decode_rows = self.prefill_tokens = 0
        self.busy_s = self.area = 0.0   # seconds stepping; integral of requests held over time
        self.series: list[tuple[float, float, int, int]] = []  # (t, KV occupancy, running, waiting) per step

    def bytes_for(self, tokens):
        """Cache bytes per device of sequences holding `tokens` tokens, in whole blocks."""
        return self.table[-(-tokens // self.kv.block_tokens)]

    def arrive(self, i: int, ready_s: float) -> None:
        """Request `i` reaches this pool at `ready_s` (in the system since its `entered_s`)."""
        heapq.heappush(self.incoming, (ready_s, i))

    def next_time(self) -> float:
        """When this pool next does something: now if it has requests, else its next arrival."""
        if self.waiting or len(self.running):
            return self.now
        return max(self.now, self.incoming[0][0]) if self.incoming else math.inf

    def step(self) -> np.ndarray:
        """Run one step (or go idle until the next arrival); returns the ids of the requests that
        left the pool at its end (finished, or handed on by a prefill pool)."""
        q, t = self.reqs, self.now
        while self.incoming and self.incoming[0][0] <= t:
            i = heapq.heappop(self.incoming)[1]
            self.area += t - q.entered_s[i]   # in the system before this step could take it
            self.waiting.append(i)
        if not self.waiting and not len(self.running):
            if self.incoming:
                self.now = self.incoming[0][0]
            return np.zeros(0, np.int64)
        ids, n = self._schedule()
        c = q.computed[ids]
        one = n == 1
        dec = int(one.sum())
        chunk = ~one
        n_chunks = len(ids) - dec
        chunk_tokens = int(n[chunk].sum())
        finishing = int((c[chunk] + n[chunk] == q.tokens[ids[chunk]]).sum())
        per = lambda k: -(-k // self.dp)  # the busiest attention replica's share
        dt = self.costs.seconds(per(dec), round(float(c[one].sum()) / dec) if dec else 0, per(n_chunks),
                                round(chunk_tokens / n_chunks) if n_chunks else 0,
                                round(float(c[chunk].sum()) / n_chunks) if n_chunks else 0,
                                min(per(finishing), per(n_chunks)))
        self.area += (len(self.waiting) + len(self.running)) * dt
        self.now = end = t + dt
        self.steps += 1
        self.busy_s += dt
        self.decode_rows += dec
        self.prefill_tokens += chunk_tokens
        q.computed[ids] = c + n
        done = ids[q.computed[ids] == q.tokens[ids]]  # each samples its next token
        q.tokens[done] += 1
        g = q.generated[done] = q.generated[done] + 1
        q.first_token_s[done[g == 1]] = end
        prefill = self.role == "prefill"
        left = done if prefill else done[g >= q.output_len[done]]
        if len(left):
            run = self.running
            self.running = run[q.generated[run] < (1 if prefill else q.output_len[run])]
            self.kv.used_bytes -= float(q.held[left].sum())
            q.held[left] = 0.0
            q.entered_s[left] = end
        self.series.append((t, self.kv.occupancy, len(self.running), len(self.waiting)))
        return left

    def _schedule(self) -> tuple[np.ndarray, np.ndarray]:
        """This step's requests (ids) and their new tokens: 1 for a decoding request, a prompt
        chunk otherwise (module doc)."""
        s, kv, q, run = self.sched, self.kv, self.reqs, self.running
        budget = s.max_tokens_per_step
        cap = s.prefill_chunk or budget
        c = q.computed[run]
        want = np.minimum(q.tokens[run] - c, cap)
        n = np.clip(budget - (np.cumsum(want) - want), 0, want)  # in admission order, while the budget lasts
        need = np.where(n > 0, self.bytes_for(c + n) - q.held[run], 0.0)
        preempted = False
        if need.sum() <= kv.free_bytes:
            q.held[run] += need
            kv.used_bytes += float(need.sum())
        else:  # blocks run out: serve in order, preempting from the back (module doc)
            n, preempted = self._serve_in_order(), True
            run = self.running
        ids, n = run[n > 0], n[n > 0]
        budget -= int(n.sum())
        new, new_n = [], []
        while not preempted and self.waiting and budget > 0 and len(run) + len(new) < s.max_batch:
            i = self.waiting[0]
            left = int(q.tokens[i] - q.computed[i])
            k = min(left, budget, cap)
            if k < left and not s.chunked_prefill:
                break
            need = float(self.bytes_for(q.computed[i] + k)) - q.held[i]
            if need > kv.free_bytes:
                break
            self.waiting.popleft()
            kv.used_bytes += need
            q.held[i] += need
            new.append(i)
            new_n.append(k)
            budget -= k
        if new:
            self.running = np.concatenate([self.running, new])
            ids, n = np.concatenate([ids, new]), np.concatenate([n, new_n])
        return ids, n

    def _serve_in_order(self) -> np.ndarray:
        """The running requests' new tokens, served one by one in admission order: when one's
        blocks do not fit, the last admitted running request is preempted until they do (it may
        be that one itself; then nothing after it runs). Returns the new tokens of the running
        requests left (0: not served)."""
        s, kv, q = self.sched, self.kv, self.reqs
        budget, cap = s.max_tokens_per_step, s.prefill_chunk or s.max_tokens_per_step
        run = list(self.running)
        n = [0] * len(run)
        j = 0
        while j < len(run) and budget > 0:
            i = run[j]
            k = min(int(q.tokens[i] - q.computed[i]), budget, cap)
            need = float(self.bytes_for(q.computed[i] + k)) - q.held[i]
            while need > kv.free_bytes and run[-1] != i:
                self._preempt(run.pop())
                n.pop()
            if need > kv.free_bytes:  # it is the last one: preempt it too, and stop
                self._preempt(run.pop())
                n.pop()
                break
            kv.used_bytes += need
            q.held[i] += need
            n[j] = k
            budget -= k
            j += 1
        self.running = np.array(run, np.int64)
        return np.array(n, np.int64)

    def _preempt(self, i: int) -> None:
        q = self.reqs
        self.kv.used_bytes -= float(q.held[i])
        q.held[i], q.computed[i] = 0.0, 0
        q.preemptions[i] += 1
        self.preemptions += 1
        self.waiting.appendleft(i)
