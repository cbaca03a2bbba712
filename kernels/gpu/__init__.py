"""The Triton kernels: the GPU side of each operation, each file beside the reference it matches
(``*_triton.py``: attention, the KV store, projections in bf16/FP8/INT4/INT8, RMSNorm, rotary,
activations, routed experts, LoRA, grammar masks). Under ``TRITON_INTERPRET=1`` they run on the
CPU, as the tests do.
"""
