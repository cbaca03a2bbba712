"""The in-memory weight formats quantized projections read: FP8 rows with a scale each
(``fp8_weight.py``), 4- and 8-bit integer groups (``int_weight.py``) and llama.cpp's GGUF block
formats (``packed_weight.py``).
"""
