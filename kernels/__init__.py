"""Compute kernels behind one entry point: ``tidegate.kernels.ops``, the calls models make.

Each call picks its implementation per call (``dispatch.py``) from four rooms, which import
each other one way only (gpu -> cpu -> weights -> reference):

* ``reference/``: the plain-torch references, the contract every other implementation meets;
* ``weights/``: the in-memory weight formats (FP8 rows, INT4/INT8 groups, GGUF blocks);
* ``cpu/``: the CPU implementations, with the C sources built on first use (``cpu/csrc``);
* ``gpu/``: the Triton kernels, for CUDA tensors (and the CPU under ``TRITON_INTERPRET=1``).
"""
