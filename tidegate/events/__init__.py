"""A job's events: stored and published (``event_log``), read back (``event_feed``), followed
live (``follow``), multiplexed over one pub/sub connection per process (``event_hub``), and
relayed to a WebSocket (``ws_relay``).
"""
