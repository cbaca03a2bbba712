"""The CPU implementations: projections in every weight format (``linear.py``), paged attention
(``paged_attention.py``, which is also its reference), a whole decoder layer in one call
(``decoder_layer.py``) and the native kernels behind them, built from ``csrc/`` with the system
C compiler on first use (``native_cpu.py``).
"""
