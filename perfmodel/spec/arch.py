"""Model architectures: the layer sequence, its weight matrices and their storage formats.

One source of truth for shapes: the analytic model, the parameter counts and the Pallas
kernel's test configurations all derive from a `ModelSpec`. Presets are TOML files in
`presets/models/`; a preset may name a `base` preset and override some of its fields (that is
how the MINI kernel configuration derives from kimi-k3). Hugging Face `config.json` files load
through `perfmodel.spec.hf`.

Each layer has an attention label and an FFN kind. The labels `kda`, `mla`, `gqa`, `gdn`
(gated DeltaNet), `mamba2`, `csa` (DeepSeek-V4 compressed attention) take their shapes from the
top-level table of that name; a model may add more labels under `[attention.<label>]` with
`type = "<kind>"`, fields not given being taken from the table of that kind (e.g. a
sliding-window GQA beside the full one), and `none` is a layer without attention (a Nemotron-H
MLP block). FFN kinds are `dense`, `moe`, `none`.
Layer patterns: `default`, then a cyclic `pattern` list, then `<label>_layers` lists (1-based).
"""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import MISSING, dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import ClassVar

from perfmodel.spec.formats import FORMATS, Format, format_from_dict, get_format
from perfmodel.spec.recipe import Megakernel, from_table as megakernel_from_table, to_table as megakernel_table
from perfmodel.util import schema
from perfmodel.util.checks import MAX_EXPERTS, MAX_LAYERS, MAX_SKEW, STR, check_range, check_type
from perfmodel.util.errors import SpecError, in_file, positive_int, require
from perfmodel.util.files import check_path

PRESET_DIR = Path(__file__).parents[1] / "presets" / "models"
ATTENTION_KINDS = ("kda", "mla", "gqa", "gdn", "mamba2", "csa")
FFN_KINDS = ("dense", "moe", "none")
WEIGHT_FAMILIES = ("attention", "dense_ffn", "shared_expert", "latent_projection", "routed_expert", "router",
                   "embedding", "lm_head")
CACHE_FAMILIES = ("kv_cache", "state", "activation")
MAX_DIM = 1 << 24          # no width, head count or vocab beyond 16 M


