"""The engine alone, in one process: against HF transformers on the CPU and on one GPU, packed
and quantized weights, LoRA, structured outputs, speculation, parallel ranks, the host's share
of a step, and the grammar engine's choice.
"""
