"""Generated input against the real stack: every HTTP route from its OpenAPI document
(schemathesis), the WebSocket and SSE endpoints from hypothesis strategies; see benchmarks/serving/fuzz.py."""
