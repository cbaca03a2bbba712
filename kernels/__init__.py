"""Compute kernels behind stable entry points.

Each operation has a plain-torch reference beside it; ``kernels.ops`` is the dispatch every
model calls. Triton implementations arrive behind the same entry points (GPU issue).
"""
