"""Ports for the servers the tests start, so tests running in parallel never contend for one.

``bind(0)`` and close is racy twice over: the kernel may hand the same port to another process's
outgoing connection (it comes from the ephemeral range) before our server binds it, and a
pytest-xdist process beside this one may pick it too. So each test process takes its own block
of ``[10000, 20000)``, below Linux's ephemeral range (32768-60999), and walks it in order;
a Redis Cluster node's bus port (port + 10000) then lies in ``[20000, 30000)``, also this
process's own. A port something else holds (a process of an earlier run, a system service) is
skipped: it is taken only if it binds now. ``TIDEGATE_TEST_PORTS=LOW-HIGH`` moves the range, so
a second suite can run beside one (a part of the suite while a full run goes on).
"""

from __future__ import annotations

import itertools
import os
import random
import socket

HOST = "127.0.0.1"
LOWEST, HIGHEST = (int(p) for p in os.environ.get("TIDEGATE_TEST_PORTS",
                                                  "10000-20000").split("-"))  # exclusive
BUS_OFFSET = 10_000  # where Redis puts a cluster node's bus


def _block() -> range:
    """This process's ports: the xdist worker ``gwK`` of N gets the K-th of N equal blocks."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker.removeprefix("gw"))
    size = (HIGHEST - LOWEST) // count
    return range(LOWEST + index * size, LOWEST + (index + 1) * size)


_BLOCK = _block()
# A random start: ports still in TIME_WAIT from the last run on this machine come around late.
_NEXT = itertools.count(random.randrange(len(_BLOCK)))


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
        return True


def free_port(*, with_bus: bool = False) -> int:
    """A port of this process's block that binds now (and its bus port, ``with_bus``)."""
    for _ in range(len(_BLOCK)):
        port = _BLOCK[next(_NEXT) % len(_BLOCK)]
        if _bindable(port) and (not with_bus or _bindable(port + BUS_OFFSET)):
            return port
    raise RuntimeError(f"no free port left in {_BLOCK}")
