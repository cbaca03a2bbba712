"""The OpenAI-compatible routes (``routes``): requests translated into jobs (``schema``),
answered from the job's events (``answer``, ``format``), errors in OpenAI's shape
(``errors``).
"""
