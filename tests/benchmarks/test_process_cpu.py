"""The benchmarks' per-process CPU readings (``harness/run/processes.py``) and the
server-to-server benchmark's split of them by role: a launcher's children are found and their
CPU counted, a process that spins is charged for it and an idle one is not."""

from __future__ import annotations

import subprocess
import sys
import time

from tidegate.benchmarks.harness.run.processes import tree_cpu_seconds
from tidegate.benchmarks.serving.vs_llama_server import Round, cpu_by_role, role, summarize

SPIN = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\n"


def test_a_launchers_children_and_their_cpu_are_read() -> None:
    # A parent that starts a spinning child and an idle one, then waits for both.
    code = ("import subprocess, sys\n"
            f"a = subprocess.Popen([sys.executable, '-c', {SPIN!r} + 'time.sleep(30)'])\n"
            "b = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
            "a.wait(); b.wait()\n")
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while True:  # until both children exist and the spinner has spent its CPU
            tree = tree_cpu_seconds(parent.pid)
            children = {p: v for p, v in tree.items() if p != parent.pid}
            spinners = [s for argv, s in children.values() if "process_time" in argv]
            if len(tree) == 3 and spinners and spinners[0] >= 0.29:
                break
            assert time.monotonic() < deadline, tree
            time.sleep(0.05)
        idle = [s for argv, s in children.values() if "process_time" not in argv]
        assert parent.pid in tree and idle and idle[0] < 0.29
    finally:
        for pid in tree_cpu_seconds(parent.pid):
            subprocess.run(["kill", str(pid)], check=False)
        parent.wait(10)


def test_cpu_is_split_by_role_per_token() -> None:
    before = {1: ("/usr/bin/redis-server *:6379", 1.0), 2: ("python -m tidegate worker", 5.0),
              3: ("python -m tidegate up --port 8000", 2.0)}
    after = {1: ("/usr/bin/redis-server *:6379", 1.5), 2: ("python -m tidegate worker", 9.0),
             3: ("python -m tidegate up --port 8000", 3.0),
             4: ("python -m tidegate batch-worker", 0.25)}  # started between the readings
    assert cpu_by_role(before, after, 500) == {
        "api + gateway (up)": 2.0, "batch worker": 0.5, "redis-server": 1.0, "worker": 8.0}
    assert role("/cache/bin/llama-server -m x.gguf") == "llama-server"


def test_the_side_by_side_table_takes_each_servers_median_round() -> None:
    rounds = [Round("llama-server", 1, 4, 512, 5.0, {"llama-server": 18.0}),
              Round("tidegate up", 1, 4, 512, 4.0, {"worker": 10.0, "redis-server": 0.5}),
              Round("llama-server", 1, 4, 512, 4.0, {"llama-server": 17.0}),
              Round("tidegate up", 1, 4, 512, 2.0, {"worker": 8.0, "redis-server": 0.25}),
              Round("llama-server", 1, 4, 512, 6.0, {"llama-server": 19.0}),
              Round("tidegate up", 1, 4, 512, 8.0, {"worker": 12.0})]
    row = summarize(rounds, [1])["1 stream(s)"]
    assert row["llama-server"] == 102.4 and row["tidegate up"] == 128.0  # 512 / 5 s, 512 / 4 s
    assert row["tidegate up rounds"] == [128.0, 256.0, 64.0] and row["ratio"] == 1.25
    assert row["tidegate up cpu ms/token"] == {"redis-server": 0.25, "worker": 10.0}
    assert row["llama-server cpu ms/token"] == {"llama-server": 18.0}
