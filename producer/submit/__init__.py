"""The submit path every submit route shares (``submit_path``): validate, admit (``admission``),
check the lane's backlog (``backlog``), rate limits (``rate_limit``) and idempotency keys
(``idempotency``), enqueue; refusals in one shape (``refusal``).
"""
