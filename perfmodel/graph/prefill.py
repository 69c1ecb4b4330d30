"""Steps beyond one decode batch, as op graphs: prompt chunks (prefill) and mixed steps.

A serving engine's step (vLLM / SGLang continuous batching with chunked prefill) holds decode
rows, one per running sequence, and prompt chunks: C tokens of a prompt whose first P tokens are
already cached. Every weight is read once for all the step's rows; each chunk's attention is
causal (`perfmodel.graph.ops.Rows`); only the rows that sample a token reach the lm_head: the
decode rows and the last row of a chunk that ends its prompt. The graph is the decode step's
(`ops.build`) over those row groups, so every engine costs it as it costs a decode step.
"""
from __future__ import annotations

from dataclasses import dataclass

from perfmodel.graph import ops
from perfmodel.spec.arch import ModelSpec
from perfmodel.spec.deployment import Deployment
from perfmodel.util.errors import require


@dataclass(frozen=True)
class StepShape:
    """What one step processes on one attention replica: `decode` sequences of one row each at
    `context` cached tokens (their mean), and `chunks` prompt chunks of `chunk_tokens` tokens
    each after `chunk_context` cached tokens, `finishing` of them ending their prompt (their
    last row samples the sequence's first token)."""
    decode: int = 0
    context: int = 0
    chunks: int = 0
    chunk_tokens: int = 0
    chunk_context: int = 0
    finishing: int = 0

    def __post_init__(self):
        for name in ("decode", "context", "chunks", "chunk_tokens", "chunk_context", "finishing"):
            v = getattr(self, name)
            require(isinstance(v, int) and v >= 0, name, v, "must be an integer >= 0")
        require(self.finishing <= self.chunks, "finishing", self.finishing, f"at most chunks ({self.chunks})")
        require((self.chunks > 0) == (self.chunk_tokens > 0), "chunk_tokens", self.chunk_tokens,
                "a step with prompt chunks needs chunk_tokens > 0, and only then")
        require(self.decode or self.chunks, "shape", self, "an empty step")

    @property
    def prefill(self) -> "StepShape | None":
        """The prompt chunks alone (None without chunks)."""
        if not self.chunks:
            return None
        return StepShape(0, 0, self.chunks, self.chunk_tokens, self.chunk_context, self.finishing)

    @property
    def decode_only(self) -> "StepShape | None":
        """The decode rows alone (None without decode rows)."""
        return StepShape(self.decode, self.context) if self.decode else None

    @property
    def tokens(self) -> int:
        return self.decode + self.chunks * self.chunk_tokens

    @property
    def sampled(self) -> int:
        return self.decode + self.finishing

    def groups(self) -> tuple[ops.Rows, ...]:
        g = (ops.Rows(self.decode, 1, self.context),) if self.decode else ()
        if self.chunks:
            g += (ops.Rows(self.chunks, self.chunk_tokens, self.chunk_context, causal=True),)
        return g


def step_graph(model: ModelSpec, d: Deployment, shape: StepShape) -> ops.OpGraph:
    """The op graph of one step of `shape` on one attention replica (cached as `ops.build`)."""
    return ops.build(model, d, shape.groups(), shape.sampled)


def prompt_chunks(prompt: int, chunk: int | None = None) -> list[tuple[int, int]]:
    """(tokens, cached before them) of each chunk of a `prompt`-token prompt prefilled `chunk`
    tokens at a time (None: the whole prompt at once)."""
    require(isinstance(prompt, int) and prompt > 0, "prompt", prompt, "must be a positive integer")
    require(chunk is None or (isinstance(chunk, int) and chunk > 0), "chunk", chunk, "must be a positive integer")
    c = chunk or prompt
    return [(min(c, prompt - p), p) for p in range(0, prompt, c)]
