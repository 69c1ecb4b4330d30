"""Architecture overrides for reference runs and kernel tests at other sizes; apply them with
`perfmodel.spec.arch.derive("kimi-k3", **ODD_SIZED)`."""

# A kimi-k3 derivative whose widths are not multiples of the 128-wide tile (head dims 64,
# expert width 96, q_lora 192), with 6 layers and 32 experts top-6: exercises tile padding.
ODD_SIZED = dict(
    name="kimi-k3-odd", hidden=384, vocab=2048, layers=6,
    attention={"default": "kda", "mla_layers": [4, 6]},
    kda={"heads": 3, "head_dim": 64, "decay_gate_rank": 64},
    mla={"heads": 3, "q_lora_rank": 192, "kv_lora_rank": 128, "qk_nope_dim": 64,
         "qk_rope_dim": 64, "v_head_dim": 64},
    ffn={"dense_layers": [1], "dense_width": 768},
    moe={"experts": 32, "top_k": 6, "expert_width": 96, "shared_width": 192, "latent_dim": 192},
    formats={"routed_expert": "bf16"})


# Kimi K3-shaped slices that fit one chip: the first layers of Kimi K3 as it begins (layer 1 a
# dense FFN, then KDA + MoE, and MLA + MoE on the fourth), at the widths one TensorCore holds
# in a deployment. A slice keeps the MoE's routed-expert count per device and its top-k so
# that a step fetches about as many distinct experts as the busiest device does there.
SLICES = {
    # one core of TP32 x EP8: 3 heads of each attention, dense width 1056, 112 experts of
    # width 768 (a quarter of each expert: expert TP 4), shared width 192, vocabulary 5120;
    # top-4 of 112 picks about the 4.2 distinct experts the busiest group fetches at batch 1
    "k3-tp32-core": dict(name="kimi-k3-tp32-core", vocab=163840 // 32, kda={"heads": 3},
                         mla={"heads": 3}, ffn={"dense_layers": [1], "dense_width": 33792 // 32},
                         moe={"experts": 896 // 8, "top_k": 4, "expert_width": 3072 // 4,
                              "shared_width": 6144 // 32}),
    # one chip of TP8: 12 heads, dense width 4224, shared width 768, vocabulary 20480, whole
    # experts (width 3072), 32 of them (what 16 GiB holds beside the bf16 reference), top-4
    "k3-tp8-core": dict(name="kimi-k3-tp8-core", vocab=163840 // 8, kda={"heads": 12},
                        mla={"heads": 12}, ffn={"dense_layers": [1], "dense_width": 33792 // 8},
                        moe={"experts": 32, "top_k": 4, "shared_width": 6144 // 8}),
    # a dense slice: one chip of TP8's attention (12 heads) with Kimi K3's dense FFN (its first
    # layer's, width 4224) in every layer (`slice_spec`: a "-dense" slice), no MoE
    "k3-tp8-dense": dict(name="kimi-k3-tp8-dense", vocab=163840 // 8, kda={"heads": 12},
                         mla={"heads": 12}, ffn={"dense_width": 33792 // 8}),
}


def slice_spec(name: str, fmt: str | None = None, layers: int = 4):
    """A slice of `SLICES` (or a preset's name) with its first `layers` layers and routed
    experts stored as `fmt` (default the preset's)."""
    from perfmodel.spec.arch import derive
    from perfmodel.util.errors import require
    if name not in SLICES:
        return derive(name, formats={"routed_expert": fmt}) if fmt else derive(name)
    require(layers >= 4, "layers", layers, "a Kimi K3 slice has at least its first 4 layers")
    over = dict(SLICES[name], layers=layers,
                attention={"default": "kda", "mla_layers": list(range(4, layers + 1, 4))})
    if name.endswith("-dense"):
        over["ffn"] = dict(over["ffn"], dense_layers=list(range(1, layers + 1)))
    if fmt:
        over["formats"] = {"routed_expert": fmt}
    return derive("kimi-k3", **over)
