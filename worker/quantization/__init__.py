"""Quantizing models and writing quantized checkpoints (``tidegate quantize``): ``quantize``
drives a model through a method (round to nearest, or ``gptq`` on calibration text) and
``checkpoint_writer`` writes a Hugging Face Llama directory whose linears are integers
(compressed-tensors, GPTQ or AWQ layout), whatever computed them."""
