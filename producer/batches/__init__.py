"""Batches: JSONL in, JSONL out (``batch``), run by an arq worker (``batch_worker``).
"""
