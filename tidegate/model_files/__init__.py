"""Model files and text: where a model spec points (``model_source``), GGUF reading
(``gguf_file``), tokenizers (``tokenizer``, ``byte_level_bpe``) and chat templates
(``chat_template``).
"""
