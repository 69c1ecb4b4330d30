"""Pallas TPU megakernel for hybrid-MoE decode, its pure-JAX reference, layouts, DMA plan and VMEM budget."""
