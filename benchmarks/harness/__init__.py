"""The benchmarks' shared harness: the stack of real processes, workloads, load generation,
metrics and reports (``benchmarks/serving/serve.py`` is its fullest user).

``processes`` starts children (a free port, a log file, ``PYTHONSAFEPATH=1``, dying with the
benchmark) and waits until they are ready, ``redis_server`` runs a private redis-server,
``record`` says what made a result (the command, the machine, the git commit), ``stack`` starts
and stops the real processes of the whole stack, ``workload`` builds prompts and arrival
schedules, ``http`` and ``follow`` are the load generator's client side, ``loadgen`` runs it in
several processes, ``engine_alone`` runs the engine by itself on the same work, ``capacity``
measures the generator's own ceiling, ``metrics`` turns what the clients saw into numbers and
``report`` prints, saves and plots them.
"""
