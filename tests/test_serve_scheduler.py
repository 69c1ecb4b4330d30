"""The continuous-batching scheduler by hand-worked cases: every step costs 1 s, the KV cache is
counted in blocks (one unit per block), so each request's timestamps follow from the rules of
perfmodel.serve.scheduler step by step (worked out in each test's docstring)."""
from types import SimpleNamespace

import numpy as np
import pytest

from perfmodel.serve.kv import KVCache
from perfmodel.serve.scheduler import Pool, Requests, Scheduler


class UnitCosts:
    """Every step takes 1 s; the shapes the engines would be asked for are kept."""

    def __init__(self, dp: int = 1):
        self.d, self.shapes, self.misses = SimpleNamespace(dp=dp), [], 0

    def seconds(self, *shape) -> float:
        self.shapes.append(shape)
        return 1.0


class BlockKV(KVCache):
    def bytes_for(self, tokens: int) -> float:
        return float(-(-tokens // self.block_tokens))


def serve(requests, blocks=1000, block=4, dp=1, **sched):
    """Run one pool over `requests` [(arrival, prompt, output)]; returns (Requests, pool)."""
    q = Requests(len(requests))
    longest = max(i + o for _, i, o in requests)
    pool = Pool("p", UnitCosts(dp), BlockKV(None, 1, float(blocks), block), Scheduler(**sched), q, longest)
    for a, i, o in requests:
        pool.arrive(q.add(a, i, o), a)
    done = 0
    while done < len(requests):
        left = pool.step()
        q.finish_s[left] = pool.now
        done += len(left)
        assert pool.steps < 1000
    return q, pool


def test_token_budget_chunks_a_prompt():
    """Budget 8: the 10-token prompt takes a chunk of 8 (step 1) and of 2 (step 2, which samples
    the first token at t = 2), then one decode step: finish at 3."""
    q, pool = serve([(0.0, 10, 2)], max_tokens_per_step=8)
    assert q.first_token_s.tolist() == [2.0] and q.finish_s.tolist() == [3.0]
    # (decode rows, their context, chunks, chunk tokens, cached before the chunk, chunks ending their prompt)
    assert pool.costs.shapes == [(0, 0, 1, 8, 0, 0), (0, 0, 1, 2, 8, 1), (1, 10, 0, 0, 0, 0)]


def test_running_first_then_waiting_share_the_budget():
    """Budget 8, two 6-token prompts at t = 0: step 1 gives A its 6 and B the 2 left; step 2
    decodes A and gives B its last 4 (B's first token at 2); both decode in step 3."""
    q, pool = serve([(0.0, 6, 3), (0.0, 6, 2)], max_tokens_per_step=8)
    assert q.first_token_s.tolist() == [1.0, 2.0]
    assert q.finish_s.tolist() == [3.0, 3.0]
    assert pool.costs.shapes[:2] == [(0, 0, 2, 4, 0, 1), (1, 6, 1, 4, 2, 1)]  # 2 chunks of 8 tokens in all


def test_kv_full_request_waits():
    """4 blocks of 4 tokens. A (8-token prompt, 5 outputs) takes 2 blocks at t = 0 and a third
    in step 2 (its 9th token); B (8-token prompt, arriving at 0.5) needs 2 and finds 1 free, so
    it waits until A finishes at t = 5, prefills in step 6 and decodes in step 7."""
    q, pool = serve([(0.0, 8, 5), (0.5, 8, 2)], blocks=4, max_tokens_per_step=16)
    assert q.finish_s[0] == 5.0
    assert q.first_token_s[1] == 6.0 and q.finish_s[1] == 7.0
    assert q.preemptions.tolist() == [0, 0] and pool.kv.used_bytes == 0


def test_preemption_of_the_last_admitted():
    """5 blocks of 4 tokens; A and B (4-token prompts, 8 outputs) both at t = 0. After step k a
    request holds 3 + k tokens in its cache; it needs a new block at 4 + 1, 8 + 1, ... tokens.
    Step 2: both take their 2nd block (4 used). Step 6: A takes its 3rd (5 used), B cannot and
    is the last admitted: B is preempted (its 2 blocks freed), A runs alone. B's recompute (its
    prompt and 5 generated tokens: 9 tokens, 3 blocks) does not fit beside A's 3 until A
    finishes at t = 8; step 9 recomputes B and samples its 6th token, steps 10 and 11 its 7th
    and 8th."""
    q, pool = serve([(0.0, 4, 8), (0.0, 4, 8)], blocks=5, max_tokens_per_step=16)
    assert q.first_token_s.tolist() == [1.0, 1.0]
    assert q.finish_s.tolist() == [8.0, 11.0]
    assert q.preemptions.tolist() == [0, 1] and pool.preemptions == 1
    assert pool.costs.shapes[5] == (1, 8, 0, 0, 0, 0)   # step 6: A alone
    assert pool.costs.shapes[8] == (0, 0, 1, 9, 0, 1)   # step 9: B's 9 tokens recomputed


def test_preempting_the_request_itself_stops_the_step():
    """3 blocks of 4 tokens; A, B, C (4-token prompts, 3 outputs) at t = 0 take one block each.
    Step 2 each needs a 2nd block: for A, C (the last admitted) is preempted and A takes its
    block; for B none is free and B is now the last admitted: B is preempted itself and the
    step runs A alone. Waiting: B, then C (each 5 tokens to recompute, 2 blocks). Step 3: A
    decodes (no new block), B does not fit in the 1 free block; A finishes at 3. Step 4: B
    recomputes (its 2nd token at 4), C does not fit; B finishes at 5; C runs in steps 6 and 7."""
    q, pool = serve([(0.0, 4, 3), (0.0, 4, 3), (0.0, 4, 3)], blocks=3, max_tokens_per_step=16)
    assert pool.costs.shapes[1] == (1, 4, 0, 0, 0, 0)  # step 2: A alone
    assert q.preemptions.tolist() == [0, 1, 1]
    assert q.first_token_s.tolist() == [1.0, 1.0, 1.0]
    assert q.finish_s.tolist() == [3.0, 5.0, 7.0]


def test_max_batch_admits_one_at_a_time():
    """max_batch 1: B is admitted only once A has finished (t = 2)."""
    q, _ = serve([(0.0, 4, 2), (0.0, 4, 2)], max_batch=1)
    assert q.first_token_s.tolist() == [1.0, 3.0] and q.finish_s.tolist() == [2.0, 4.0]


def test_without_chunked_prefill_a_prompt_waits_for_room():
    """Budget 8, no chunking: after A's 6 tokens, B's 6 do not fit in the 2 left, so B waits;
    step 2 takes A's decode row and all of B's prompt (7 left)."""
    q, pool = serve([(0.0, 6, 2), (0.0, 6, 1)], max_tokens_per_step=8, chunked_prefill=False)
    assert q.first_token_s.tolist() == [1.0, 2.0] and q.finish_s.tolist() == [2.0, 2.0]
    assert pool.costs.shapes[0] == (0, 0, 1, 6, 0, 1)


def test_prefill_chunk_caps_one_prompt_per_step():
    """prefill_chunk 3 with a budget of 8: a 7-token prompt goes 3 + 3 + 1 tokens."""
    q, pool = serve([(0.0, 7, 1)], max_tokens_per_step=8, prefill_chunk=3)
    assert q.first_token_s.tolist() == [3.0]
    assert [s[3] for s in pool.costs.shapes[:2]] == [3, 3] and pool.costs.shapes[2][:2] == (1, 6)


def test_arrival_during_a_step_joins_at_the_next():
    """B arrives at 0.5, inside step 1 (0 .. 1): it is admitted at t = 1."""
    q, _ = serve([(0.0, 4, 3), (0.5, 4, 1)])
    assert q.first_token_s.tolist() == [1.0, 2.0]


def test_attention_replicas_cost_the_busiest():
    """dp = 2: three decode rows cost as two on the busiest replica."""
    _, pool = serve([(0.0, 4, 2), (0.0, 4, 2), (0.0, 4, 2)], dp=2)
    assert pool.costs.shapes[1] == (2, 4, 0, 0, 0, 0)


@pytest.mark.parametrize("bad", [{"max_batch": 0}, {"max_tokens_per_step": -1}, {"prefill_chunk": 0},
                                 {"memory_utilization": 1.5}])
def test_bad_scheduler_settings(bad):
    from perfmodel.util.errors import SpecError
    with pytest.raises(SpecError, match=next(iter(bad))):
        Scheduler(**bad)