@dataclass(frozen=True)
class KDA:
    """Kimi Delta Attention: linear attention with a per-head recurrent state dk x dv."""
    kind: ClassVar[str] = "kda"
    heads: int
    head_dim: int
    conv_width: int = 4
    decay_gate_rank: int = 128   # low-rank decay gate (Kimi Linear)
    output_gate_rank: int = 0    # 0 = full-rank output gate (K3)


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention; with `index_topk` > 0, DeepSeek sparse attention: an indexer
    (index_heads x index_head_dim, its own key cache) picks the top-k cached tokens per query."""
    kind: ClassVar[str] = "mla"
    heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    output_gate: bool = False
    index_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0


@dataclass(frozen=True)
class GQA:
    """Grouped-query attention; `window` for sliding-window layers, `index_*` for block-sparse."""
    kind: ClassVar[str] = "gqa"
    heads: int
    kv_heads: int
    head_dim: int
    window: int = 0            # 0 = full attention, else sliding window length
    output_gate: bool = False  # sigmoid gate on the attention output (Qwen3-Next, Qwen3.5)
    sinks: bool = False        # a learned sink logit per head (gpt-oss)
    v_head_dim: int = 0        # 0 = head_dim
    k_eq_v: bool = False       # no v_proj: values come from the key projection (Gemma 4 global layers)
    index_heads: int = 0       # block-sparse attention (MiniMax-M3): index query heads, one per KV head,
    index_head_dim: int = 0    # against one shared index key per token; each KV head's group then
    index_topk: int = 0        # reads the `index_topk` tokens (whole blocks) its index head picked


@dataclass(frozen=True)
class GDN:
    """Gated DeltaNet (Qwen3-Next): key and value heads apart, state value_heads x dk x dv."""
    kind: ClassVar[str] = "gdn"
    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_width: int = 4


@dataclass(frozen=True)
class Mamba2:
    """Mamba-2 selective state space layer: state heads x head_dim x state_dim."""
    kind: ClassVar[str] = "mamba2"
    heads: int
    head_dim: int
    state_dim: int
    groups: int = 1
    conv_width: int = 4


@dataclass(frozen=True)
class CSA:
    """DeepSeek-V4 attention: query heads (low-rank queries) over one shared key = value head
    of `head_dim`, a grouped low-rank output projection and a per-head sink. Every layer keeps
    its last `window` tokens raw; with `compress_ratio` > 0 it also caches one entry per
    `compress_ratio` tokens, made by a learned compressor (with `overlap`, blocks overlap and
    the compressor has two projections each). With `index_topk` > 0 (CSA), an indexer of its
    own compressed keys picks that many entries; without (HCA) the query reads all of them."""
    kind: ClassVar[str] = "csa"
    heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    compress_ratio: int = 0
    overlap: bool = False
    index_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0

    @property
    def coff(self) -> int:
        """Compressor projections per entry: 2 with overlapping blocks."""
        return 2 if self.overlap else 1

    def entries(self, context: int) -> tuple[int, int]:
        """(raw window tokens, compressed entries) cached for `context` tokens."""
        return min(context, self.window), context // self.compress_ratio if self.compress_ratio else 0


ATTENTION_CLASSES = {c.kind: c for c in (KDA, MLA, GQA, GDN, Mamba2, CSA)}
HC_BYTES = 4  # hyper-connection weights are f32 in the DeepSeek-V4 reference code
# DeepSeek-V4's compressor projections are f32 whatever the checkpoint's attention format (the
# reference inference code; docs/sources.md)
CSA_FIXED_FORMATS = dict.fromkeys(("compress_kv", "compress_gate", "index_compress_kv", "index_compress_gate"),
                                  "f32")
# Gated DeltaNet's beta / alpha projection (in_proj_ba) is not quantised in the published FP8
# checkpoints (Qwen3-Next / Qwen3.5 FP8 config.json list in_proj_a / in_proj_b, or in_proj_ba, in
# quantization_config.modules_to_not_convert; vLLM qwen3_next.py: "ba_proj doesn't support
# blockwise fp8 quantization": its 2 x value_heads outputs split over tp ranks are narrower than a
# 128-wide block): it is held in bf16 whenever the attention family is quantised.
GDN_BF16_WHEN_QUANTISED = ("beta_alpha_proj",)


@dataclass(frozen=True)
class MoE:
    """Mixture of experts: `top_k` of `experts` routed experts per token, shared experts, an optional
    latent projection around them, and how tokens route."""
    experts: int
    top_k: int
    expert_width: int
    shared_width: int = 0   # total width of the shared experts
    latent_dim: int = 0     # 0 = experts take the hidden state directly
    routing_skew: float = 0.0  # Zipf exponent of expert popularity (perfmodel.graph.moe); 0 = uniform
    routing_correlation: float = 0.0  # 0 = rows route independently, 1 = every row alike
    router_copies: int = 1  # router weights stored and applied this many times (2 = bf16 hi/lo pair)


@dataclass(frozen=True)
class Matmul:
    """One weight matrix: y[in] -> y[out]; `experts` > 1 for a stacked expert tensor."""
    name: str
    family: str
    d_in: int
    d_out: int
    experts: int = 1    # stacked experts, or the blocks of a grouped (block-diagonal) projection
    fmt: str = ""       # a format the matrix keeps whatever its family's ("" = the family's)

    @property
    def params(self) -> int:
        return self.d_in * self.d_out * self.experts


@dataclass(frozen=True)
class Layer:
    """One layer: its attention label and FFN kind."""
    index: int        # 1-based
    attention: str    # an attention label (a kind of ATTENTION_KINDS, a variant, or "none")
    ffn: str          # one of FFN_KINDS


@dataclass(frozen=True)
class ModelSpec:
    """A model (module docstring): its widths, layers and storage formats, the shapes of its
    attention kinds and MoE, and its own megakernel."""
    name: str
    hidden: int
    vocab: int
    layers: tuple[Layer, ...]
    formats: dict[str, Format]
    kda: KDA | None = None
    mla: MLA | None = None
    gqa: GQA | None = None
    gdn: GDN | None = None
    mamba2: Mamba2 | None = None
    csa: CSA | None = None
    variants: dict[str, object] = field(default_factory=dict)  # extra attention labels
    dense_width: int = 0
    ffn_gated: bool = True   # SwiGLU-style gate and up projections; False: up only (relu2 MLPs)
    moe: MoE | None = None
    tie_embeddings: bool = False
    residual_streams: int = 1  # hyper-connections: the residual is this many copies of hidden
    megakernel: Megakernel = Megakernel()  # [megakernel]: the model's own kernel (perfmodel.spec.recipe)
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    # ----- attention labels ----------------------------------------------------------------
    def attn(self, label: str):
        """The shape object (KDA, MLA, GQA, GDN, Mamba2) of an attention label; None for none."""
        if label == "none":
            return None
        return getattr(self, label) if label in ATTENTION_KINDS else self.variants[label]

    def layer_kind(self, layer: Layer) -> str:
        """What a layer is, window included: `gqa-swa128+moe`, `gdn+moe`, `mla-dsa2048+dense`,
        `csa4+moe` / `hca128+moe` / `swa128+moe` (DeepSeek-V4: compressed with an indexer,
        compressed, window only), `mamba2` (no FFN), `dense` (no attention)."""
        a = self.attn(layer.attention)
        parts = []
        if isinstance(a, CSA):
            parts.append(f"{'csa' if a.index_topk else 'hca'}{a.compress_ratio}" if a.compress_ratio
                         else f"swa{a.window}")
        elif a is not None:
            name = a.kind
            if isinstance(a, GQA) and a.window:
                name += f"-swa{a.window}"
            if isinstance(a, MLA) and a.index_topk:
                name += f"-dsa{a.index_topk}"
            if isinstance(a, GQA) and a.index_topk:
                name += f"-msa{a.index_topk}"
            parts.append(name)
        if layer.ffn != "none":
            parts.append(layer.ffn)
        return "+".join(parts) or "identity"

    # ----- weights -------------------------------------------------------------------------
    def attention_matmuls(self, label: str) -> list[Matmul]:
        """The attention's matrices in program order; the last one is the output projection."""
        h, a = self.hidden, self.attn(label)
        mm = lambda name, d_in, d_out: Matmul(name, "attention", d_in, d_out)
        if a is None:
            return []
        if isinstance(a, KDA):
            qk, v = a.heads * a.head_dim, a.heads * a.head_dim
            out = [mm("q_proj", h, qk), mm("k_proj", h, qk), mm("v_proj", h, v),
                   mm("decay_a", h, a.decay_gate_rank), mm("decay_b", a.decay_gate_rank, qk),
                   mm("beta_proj", h, a.heads)]
            if a.output_gate_rank:
                out += [mm("gate_a", h, a.output_gate_rank), mm("gate_b", a.output_gate_rank, v)]
            else:
                out.append(mm("gate_proj", h, v))
            return out + [mm("o_proj", v, h)]
        if isinstance(a, MLA):
            q_in = a.q_lora_rank or h
            qk = a.heads * (a.qk_nope_dim + a.qk_rope_dim)
            out = [mm("q_a", h, a.q_lora_rank), mm("q_b", a.q_lora_rank, qk)] if a.q_lora_rank \
                else [mm("q_proj", h, qk)]
            out += [mm("kv_a", h, a.kv_lora_rank + a.qk_rope_dim),
                    mm("kv_b", a.kv_lora_rank, a.heads * (a.qk_nope_dim + a.v_head_dim))]
            if a.index_topk:
                out += [mm("index_q", q_in, a.index_heads * a.index_head_dim),
                        mm("index_k", h, a.index_head_dim), mm("index_weights", h, a.index_heads)]
            if a.output_gate:
                out.append(mm("gate_proj", h, a.heads * a.v_head_dim))
            return out + [mm("o_proj", a.heads * a.v_head_dim, h)]
        if isinstance(a, GQA):
            vd = a.v_head_dim or a.head_dim
            out = [mm("q_proj", h, a.heads * a.head_dim), mm("k_proj", h, a.kv_heads * a.head_dim)]
            if not a.k_eq_v:
                out.append(mm("v_proj", h, a.kv_heads * vd))
            if a.output_gate:
                out.append(mm("gate_proj", h, a.heads * vd))
            if a.index_topk:
                out += [mm("index_q", h, a.index_heads * a.index_head_dim), mm("index_k", h, a.index_head_dim)]
            return out + [mm("o_proj", a.heads * vd, h)]
        if isinstance(a, GDN):
            k, v = a.key_heads * a.key_head_dim, a.value_heads * a.value_head_dim
            kept = self.formats["attention"].value_bits < 16  # GDN_BF16_WHEN_QUANTISED
            gdn = lambda name, d_in, d_out: Matmul(name, "attention", d_in, d_out, 1,
                                                   "bf16" if kept and name in GDN_BF16_WHEN_QUANTISED else "")
            return [gdn("q_proj", h, k), gdn("k_proj", h, k), gdn("v_proj", h, v), gdn("gate_proj", h, v),
                    gdn("beta_alpha_proj", h, 2 * a.value_heads), gdn("o_proj", v, h)]
        if isinstance(a, CSA):
            g = lambda name, d_in, d_out, n=1: Matmul(name, "attention", d_in, d_out, n,
                                                      CSA_FIXED_FORMATS.get(name, ""))
            out = [g("q_a", h, a.q_lora_rank), g("q_b", a.q_lora_rank, a.heads * a.head_dim), g("kv", h, a.head_dim)]
            if a.compress_ratio:
                out += [g("compress_kv", h, a.coff * a.head_dim), g("compress_gate", h, a.coff * a.head_dim)]
            if a.index_topk:
                out += [g("index_q", a.q_lora_rank, a.index_heads * a.index_head_dim),
                        g("index_weights", h, a.index_heads),
                        g("index_compress_kv", h, a.coff * a.index_head_dim),
                        g("index_compress_gate", h, a.coff * a.index_head_dim)]
            return out + [g("o_a", a.heads * a.head_dim // a.o_groups, a.o_lora_rank, a.o_groups),
                          g("o_proj", a.o_groups * a.o_lora_rank, h)]
        inner = a.heads * a.head_dim  # Mamba2: in_proj = z, x, B, C, dt
        return [mm("in_proj", h, 2 * inner + 2 * a.groups * a.state_dim + a.heads), mm("out_proj", inner, h)]

    def attention_small_params(self, label: str) -> int:
        """Non-matmul attention parameters (conv taps, per-head decay constants, norms, sinks)."""
        a = self.attn(label)
        if isinstance(a, KDA):
            return 3 * a.heads * a.head_dim * a.conv_width + 2 * a.heads + a.head_dim
        if isinstance(a, MLA):
            return a.q_lora_rank + a.kv_lora_rank + (2 * a.index_head_dim if a.index_topk else 0)
        if isinstance(a, GQA):  # sinks; the index query and key norms
            return (a.heads if a.sinks else 0) + (2 * a.index_head_dim if a.index_topk else 0)
        if isinstance(a, GDN):
            conv = 2 * a.key_heads * a.key_head_dim + a.value_heads * a.value_head_dim
            return conv * a.conv_width + 2 * a.value_heads + a.value_head_dim
        if isinstance(a, Mamba2):
            inner = a.heads * a.head_dim
            conv = inner + 2 * a.groups * a.state_dim
            return conv * (a.conv_width + 1) + 3 * a.heads + inner
        if isinstance(a, CSA):  # sinks, q / kv norms; per compressor: position biases and a norm
            comp = lambda d: a.compress_ratio * a.coff * d + d
            return (a.heads + a.q_lora_rank + a.head_dim + (comp(a.head_dim) if a.compress_ratio else 0)
                    + (comp(a.index_head_dim) if a.index_topk else 0))
        return 0

    def csa_state_values(self, a: CSA) -> int:
        """A compressor's running state per sequence: the projected values and gate scores of
        the block it is filling (overlap: two blocks), for the main and the indexer's compressor."""
        if not a.compress_ratio:
            return 0
        block = lambda d: 2 * a.coff * a.compress_ratio * a.coff * d
        return block(a.head_dim) + (block(a.index_head_dim) if a.index_topk else 0)

    def hc_params(self, sublayers: int, head: bool = False) -> int:
        """Hyper-connection weights (f32): per sublayer a map of the n x hidden residual to
        (2 + n) n mixing weights, their biases and 3 scales; the head's map to n weights."""
        n, nh = self.residual_streams, self.residual_streams * self.hidden
        if n == 1:
            return 0
        return sublayers * ((2 + n) * n * (nh + 1) + 3) + (n * (nh + 1) + 1 if head else 0)

    def cache_bytes(self, label: str, context: int, tp: int) -> float:
        """One sequence's cache of one layer on one device: KV / latents for `context` tokens
        (a sliding window keeps only its window) or the fixed recurrent and conv state."""
        a, kv, st = self.attn(label), self.formats["kv_cache"].bytes_per_value, self.formats["state"].bytes_per_value
        if isinstance(a, GQA):  # the index keys (one head) replicated across TP ranks
            span = min(context, a.window) if a.window else context
            index = context * a.index_head_dim * kv if a.index_topk else 0
            return span * -(-a.kv_heads // tp) * (a.head_dim + (a.v_head_dim or a.head_dim)) * kv + index
        if isinstance(a, MLA):  # latents replicated across TP ranks; the indexer keeps its own keys
            return context * (a.kv_lora_rank + a.qk_rope_dim + (a.index_head_dim if a.index_topk else 0)) * kv
        if isinstance(a, KDA):
            return a.heads // tp * (a.head_dim * a.head_dim * st + 3 * a.head_dim * (a.conv_width - 1) * kv)
        if isinstance(a, GDN):
            conv = 2 * a.key_heads * a.key_head_dim + a.value_heads * a.value_head_dim
            return (a.value_heads * a.key_head_dim * a.value_head_dim * st + conv * (a.conv_width - 1) * kv) / tp
        if isinstance(a, Mamba2):
            inner = a.heads * a.head_dim
            conv = inner + 2 * a.groups * a.state_dim
            return (inner * a.state_dim * st + conv * (a.conv_width - 1) * kv) / tp
        if isinstance(a, CSA):  # one shared K = V head: replicated across TP ranks, as MLA's latent
            raw, comp = a.entries(context)
            index = comp * a.index_head_dim if a.index_topk else 0
            return (raw + comp) * a.head_dim * kv + index * kv + self.csa_state_values(a) * st
        return 0.0

    def ffn_matmuls(self, ffn: str) -> list[Matmul]:
        """The FFN's matrices; `*gate_up` holds the gate and up projections (up only when the
        MLP is not gated)."""
        h, g = self.hidden, 2 if self.ffn_gated else 1
        if ffn == "none":
            return []
        if ffn == "dense":
            w = self.dense_width
            return [Matmul("gate_up", "dense_ffn", h, g * w), Matmul("down", "dense_ffn", w, h)]
        m = self.moe
        d = m.latent_dim or h
        mm = [Matmul("router", "router", h, m.experts)]
        if m.latent_dim:
            mm += [Matmul("latent_down", "latent_projection", h, d),
                   Matmul("latent_up", "latent_projection", d, h)]
        if m.shared_width:
            mm += [Matmul("shared_gate_up", "shared_expert", h, g * m.shared_width),
                   Matmul("shared_down", "shared_expert", m.shared_width, h)]
        return mm + [Matmul("expert_gate_up", "routed_expert", d, g * m.expert_width, m.experts),
                     Matmul("expert_down", "routed_expert", m.expert_width, d, m.experts)]

    def layer_matmuls(self, layer: Layer) -> list[Matmul]:
        return self.attention_matmuls(layer.attention) + self.ffn_matmuls(layer.ffn)

    @cached_property
    def layer_kinds(self) -> dict[Layer, int]:
        """Each distinct layer (index 0) and how many layers are that kind: per-layer sums
        computed once a kind."""
        return dict(Counter(dataclasses.replace(l, index=0) for l in self.layers))

    @cached_property
    def attention_counts(self) -> dict[str, int]:
        """Layers per attention label."""
        return dict(Counter(l.attention for l in self.layers))

    def params_by_family(self) -> dict[str, int]:
        return dict(self._params_by_family)

    @cached_property
    def _params_by_family(self) -> dict[str, int]:
        out = dict.fromkeys(WEIGHT_FAMILIES, 0)
        for layer, n in self.layer_kinds.items():
            for mm in self.layer_matmuls(layer):
                out[mm.family] += n * mm.params
            norms = (layer.attention != "none") + (layer.ffn != "none")
            out["attention"] += n * (self.attention_small_params(layer.attention) + norms * self.hidden
                                     + self.hc_params(norms))
            if layer.ffn == "moe":
                out["router"] += n * self.moe.experts  # selection bias
        out["embedding"] = self.vocab * self.hidden
        out["lm_head"] = 0 if self.tie_embeddings else self.vocab * self.hidden
        out["attention"] += self.hidden + self.hc_params(0, head=True)  # final norm, head mixing
        return out

    @property
    def total_params(self) -> int:
        return sum(self.params_by_family().values())

    @property
    def active_params(self) -> int:
        """Parameters one token uses: all but the routed experts it does not pick and the
        embedding rows it does not read (the convention of the gpt-oss model card)."""
        m, routed = self.moe, self.params_by_family()["routed_expert"]
        unused = routed - routed * m.top_k // m.experts if m else 0
        return self.total_params - unused - (self.vocab - 1) * self.hidden

    def matmul_bytes(self, mm: Matmul) -> float:
        """Stored bytes of one weight matrix (all its experts), block scales included."""
        return self.matmul_format(mm).tensor_bytes(mm.d_in, mm.d_out, mm.experts)

    def matmul_format(self, mm: Matmul) -> Format:
        return get_format(mm.fmt) if mm.fmt else self.formats[mm.family]

    def weight_bytes(self) -> int:
        return int(sum(self._weight_bytes_by_family.values()))

    def weight_bytes_by_family(self) -> dict[str, float]:
        """Stored weight bytes per format family, block scales included."""
        return dict(self._weight_bytes_by_family)

    @cached_property
    def _weight_bytes_by_family(self) -> dict[str, float]:
        out = dict.fromkeys(self.formats, 0.0)
        small = self.params_by_family()  # less what the matrices hold: norms, conv taps, biases
        for layer, n in self.layer_kinds.items():
            for mm in self.layer_matmuls(layer):
                out[mm.family] += n * self.matmul_bytes(mm)
                small[mm.family] -= n * mm.params
        hc = self.hc_params(0, head=True) + sum(n * self.hc_params((l.attention != "none") + (l.ffn != "none"))
                                                for l, n in self.layer_kinds.items())
        out["attention"] += hc * HC_BYTES
        small["attention"] -= hc
        for f in ("embedding", "lm_head"):  # a tied lm_head holds no parameters of its own
            out[f] += self.formats[f].tensor_bytes(self.hidden, self.vocab) if small[f] else 0.0
            small[f] = 0
        for f, n in small.items():
            out[f] += n * self.formats[f].bytes_per_value
        return out

    def count(self, attention: str | None = None, ffn: str | None = None) -> int:
        """Layers with this attention label (or kind) and / or FFN kind."""
        return sum(1 for l in self.layers
                   if (attention is None or l.attention == attention
                       or (attention in ATTENTION_KINDS and getattr(self.attn(l.attention), "kind", None) == attention))
                   and (ffn is None or l.ffn == ffn))


# ----- loading --------------------------------------------------------------------------------

def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def _derived(base: dict, over: dict) -> dict:
    """`over` merged into `base`; a nested table replaces only the keys it names, except
    `attention`, replaced whole (its layer lists depend on the layer count)."""
    if "attention" in over:
        base = {k: v for k, v in base.items() if k != "attention"}
    return _merge(base, over)


# the top-level keys of a model file (from_dict checks each one's content)
TOP_KEYS = ("name", "base", "hidden", "vocab", "layers", "tie_embeddings", "residual_streams", "attention",
            "ffn", "formats", "custom_formats", "sources", "megakernel", "moe") + ATTENTION_KINDS


def read_toml(path: Path, seen: tuple[str, ...] = ()) -> dict:
    """A model file's table, merged into the one its `base` names: a preset, or another model
    file (a `.toml` path, relative to the file that names it)."""
    data = schema.load(path, dict.fromkeys(TOP_KEYS), "model file", fmt="toml")
    own = data.get("formats")
    older = isinstance(own, dict) and "shared_expert" in own and "latent_projection" not in own
    if "base" in data:
        with in_file(path):
            base = check_type("base", data.pop("base"), STR)
            if base.endswith(".toml"):
                file = Path(path).parent / check_path("base", base)
                key = str(file.resolve())
                require(key not in seen, "base", base, f"cycle of base files: {' -> '.join(seen + (key,))}")
                require(file.exists(), "base", base, f"file not found (looked for {file})")
            else:
                require(base not in seen, "base", base, f"cycle of base presets: {' -> '.join(seen + (base,))}")
        if base.endswith(".toml"):
            data = _derived(read_toml(file, seen + (key,)), data)
        else:
            data = _derived(preset_data(base, seen + (base,)), data)
    if older:
        with in_file(path):
            check_latent_family(data, own["shared_expert"])
    return data


def check_latent_family(data: dict, shared) -> None:
    """Refuse a model file that sets the shared experts' format and not the latent projections'
    when its model has latent projections: in the earlier format of this file the latent MoE's
    down / up projections were streamed as `shared_expert`; they are now their own family
    (`latent_projection`, bf16 unless given), so reading the file as written would change its
    meaning without a word."""
    moe = data.get("moe")
    latent = moe.get("latent_dim", 0) if isinstance(moe, dict) else 0
    if isinstance(latent, int) and not isinstance(latent, bool) and latent > 0:
        raise SpecError("formats.shared_expert", shared,
                        "this model has latent MoE projections, which files of the earlier format streamed as "
                        "shared_expert; they are now their own family: add formats.latent_projection "
                        f"(= {shared!r} keeps the earlier meaning, \"bf16\" the new default)")


def preset_data(name: str, seen: tuple[str, ...] = ()) -> dict:
    preset = PRESET_DIR / f"{name}.toml"
    require(name in list_presets(), "model", name,
            f"unknown preset; known: {', '.join(list_presets())} (or give a .toml/.json path)")
    return read_toml(preset, seen or (name,))


def derive(base: str, **overrides) -> ModelSpec:
    """The preset `base` with `overrides` (nested tables as dicts), validated like a preset file:
    `derive("kimi-k3", hidden=1024, moe={"experts": 64})`."""
    return from_dict(_derived(preset_data(base), overrides))


def _check_value(name: str, v, default):
    """One scalar field checked against the type of its default: bool, float (finite, >= 0) or
    int (0 .. MAX_DIM)."""
    if isinstance(default, bool):
        require(isinstance(v, bool), name, v, "must be true or false")
    elif isinstance(default, float):
        require(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0,
                name, v, "must be a finite number >= 0")
    else:
        require(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_DIM, name, v,
                f"must be an integer in 0..{MAX_DIM}")


def _build(cls, sec, prefix: str, inherit: dict | None = None):
    require(isinstance(sec, dict), prefix, sec, "must be a table")
    names = [f.name for f in fields(cls)]
    for k in sec:
        require(k in names, f"{prefix}.{k}", sec[k], f"unknown field; known: {', '.join(names)}")
    values = {**(inherit or {}), **sec}
    for f in fields(cls):
        if f.name in values:
            _check_value(f"{prefix}.{f.name}", values[f.name], 0 if f.default is MISSING else f.default)
        else:
            require(f.default is not MISSING, f"{prefix}.{f.name}", None, "required field is missing")
    return cls(**values)


def _section(data: dict, key: str, cls, prefix: str):
    return _build(cls, data[key], prefix) if key in data else None


def _labels(table, n: int, default: str, known: set[str], what: str) -> list[str]:
    """Per-layer labels: `default`, then the cyclic `pattern`, then `<label>_layers` lists."""
    require(isinstance(table, dict), what, table, "must be a table")
    default = table.get("default", default)
    require(isinstance(default, str) and default in known, f"{what}.default", default,
            f"must be one of {sorted(known)}")
    out = [default] * n
    pattern = table.get("pattern")
    if pattern is not None:
        require(isinstance(pattern, list) and 1 <= len(pattern) <= n and all(isinstance(p, str) and p in known for p in pattern),
                f"{what}.pattern", pattern, f"must be a list of 1..{n} labels from {sorted(known)}")
        out = [pattern[i % len(pattern)] for i in range(n)]
    for key, idx in table.items():
        if key in ("default", "pattern"):
            continue
        require(key.endswith("_layers"), f"{what}.{key}", idx, "unknown key; known: default, pattern, <label>_layers")
        label = key.removesuffix("_layers")
        require(label in known, f"{what}.{key}", idx, f"expected <label>_layers with label in {sorted(known)}")
        require(isinstance(idx, list), f"{what}.{key}", idx, "must be a list of layer numbers")
        for i in idx:
            require(isinstance(i, int) and not isinstance(i, bool) and 1 <= i <= n, f"{what}.{key}", i,
                    f"layer numbers are 1-based and <= layers ({n})")
            out[i - 1] = label
    return out


def from_dict(data: dict) -> ModelSpec:
    """Build and validate a ModelSpec from the preset schema (see presets/models/*.toml)."""
    require(isinstance(data, dict), "model", data, "must be a table")
    for key in ("name", "hidden", "vocab", "layers"):
        require(key in data, key, None, "required field is missing")
    n = positive_int("layers", data["layers"])
    require(n <= MAX_LAYERS, "layers", n, f"must be <= {MAX_LAYERS}")
    for key in ("hidden", "vocab"):
        positive_int(key, data[key])
        require(data[key] <= MAX_DIM, key, data[key], f"must be <= {MAX_DIM}")
    sections = {kind: _section(data, kind, ATTENTION_CLASSES[kind], kind) for kind in ATTENTION_KINDS}
    attn = data.get("attention", {})
    require(isinstance(attn, dict), "attention", attn, "must be a table")
    variants = {}
    for label, sec in attn.items():
        if not isinstance(sec, dict):
            continue
        require(label not in ATTENTION_KINDS + ("none", "default", "pattern"), f"attention.{label}", sec,
                "a variant needs a label of its own")
        kind = sec.get("type")
        require(kind in ATTENTION_KINDS, f"attention.{label}.type", kind, f"must be one of {ATTENTION_KINDS}")
        base = sections[kind]
        inherit = {f.name: getattr(base, f.name) for f in fields(base)} if base else {}
        variants[label] = _build(ATTENTION_CLASSES[kind], {k: v for k, v in sec.items() if k != "type"},
                                 f"attention.{label}", inherit)
    known_attn = set(ATTENTION_KINDS) | set(variants) | {"none"}
    kinds = _labels({k: v for k, v in attn.items() if not isinstance(v, dict)}, n, "gqa", known_attn, "attention")
    ffn = data.get("ffn", {})
    require(isinstance(ffn, dict), "ffn", ffn, "must be a table")
    ffns = _labels({k: v for k, v in ffn.items() if k not in ("dense_width", "gated")}, n, "moe" if "moe" in data else "dense",
                   set(FFN_KINDS), "ffn")
    layers = tuple(Layer(i + 1, kinds[i], ffns[i]) for i in range(n))
    custom = data.get("custom_formats", {})
    require(isinstance(custom, dict), "custom_formats", custom, "must be a table of formats")
    custom = {k: format_from_dict(k, v, f"custom_formats.{k}") for k, v in custom.items()}
    fmts = data.get("formats", {})
    require(isinstance(fmts, dict), "formats", fmts, "must be a table of family = format")
    unknown = set(fmts) - set(WEIGHT_FAMILIES + CACHE_FAMILIES)
    require(not unknown, "formats", sorted(unknown), "unknown weight family")
    formats = {fam: get_format(fmt, f"formats.{fam}", custom) for fam, fmt in fmts.items()}
    for fam in WEIGHT_FAMILIES + CACHE_FAMILIES:
        formats.setdefault(fam, get_format("f32" if fam == "state" else "bf16"))
    dense_width, gated = ffn.get("dense_width", 0), ffn.get("gated", True)
    _check_value("ffn.dense_width", dense_width, 0)
    _check_value("ffn.gated", gated, True)
    sources = data.get("sources", {})
    require(isinstance(sources, dict) and all(isinstance(v, str) for v in sources.values()), "sources",
            sources, "must be a table of strings")
    name = data["name"]
    require(isinstance(name, str) and 0 < len(name) <= 200, "name", name, "must be a string of 1..200 chars")
    tie = data.get("tie_embeddings", False)
    require(isinstance(tie, bool), "tie_embeddings", tie, "must be true or false")
    streams = positive_int("residual_streams", data.get("residual_streams", 1))
    require(streams <= 64, "residual_streams", streams, "must be <= 64")
    spec = ModelSpec(name=name, hidden=data["hidden"], vocab=data["vocab"], layers=layers, formats=formats,
                     variants=variants, dense_width=dense_width, ffn_gated=gated, moe=_section(data, "moe", MoE, "moe"),
                     tie_embeddings=tie, residual_streams=streams,
                     megakernel=megakernel_from_table(data.get("megakernel", {})), sources=dict(sources), **sections)
    _validate(spec)
    return spec


def _validate(s: ModelSpec) -> None:
    used = {l.attention for l in s.layers} - {"none"}
    for label in sorted(used):
        require(s.attn(label) is not None, label, None,
                f"{s.count(attention=label)} layers use {label} but [{label}] is missing")
    for label, a in [(k, getattr(s, k)) for k in ATTENTION_KINDS] + list(s.variants.items()):
        if a is None:
            continue
        where = label if label in ATTENTION_KINDS else f"attention.{label}"
        for f in ("heads", "head_dim", "kv_heads", "kv_lora_rank", "key_heads", "value_heads",
                  "key_head_dim", "value_head_dim", "state_dim", "groups"):
            if hasattr(a, f):
                positive_int(f"{where}.{f}", getattr(a, f))
        if isinstance(a, GQA):
            require(a.heads % a.kv_heads == 0, f"{where}.kv_heads", a.kv_heads, f"must divide {where}.heads ({a.heads})")
        if isinstance(a, GDN):
            require(a.value_heads % a.key_heads == 0, f"{where}.key_heads", a.key_heads,
                    f"must divide {where}.value_heads ({a.value_heads})")
        if isinstance(a, Mamba2):
            require(a.heads % a.groups == 0, f"{where}.groups", a.groups, f"must divide {where}.heads ({a.heads})")
        if isinstance(a, (MLA, CSA, GQA)) and a.index_topk:
            positive_int(f"{where}.index_heads", a.index_heads), positive_int(f"{where}.index_head_dim", a.index_head_dim)
        if isinstance(a, CSA):
            for f in ("rope_dim", "q_lora_rank", "o_groups", "o_lora_rank", "window"):
                positive_int(f"{where}.{f}", getattr(a, f))
            require(a.heads * a.head_dim % a.o_groups == 0, f"{where}.o_groups", a.o_groups,
                    f"must divide heads x head_dim ({a.heads * a.head_dim})")
            require(a.compress_ratio or not (a.index_topk or a.overlap), f"{where}.compress_ratio", 0,
                    "an indexer or overlapping blocks need compressed entries (compress_ratio > 0)")
    if s.count(ffn="dense"):
        positive_int("ffn.dense_width", s.dense_width)
    if s.count(ffn="moe"):
        require(s.moe is not None, "moe", None, "MoE layers present but [moe] is missing")
        m = s.moe
        positive_int("moe.experts", m.experts), positive_int("moe.top_k", m.top_k)
        require(m.experts <= MAX_EXPERTS, "moe.experts", m.experts, f"at most {MAX_EXPERTS}")
        check_range("moe.routing_skew", m.routing_skew, 0, MAX_SKEW)
        positive_int("moe.expert_width", m.expert_width), positive_int("moe.router_copies", m.router_copies)
        require(m.top_k <= m.experts, "moe.top_k", m.top_k, f"must be <= moe.experts ({m.experts})")
        require(m.routing_correlation <= 1, "moe.routing_correlation", m.routing_correlation, "must be in [0, 1]")


# ----- writing (the inverse of from_dict, for exports and round-trip tests) -------------------

def to_dict(s: ModelSpec) -> dict:
    """The preset-schema dict that `from_dict` turns back into an equal ModelSpec."""
    out: dict = {"name": s.name, "hidden": s.hidden, "vocab": s.vocab, "layers": len(s.layers)}
    if s.tie_embeddings:
        out["tie_embeddings"] = True
    if s.residual_streams > 1:
        out["residual_streams"] = s.residual_streams
    attn: dict = {"default": "gqa"}
    for label in sorted({l.attention for l in s.layers}):
        idx = [l.index for l in s.layers if l.attention == label]
        if label != "gqa":
            attn[f"{label}_layers"] = idx
    for kind in ATTENTION_KINDS:
        a = getattr(s, kind)
        if a is not None:
            out[kind] = {f.name: getattr(a, f.name) for f in fields(a)}
    for label, a in s.variants.items():
        attn[label] = {"type": a.kind, **{f.name: getattr(a, f.name) for f in fields(a)}}
    out["attention"] = attn
    out["ffn"] = {"default": "dense", "dense_width": s.dense_width, "gated": s.ffn_gated,
                  **{f"{k}_layers": [l.index for l in s.layers if l.ffn == k] for k in ("moe", "none")}}
    if s.moe:
        out["moe"] = {f.name: getattr(s.moe, f.name) for f in fields(s.moe)}
    custom = {f.name: f for f in s.formats.values() if FORMATS.get(f.name) != f}
    if custom:
        out["custom_formats"] = {n: {"value_bits": f.value_bits, "scale_dtype": f.scale_dtype,
                                     "block": list(f.block), "global_scale_dtype": f.global_scale_dtype,
                                     "compute_dtype": f.compute_dtype, "scale_rows": f.scale_rows,
                                     "fallback_dtype": f.fallback_dtype,
                                     "fallback_scale_rows": f.fallback_scale_rows} for n, f in custom.items()}
    out["formats"] = {fam: f.name for fam, f in s.formats.items()}
    if megakernel_table(s.megakernel):
        out["megakernel"] = megakernel_table(s.megakernel)
    if s.sources:
        out["sources"] = dict(s.sources)
    return out


def to_toml(s: ModelSpec) -> str:
    """`to_dict` as TOML text (scalars, lists and one level of nested tables)."""
    def val(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(val(x) for x in v) + "]"
        return repr(v)

    def table(name: str, d: dict) -> list[str]:
        lines = [f"[{name}]"] if name else []
        lines += [f'"{k}" = {val(v)}' for k, v in d.items() if not isinstance(v, dict)]
        for k, v in d.items():
            if isinstance(v, dict):
                lines += [""] + table(f'{name}."{k}"' if name else f'"{k}"', v)
        return lines

    return "\n".join(table("", to_dict(s))) + "\n"
