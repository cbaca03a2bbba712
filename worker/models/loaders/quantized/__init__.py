"""Reading quantized Hugging Face checkpoints (GPTQ, AWQ GEMM, compressed-tensors, FP8) one
linear at a time into ``tidegate.kernels.weights.int_weight.IntWeight`` or ``tidegate.kernels.weights.fp8_weight.Fp8Weight``.

Every integer format stores the integers of a [N, K] linear and a scale and zero point per group
of G input columns, value = (q - zero) * scale; they differ in how the integers are packed into
int32 words, which way the matrix is transposed, and whether the zero is stored as is. FP8
formats store e4m3 values and a scale per tensor or row (``float_format``). The shared pieces
are ``checkpoint_tensors``'s, each format has its module (``gptq_format``, ``awq_format``,
``compressed_tensors_format``, ``float_format``), and ``quantized_safetensors`` picks the
format and serves the checkpoint. Anything a format can say that we cannot honour is refused by
name, never served approximately.
"""
