"""What every HTTP server of tidegate shares: callers' keys (``auth``, ``key_file``), the
servers' HTTP and WebSocket protocols (``http_protocol``, ``ws_protocol``), the uvicorn options
they run with (``server_options``) and the OpenAPI document (``openapi``).
"""
