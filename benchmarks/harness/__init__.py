"""The benchmarks' shared harness (``benchmarks/serving/serve.py`` is its fullest user), in three
rooms: ``run/`` (the real processes: redis-server, the stack, chaos, starting and stopping a
child), ``load/`` (workloads and the clients that submit and follow them) and ``measure/``
(exactness checks, metrics, reports and a result's record). Beside them: the engine by itself
on the same work (``engine_alone.py``) and greedy token-for-token comparisons (``greedy.py``).
"""
