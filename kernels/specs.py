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
