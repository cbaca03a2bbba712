"""The plain-torch references: what each kernel computes, in the fewest tensor operations.

Every CPU and Triton implementation is tested against these; the CPU runs some of them as its
implementation where nothing faster exists (activations, rotary, routed experts, LoRA).
"""
