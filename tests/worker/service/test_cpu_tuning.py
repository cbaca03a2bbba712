"""The worker's process tuning (``worker/service/cpu_tuning.py``): libgomp's wait policy is set
for a worker unless the operator chose one, and never once torch has loaded libgomp (when it
would do nothing)."""

from __future__ import annotations

import os
import subprocess
import sys

from tidegate.worker.service.cpu_tuning import SPIN_COUNT, spin_between_regions


def test_the_wait_policy_is_set_unless_the_operator_chose_one() -> None:
    env: dict[str, str] = {"PATH": "/bin"}
    assert spin_between_regions(env)
    assert env == {"PATH": "/bin", "OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": SPIN_COUNT}
    for chosen in ({"OMP_WAIT_POLICY": "passive"}, {"GOMP_SPINCOUNT": "0"}):
        env = dict(chosen)
        assert not spin_between_regions(env) and env == chosen


def test_a_fresh_process_gets_it_and_one_with_torch_loaded_is_left_alone() -> None:
    code = ("import os, sys\n"
            "from tidegate.worker.service.cpu_tuning import spin_between_regions\n"
            "if sys.argv[1] == 'torch-first':\n"
            "    import torch\n"
            "print(spin_between_regions(), os.environ.get('OMP_WAIT_POLICY'))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    fresh = subprocess.run([sys.executable, "-c", code, "fresh"], env=env, capture_output=True,
                           text=True, check=True)
    assert fresh.stdout.split() == ["True", "active"]
    late = subprocess.run([sys.executable, "-c", code, "torch-first"], env=env,
                          capture_output=True, text=True, check=True)
    assert late.stdout.split() == ["False", "None"]
