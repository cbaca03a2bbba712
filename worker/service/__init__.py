"""The queue-facing worker process around the engine: the service loop (``service``), lane
intake and arrivals, event publishing, the cancel listener, request migration, metrics and
process tuning.
"""
