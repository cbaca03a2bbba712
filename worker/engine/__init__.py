"""The continuous-batching engine and its runtime objects: the engine (``engine``), scheduler,
block manager and KV cache, sequences, the model runner and its CUDA graphs, sampler and
detokenizer. Knows nothing of Redis.
"""
