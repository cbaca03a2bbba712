"""The WebSocket gateway: job events from Redis fanned out to every watching client."""
