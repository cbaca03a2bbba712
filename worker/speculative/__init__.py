"""Speculative decoding: proposers of draft tokens, their verification in the batch, the
governor that decides when a step speculates, and ``speculative_engine``, which plugs them into
the engine through the interface it owns (``tidegate.worker.engine.speculation``)."""
