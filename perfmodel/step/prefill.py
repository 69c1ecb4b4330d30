"""Steps of a serving engine beyond one decode batch: prompt chunks (prefill), mixed steps, and
the time to first token (TTFT).

A multi-kernel engine (vLLM, SGLang, an XLA program) runs a mixed step as one op graph of all
its rows (`perfmodel.graph.prefill.step_graph`): decode rows and prompt chunks share every
weight read. With a GPU serving engine's kernel inventory (`Deployment.serving_engine`, decode
kernels only: perfmodel.engine.serving) a decode-only step is its kernels, as `predict` costs it,
and a step with prompt chunks the multi-kernel engine's graph. A megakernel decodes only: a step's prompt chunks run first as a separate XLA
program (the multi-kernel engine on the same chips; the published TPU megakernel prefills in
XLA), then its decode rows in the megakernel.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from perfmodel.engine.megakernel import simulate_megakernel
from perfmodel.engine.multikernel import simulate_multikernel
from perfmodel.engine.terms import CAUSES, op_weights
from perfmodel.graph.prefill import StepShape, prompt_chunks, step_graph
from perfmodel.spec.arch import ModelSpec
from perfmodel.spec.deployment import Deployment, validate
from perfmodel.spec.hardware import Hardware
from perfmodel.step.predict import Prediction, _layer_rows
from perfmodel.util.errors import SpecError, positive_int


@dataclass(frozen=True)
class StepCost:
    """One step's seconds: `prefill_s` the megakernel's separate prompt-chunk program (0 where
    one graph runs the whole step), `decode_s` the rest."""
    prefill_s: float
    decode_s: float

    @property
    def step_s(self) -> float:
        return self.prefill_s + self.decode_s


def step_cost(model: ModelSpec, hw: Hardware, d: Deployment, shape: StepShape) -> StepCost:
    """The seconds of one step of `shape` (one device call) on deployment `d`'s engine (module
    doc); the deployment's own batch and context do not enter, its layout and engine do."""
    if d.spec is not None:
        raise SpecError("spec", "draft rows", "steps with prompt chunks are costed without speculative decoding")
    d = dataclasses.replace(d, steps_per_call=1)
    if d.engine == "multikernel" and d.serving_engine and not shape.chunks:  # a GPU serving engine's decode
        from perfmodel.engine.serving import simulate_serving  # kernels (perfmodel.engine.serving)
        return StepCost(0.0, simulate_serving(model, hw, d, step_graph(model, d, shape))[0].step_s)
    if d.engine == "multikernel":
        return StepCost(0.0, _multikernel(model, hw, d, shape))
    pre = _multikernel(model, hw, d, shape.prefill) if shape.chunks else 0.0
    dec = 0.0
    if shape.decode:
        g = step_graph(model, d, shape.decode_only)
        w = op_weights(g, model.formats["routed_expert"].bytes_per_value)
        dec = simulate_megakernel(g, hw, d, model.moe.top_k if model.moe else 1, weights=w).step_s
    return StepCost(pre, dec)


def _multikernel(model: ModelSpec, hw: Hardware, d: Deployment, shape: StepShape) -> float:
    g = step_graph(model, d, shape)
    return simulate_multikernel(g, hw, False, op_weights(g, model.formats["routed_expert"].bytes_per_value)).step_s


@dataclass(frozen=True)
class Prefill:
    """A batch of `seqs` prompts of `prompt` tokens prefilled together on an idle deployment,
    `chunk` tokens at a time (one step per chunk): each chunk's seconds and their sum, the time
    to every sequence's first token."""
    prompt: int
    chunk: int
    seqs: int
    chunk_s: tuple[float, ...]

    @property
    def ttft_s(self) -> float:
        return sum(self.chunk_s)

    def json(self) -> dict:
        return {"prompt_tokens": self.prompt, "chunk_tokens": self.chunk, "seqs": self.seqs,
                "chunks": len(self.chunk_s), "chunk_s": list(self.chunk_s), "ttft_s": self.ttft_s}


def prefill(model: ModelSpec, hw: Hardware, d: Deployment, prompt: int, chunk: int | None = None,
            seqs: int = 1, on_chunk=None) -> Prefill:
    """Prefill `seqs` prompts of `prompt` tokens (spread over the deployment's attention
    replicas) in chunks of `chunk` tokens (None: one chunk); the caches they fill must fit.
    `on_chunk()` is called after each chunk is costed (a progress bar)."""
    positive_int("seqs", seqs)
    chunks = prompt_chunks(prompt, chunk)
    validate(model, hw, dataclasses.replace(d, batch=seqs, context=prompt, spec=None))
    per = -(-seqs // d.dp)
    times = []
    for c, p in chunks:
        times.append(step_cost(model, hw, dataclasses.replace(d, spec=None),
                               StepShape(chunks=per, chunk_tokens=c, chunk_context=p,
                                         finishing=per if c + p == prompt else 0)).step_s)
        if on_chunk is not None:
            on_chunk()
    return Prefill(prompt, chunk or prompt, seqs, tuple(times))


def with_ttft(model: ModelSpec, hw: Hardware, p: Prediction, prompt: int, chunk: int | None = None,
              on_chunk=None) -> Prediction:
    """Prediction `p` with `ttft_s`: its batch's prompts of `prompt` tokens prefilled together."""
    return dataclasses.replace(p, ttft_s=prefill(model, hw, p.deployment, prompt, chunk, p.deployment.batch,
                                                 on_chunk).ttft_s)


def prefill_prediction(model: ModelSpec, hw: Hardware, d: Deployment, prompt: int, seqs: int = 1) -> Prediction:
    """One step prefilling `seqs` prompts of `prompt` tokens whole, as a Prediction: its seconds
    (`step_s`, = `ttft_s`), per-layer rows, causes and timeline, on the multi-kernel engine (a
    megakernel deployment prefills in XLA too); `tokens_per_s` counts the prompt tokens."""
    positive_int("seqs", seqs)
    prompt_chunks(prompt)
    validate(model, hw, dataclasses.replace(d, batch=seqs, context=prompt, spec=None))
    per = -(-seqs // d.dp)
    g = step_graph(model, d, StepShape(chunks=per, chunk_tokens=prompt, chunk_context=0, finishing=per))
    tl = simulate_multikernel(g, hw, False, op_weights(g, model.formats["routed_expert"].bytes_per_value))
    peak = hw.core_hbm_bandwidth_bytes_per_s
    totals = {c: float(tl.wait_s[c].sum()) for c in CAUSES}
    compute_floor = totals["compute"] * hw.efficiency.flops
    bound = max((tl.dma_bytes / peak, "memory"), (compute_floor, "compute"),
                (totals["collective"] + totals["launch"], "latency"))[1]
    return Prediction(model.name, hw.name, dataclasses.replace(d, batch=seqs, context=prompt), tl.step_s, seqs * prompt / tl.step_s,
                      tl.dma_bytes, tl.dma_bytes / peak, compute_floor, bound, totals, _layer_rows(g, tl), tl,
                      ttft_s=tl.step_s)
