"""What operators read: queue snapshots (``queue_stats``), the health and metrics routes
every server shares (``operator_routes``) and the status server of processes without an HTTP
API of their own (``status_server``), and the declaration of every metric family a process
exports (``metric_doc``), which the generated metrics reference reads.
"""
