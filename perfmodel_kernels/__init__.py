"""Pallas TPU megakernel for hybrid-MoE decode (one device or a tensor / expert parallel mesh,
quantised routed experts), its pure-JAX reference, weight layout, DMA plan and VMEM budget (see
perfmodel_kernels/README.md)."""
