"""examples/chunked_prefill_demo.py --async: the claim it prints is computed from the measured
times (checked on made-up rows), and a tiny run writes both policies' figures to its results file."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "examples", "chunked_prefill_demo.py")


def load_demo():
    spec = importlib.util.spec_from_file_location("chunked_prefill_demo", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(name: str, arrival: float, first: float, steps: int) -> dict:
    return {"name": name, "kind": "short" if name.startswith("small") else "long", "arrival_s": arrival,
            "first_token_at_s": first, "ttft_s": first - arrival, "steps_to_first_token": steps}


def test_summary_counts_short_requests_answered_during_a_long_prefill():
    demo = load_demo()
    rows = [row("large_1", 0.0, 3.0, 12), row("large_2", 0.05, 5.0, 20),
            row("small_1", 0.02, 0.3, 2),   # during large_1's prefill, before its first token: counts
            row("small_2", 0.17, 4.0, 14),  # during both, after large_1's first token: does not
            row("small_3", 3.5, 3.6, 1),    # during large_2's only, before it: counts
            row("small_4", 6.0, 6.1, 1)]    # after both: not during a prefill
    summary = demo.summarize(rows)
    assert summary["short_arrived_during_long_prefill"] == 3
    assert summary["short_answered_before_that_long_prompt"] == 2
    assert summary["short_max_steps_to_first_token"] == 14
    assert summary["long_mean_ttft_s"] == pytest.approx((3.0 + 4.95) / 2)
    assert summary["short_mean_ttft_s"] == pytest.approx((0.28 + 3.83 + 0.1 + 0.1) / 4)


def test_async_demo_writes_both_policies(tiny_checkpoints, tmp_path):
    out = tmp_path / "demo_async.json"
    proc = subprocess.run(
        [sys.executable, DEMO, "--async", "--model", tiny_checkpoints["llama"], "--max-model-len", "1024",
         "--long-tokens", "200", "--max-tokens", "3", "--max-num-batched-tokens", "64", "--output-json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO, VLLM_CPU_KVCACHE_SPACE="0.0625"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "got their first token before it" in proc.stdout
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"partial_prefills", "fcfs"}
    assert result["runs"]["partial_prefills"]["settings"]["max_num_partial_prefills"] == 4
    assert result["runs"]["fcfs"]["settings"]["max_num_partial_prefills"] == 1
    assert result["settings"]["max_num_batched_tokens"] == 64 and result["machine"]["cpu_model"]
    for run in result["runs"].values():
        names = sorted(r["name"] for r in run["requests"])
        assert names == ["large_1", "large_2"] + [f"small_{i}" for i in range(1, 7)]
        assert all(r["ttft_s"] > 0 and r["steps_to_first_token"] >= 1 for r in run["requests"])
        assert max(r["prompt_tokens"] for r in run["requests"]) >= 200
        assert run["summary"] == load_demo().summarize(run["requests"])
        assert run["num_steps"] >= 200 // 64  # the warm-up's steps are not counted
