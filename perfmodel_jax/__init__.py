"""The JAX side of perfmodel: trace capture and host micro-benchmarks (needs the [jax] extra)."""
