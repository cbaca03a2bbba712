"""The real processes a benchmark drives: redis-server (``redis_server.py``), the tidegate stack
(``stack.py``; under fire: ``chaos_stack.py``, ``chaos_monkey.py``), their memory
(``footprint.py``), and starting, waiting for and stopping a process (``processes.py``)."""
