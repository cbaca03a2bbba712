"""The submit path every submit route shares (``submit_path``): the body read (``request_body``)
and validated, admitted (``admission``), the lane's backlog (``backlog``), rate limits
(``rate_limit``) and idempotency keys (``idempotency``) checked, the job enqueued (through
``batched``); refusals in one shape (``refusal``).
"""
