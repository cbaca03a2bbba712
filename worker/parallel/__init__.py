"""Models larger than one device: tensor and pipeline parallelism over ``torch.distributed``.
Each rank loads its share through the loader's interface (``rank_share``) and rank 0's engine
steps through the runner it is handed (``parallel_runner``, built by ``parallel_engine``)."""
