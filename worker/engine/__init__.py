"""The continuous-batching engine and its runtime objects: the engine (``engine``), scheduler,
block manager and KV cache, sequences, the model runner and its CUDA graphs, sampler and
detokenizer; and the interfaces its plug-ins implement (``step_runner`` for a parallel
worker's runner, ``speculation`` for speculative decoding), whose implementations it never
imports. Knows nothing of Redis.
"""
