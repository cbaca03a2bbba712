"""The queue-and-stream layer on one Redis server against a Redis Cluster, driven through the
whole stack by a fleet of processes (``fleet.py``), and its plot.
"""
