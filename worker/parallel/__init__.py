"""Models larger than one device: tensor and pipeline parallelism over ``torch.distributed``."""
