"""Prefix-aware routing: what the API and the workers share to send a job where its prompt's
KV cache already is."""
