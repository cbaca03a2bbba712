"""The whole stack as processes under load: latency against rate (``serve.py``), submit
throughput, fan-out, goodput under overload, soak, chaos, fuzzing, prefix routing, and what
rate limits and log redaction cost.
"""
