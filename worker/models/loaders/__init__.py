"""Model loading: a spec becomes a ready model (``loader``), from GGUF files
(``gguf_weights``), Hugging Face directories (``hf_weights``) or random weights of a preset's
shape (``random_weights``).
"""
