"""The megakernel on a mesh of `tp` devices: one pallas_call per device under `shard_map`, with
the shards of `perfmodel_kernels.shard` and the in-kernel collectives of `perfmodel_kernels.comm`.

Every per-device array gets a leading device axis (sharded over the mesh axis): packed weights,
caches (KDA state and conv window hold the device's heads; the MLA latent cache is replicated,
one copy per device, written identically by all) and the collectives' exchange counts
(`COUNTS`, carried from call to call so that receive-buffer parities continue). `shard_cache` /
`unshard_cache` convert between the reference's cache layout and this one.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from perfmodel.spec.arch import ModelSpec
from perfmodel.util.errors import require

from . import layout, megakernel, reference, shard, vmem
from .comm import AXIS, KINDS
from .layout import KernelConfig, Packed

COUNTS = "collective_counts"   # the cache entry holding each device's exchange counts [tp, 5]


def pack(weights: reference.Weights, cfg: KernelConfig, dspec: shard.DeviceSpec) -> Packed:
    """Every device's packed shard, stacked on a leading device axis."""
    per = [layout.pack_weights(shard.shard_weights(weights, dspec, d), cfg)
           for d in range(dspec.tp)]
    return jax.tree.map(lambda *a: jnp.stack(a), *per)


def _qkv_heads(w, d, tp):
    """The q|k|v channel layout of the conv window restricted to device d's heads."""
    return jnp.concatenate([p[..., d * p.shape[-1] // tp:(d + 1) * p.shape[-1] // tp]
                            for p in jnp.split(w, 3, axis=-1)], axis=-1)


def shard_cache(cache: dict, dspec: shard.DeviceSpec) -> dict:
    """The reference's cache per device, plus the exchange counts (zero before the first call)."""
    tp, out = dspec.tp, {COUNTS: jnp.zeros((dspec.tp, len(KINDS)), jnp.int32)}
    for name, c in cache.items():
        if name == "kda_state":
            hl = c.shape[2] // tp
            out[name] = jnp.stack([c[:, :, d * hl:(d + 1) * hl] for d in range(tp)])
        elif name == "kda_conv":
            out[name] = jnp.stack([_qkv_heads(c, d, tp) for d in range(tp)])
        else:
            out[name] = jnp.stack([c] * tp)
    return out


def unshard_cache(cache: dict, dspec: shard.DeviceSpec) -> dict:
    out = {}
    for name, c in cache.items():
        if name == COUNTS:
            continue
        if name == "kda_state":
            out[name] = jnp.concatenate(list(c), axis=2)
        elif name == "kda_conv":
            parts = [jnp.split(c[d], 3, axis=-1) for d in range(dspec.tp)]
            out[name] = jnp.concatenate([jnp.concatenate([p[k] for p in parts], axis=-1)
                                         for k in range(3)], axis=-1)
        else:
            out[name] = c[0]
    return out


@functools.partial(jax.jit, static_argnames=("static", "cfg", "interpret", "vmem_limit_bytes",
                                             "barrier"), donate_argnames=("cache",))
def _step(packed, cache, tokens, positions, accepted, *, static, cfg, interpret,
          vmem_limit_bytes=None, barrier=True):
    dspec = static.spec
    tp = dspec.tp
    names = list(reference.cache_shapes(dspec, cfg.batch, cfg.max_context))
    call = megakernel.build_call(dspec, cfg, interpret, vmem_limit_bytes=vmem_limit_bytes,
                                 barrier=barrier)
    mesh = Mesh(np.asarray(jax.devices()[:tp]), (AXIS,))
    tables = [jnp.asarray(a) for a in megakernel.static_inputs(dspec, cfg)]
    smem, hbm = megakernel.weight_args(packed, cfg)

    def per_device(me, tok, pos, acc, *arrays):  # per-device arrays: this device's [0]
        t = list(arrays[:len(tables)])
        mine = [a[0] for a in arrays[len(tables):]]
        n_smem = len(smem) + 1
        outs = call(tok, pos, acc, *t, me, *mine[:n_smem], *mine[n_smem:])
        return tuple(o[None] for o in outs)

    dev, rep = P(AXIS), P()
    per = smem + [cache[COUNTS]] + hbm + [cache[k] for k in names]
    outs = jax.shard_map(per_device, mesh=mesh,
                         in_specs=(dev, rep, rep, rep) + (rep,) * len(tables) + (dev,) * len(per),
                         out_specs=dev, check_vma=False)(
        jnp.arange(tp, dtype=jnp.int32), tokens, positions, accepted, *tables, *per)
    nxt, logits, *caches, ndist, counts = outs
    logits = jnp.concatenate(list(logits), axis=-1)  # vocabulary shards in device order
    cache = dict(zip(names, caches)) | {COUNTS: counts}
    return nxt[0, :, 0], logits, cache, ndist[:, :dspec.count(ffn="moe")]


def make_step(spec: ModelSpec, cfg: KernelConfig, tp: int, ep: int | None = None,
              interpret=None, barrier: bool = True):
    """(device spec, step(packed, cache, tokens, positions, accepted=None) -> (next tokens,
    logits, new cache, distinct experts fetched per device and MoE layer [tp, n_moe])) on the
    first `tp` devices, with the inputs and outputs of `megakernel.make_step`; packed from
    `pack`, cache from `shard_cache`. barrier=False: without the entry barrier (only for the
    test that shows the race it prevents)."""
    require(len(jax.devices()) >= tp, "tp", tp,
            f"needs {tp} devices, {len(jax.devices())} present (on CPU set XLA_FLAGS="
            f"--xla_force_host_platform_device_count={tp})")
    dspec = shard.device_spec(spec, tp, ep)
    budget = vmem.check_vmem(dspec, cfg)
    run = functools.partial(_step, static=reference.StaticSpec(dspec), cfg=cfg,
                            interpret=interpret, barrier=barrier,
                            vmem_limit_bytes=None if interpret else budget.capacity_bytes)
    return dspec, functools.partial(megakernel.verify_step, run, cfg)
