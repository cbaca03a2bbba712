"""GPU kernel sweeps: launch shapes of the Triton projections (bf16, FP8, INT4/INT8), the fused
experts and batched LoRA, against cuBLAS where it has the same operation.
"""
