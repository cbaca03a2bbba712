"""Benchmarks, installed as ``tidegate.benchmarks`` and run as its modules
(``python -m tidegate.benchmarks.serving.serve``) or as scripts of a checkout.

Rooms: ``harness/`` (what they share: the stack of real processes, workloads, load generation,
metrics, reports), ``serving/`` (the whole stack under load), ``engine/`` (the engine alone,
in one process), ``kernels/`` (GPU kernel sweeps), ``cluster/`` (one Redis against a cluster),
``sessions/`` (the device-machine calls, shell). Results lie in ``results/`` by the same rooms,
each beside the command that made it.
"""
