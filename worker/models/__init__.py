"""Model definitions (plain torch) the engine runs, their loaders (``loaders``) and the
rounding of a float model's projections at load (``online_quantization``)."""
