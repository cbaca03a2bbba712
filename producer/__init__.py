"""Enqueue side: the HTTP API, the Python client, the submit path (``submit``), the
OpenAI-compatible routes (``openai_compat``) and batches (``batches``)."""

from tidegate.producer.client import Client, Handle, SyncClient

__all__ = ["Client", "Handle", "SyncClient"]
