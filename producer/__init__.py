"""Enqueue side: the Python client, the HTTP API, OpenAI-compatible routes and admission."""

from producer.client import Client, Handle, SyncClient

__all__ = ["Client", "Handle", "SyncClient"]
