"""tidegate: queue-driven LLM inference over Redis Streams.

This package is the shared hall every role imports. Here: the wire protocol, Redis key names,
settings, retention, the Redis connection, the job record and log redaction. In folders: model
files and tokenizers (``model_files``), a job's events (``events``), what every server shares
(``http``), what operators read (``operations``), and the CLI with the launcher
(``commands``, the composition root).
"""

__version__ = "0.1.0"
