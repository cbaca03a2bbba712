"""benchmarks/serving/serve.py end to end: the real stack as processes, every measured job exact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def run_serve(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "serve.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tidegate.benchmarks.serving.serve", "--quick", "--model", "random:tiny",
         "--out", str(out), "--plot", "", "--logdir", str(tmp_path / "logs"), *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def test_quick_run_measures_every_job_exactly_beside_the_engine_alone(tmp_path: Path) -> None:
    proc, result = run_serve(
        tmp_path, "--burst", "20", "--rates", "10", "--num-prompts", "20",
        "--capacity-submits", "100", "--capacity-streams", "10",
        "--capacity-stream-tokens", "16", "--follow", "mixed")
    assert result["exact"] is True
    burst, rate = result["runs"]
    assert (burst["kind"], burst["jobs"], burst["completed"]) == ("burst", 20, 20)
    assert (rate["kind"], rate["request_rate"], rate["jobs"], rate["completed"]) == (
        "rate", 10.0, 20, 20)
    for run in (burst, rate):
        assert run["exact"] and run["exact_failures"] == 0
        assert run["failed"] == run["rejected"] == 0
        assert run["followed"] == {"ws": 10, "sse": 10}
        assert run["output_tokens"] == 20 * 16 and run["output_tok_s"] > 0
        assert run["ttft_ms"]["n"] == 20 and run["tpot_ms"]["p99"] > 0
        assert set(run["stack_cpu_share"]) == {"redis", "api", "gateway", "worker0"}
    assert burst["engine_alone_tok_s"] > 0 and burst["ratio_to_engine_alone"] > 0
    assert result["engine_alone"]["burst"]["output_tokens"] == 20 * 16
    assert result["prompts"]["burst"]["input_tokens_min"] == 32  # --quick's input length
    follow = result["capacity"]["follow"]
    assert follow["exact"] and follow["tokens"] == 10 * 16
    assert result["capacity"]["submit"]["accepted"] == 100
    assert "burst" in proc.stdout and "exact" in proc.stdout


def test_polled_jobs_are_checked_from_their_stored_results(tmp_path: Path) -> None:
    _, result = run_serve(tmp_path, "--only", "burst", "--burst", "8", "--no-engine-alone",
                          "--follow-fraction", "0.5")
    (burst,) = result["runs"]
    assert result["exact"] is True and result["capacity"] == {}
    assert burst["followed"] == {"ws": 4, "poll": 4} and burst["completed"] == 8


def test_constrained_jobs_are_checked_against_their_schema(tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["a", "n"], "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    _, result = run_serve(tmp_path, "--only", "burst", "--burst", "6", "--response-format",
                          str(path), "--follow", "mixed")
    (burst,) = result["runs"]
    assert result["exact"] is True and burst["completed"] == 6
    check = burst["json_outputs"]
    assert check["checked"] == 6 and check["invalid"] == 0
    assert check["whole"] + check["prefixes"] == 6
    alone = result["engine_alone"]["burst"]
    assert alone["grammar_masks"]["rows"] > 0 and burst["same_text_as_engine_alone"] == 1.0


def test_the_json_check_tells_prefixes_whole_documents_and_breaks_apart() -> None:
    from tidegate.benchmarks.harness.measure.json_check import json_prefix_problem, output_problem

    doc = '{"a": "x\\u00e9", "b": [1, -2.5e+3, true, null, {}], "c": {"d": []}}'
    assert all(json_prefix_problem(doc[:k])[0] is None for k in range(len(doc) + 1))
    assert json_prefix_problem(doc) == (None, True)
    for bad in ('{"a" 1}', "[1,]", '{"a": tru,', "01", '{"a": 1}}', '"\x01"', '{"a": 1.}'):
        assert json_prefix_problem(bad)[0] is not None, bad
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    assert output_problem('{"a": "x', "length", schema) == (None, False)
    assert "closed" in (output_problem('{"a": "x', "stop", schema)[0] or "")
    assert output_problem('{"a": "x"}', "stop", schema) == (None, True)


def test_a_chat_mix_sweeps_rates_against_the_slo_and_reports_its_cold_start(
        tmp_path: Path) -> None:
    """A chat-like mix over two rates with an SLO: each rate's first jobs apart from the rest,
    the highest rate that met the SLO, the mix's roofline from the engine alone, and the
    headline figures in --goodput-out."""
    headline = tmp_path / "goodput.json"
    _, result = run_serve(
        tmp_path, "--only", "burst", "rates", "--no-engine-alone", "--burst", "8",
        "--length-dist", "chat", "--chat-scale", "0.2", "--input-range", "4", "200",
        "--output-range", "2", "12", "--shared-prefix-share", "0.5", "--shared-prefix-len", "32",
        "--rates", "20", "40", "--num-prompts", "24", "--cold-jobs", "6", "--slo-sweep",
        "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--roofline",
        "--goodput-out", str(headline))
    assert result["exact"] is True
    burst, *rates = result["runs"]
    assert [r["request_rate"] for r in rates] == [20.0, 40.0]
    for r in rates:
        assert r["cold"]["jobs"] == 6 and r["steady"]["jobs"] == 18
        assert r["cold"]["ttft_ms"]["n"] == 6 and r["cold"]["queue_ms"]["n"] == 6
        assert r["cold_ttft_p90_ratio"] > 0
    sweep = result["slo_sweep"]
    assert [row["met"] for row in sweep["rates"]] == [True, True]
    assert sweep["slo_rate_req_s"] == 40.0
    for r in result["runs"]:  # the worker's own time counters, read from its /metrics
        assert r["worker_time"]["worker0"]["engine_step_seconds"] > 0, r["worker_time"]
    roof = result["roofline"]
    assert roof["matmul_tflop_s"] > 0 and roof["decode_step_ms"] > 0
    assert roof["flops_per_prompt_token"] > 0 and roof["roofline_req_s"] > 0
    # Decode alone was timed: every timed step decoded the whole batch, no prompt among them.
    assert roof["decode_tok_s"] > 0 and roof["decode_prompt_tokens"] == 0
    assert roof["decode_batch"] >= 1 and roof["decode_steps"] > 0
    # The prompts that filled the cache were timed too, against the matrix rate.
    assert roof["prefill_tok_s"] > 0 and roof["prefill_share_of_matmul"] > 0
    figures = json.loads(headline.read_text())
    assert figures["device"] == result["machine"]["cpu_model"]  # a CPU run names its CPU
    assert figures["slo_rate_req_s"] == 40.0
    assert figures["burst_req_s"] == burst["request_throughput"] > 0
    assert figures["roofline_req_s"] == roof["roofline_req_s"]
    assert figures["cold_wave_ttft_p90_ratio"] == max(r["cold_ttft_p90_ratio"] for r in rates)


def test_a_sweep_stops_at_the_first_rate_that_misses_the_slo(tmp_path: Path) -> None:
    _, result = run_serve(
        tmp_path, "--only", "rates", "--no-engine-alone", "--rates", "5", "10",
        "--num-prompts", "6", "--slo-sweep", "--slo-ttft-ms", "0.001")
    assert [r["request_rate"] for r in result["runs"]] == [5.0]  # 10/s never ran
    assert result["slo_sweep"]["slo_rate_req_s"] is None
    assert result["slo_sweep"]["rates"] == [
        {"rate": 5.0, "ttft_p99_ms": result["runs"][0]["ttft_ms"]["p99"],
         "tpot_p99_ms": result["runs"][0]["tpot_ms"]["p99"], "met": False,
         "cold_ttft_p90_ratio": None}]
