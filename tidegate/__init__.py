"""tidegate: queue-driven LLM inference over Redis Streams.

This package is the shared hall every role imports: the wire protocol, Redis key names,
settings, connection helpers, the tokenizer, the CLI and the local launcher.
"""

__version__ = "0.1.0"
