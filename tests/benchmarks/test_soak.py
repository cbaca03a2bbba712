"""benchmarks/serving/soak.py, short: the real stack at several times the worker's capacity with
retention of seconds; Redis holds about rate x retention jobs, not every job submitted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_short_soak_keeps_only_the_retained_jobs_and_trims_the_lane(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    # 16 s of load at 30 jobs/s is four retentions: what Redis keeps is a quarter of the run.
    rate, duration, retention = 30, 16, 4
    proc = subprocess.run(
        [sys.executable, "-m", "tidegate.benchmarks.serving.soak", "--duration-s", str(duration), "--rate",
         str(rate), "--sample-s", "2", "--result-ttl-s", str(retention), "--error-ttl-s",
         str(retention), "--rejected-ttl-s", str(retention), "--cancelled-ttl-s",
         str(retention), "--warmup-s", "6", "--follow-fraction", "0.1", "--out", str(out),
         "--logdir", str(tmp_path / "logs")],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    submitted = result["answers"].get("202", 0)
    assert submitted > rate * duration * 0.8
    assert result["follow_problems"] == 0 and result["followed"] > 0
    foot = result["footprint"]
    # Finished jobs outlive their final event by the retention only (TTLs are never above it).
    finished = {k: v for k, v in foot["jobs_by_status"].items()
                if k in ("done", "cancelled", "rejected", "error")}
    assert finished and all(v["ttl_s_max"] <= retention for v in finished.values())
    # What is left is a few seconds' worth of jobs, not the run's: every one submitted was kept
    # before (24 h), and the lane stream kept every entry.
    kept = sum(v["jobs"] for v in foot["jobs_by_status"].values())
    assert kept < submitted / 2
    assert foot["lane_entries"] < submitted / 2
    samples = result["samples"]
    assert len(samples) >= duration // 2 and all(s["rss"]["worker0"] > 0 for s in samples)
    assert set(result["after_warmup"]) >= {"redis_used_memory", "rss_api", "rss_gateway",
                                            "rss_worker0", "rss_redis"}
