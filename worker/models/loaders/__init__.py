"""Model loading: a spec becomes a ready model (``loader``), from GGUF files
(``gguf_weights``), Hugging Face directories (``hf_weights``), quantized Hugging Face
checkpoints (``quantized/``: GPTQ, AWQ, compressed-tensors) or random weights of a preset's
shape (``random_weights``); a parallel worker's rank loads its share through the interface the
loader owns (``model_share``).
"""
