"""A job's events: stored and published (``event_log``), replayed then followed live
(``event_feed``), multiplexed over one pub/sub connection per process (``event_hub``), and
relayed to a WebSocket (``ws_relay``).
"""
