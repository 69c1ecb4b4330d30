"""Pallas TPU megakernel for hybrid-MoE decode, its pure-JAX reference, weight layout, DMA plan
and VMEM budget (see kernels/README.md)."""
