"""The benchmark scripts run end to end at a tiny size on a tiny random Llama checkpoint.

Each script runs as a subprocess (`sys.executable`), as a user would run it, and writes its JSON
into tmp_path. Sizes are a few requests of a few tokens, so each run takes seconds. The pure
helpers of the serving benchmark (arrivals, goodput, metrics, the capacity bisection) are also
checked in process, without an engine, and the recorded workloads.json is checked to be one
full run.
"""

import importlib.util
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys

import pytest
import torch

from vllm.model_executor.layers import cpu_gemv, cpu_tile_gemm
from vllm.platforms.cpu import cpu_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "benchmarks")
THROUGHPUT_LINE = re.compile(
    r"^Throughput: [0-9.]+ requests/s, [0-9.]+ total tokens/s, [0-9.]+ output tokens/s$", re.M)
VLLM_THROUGHPUT_KEYS = {"elapsed_time", "num_requests", "total_num_tokens", "requests_per_second",
                        "tokens_per_second"}
# Small engines: eager (no graph capture at start-up) and a small KV cache.
ENGINE = ["--enforce-eager", "--kv-cache-memory-bytes", str(32 * 1024**2), "--block-size", "16"]
# Each machine limit measured for a few repetitions only: the tests check the figures' form.
QUICK_ROOFLINE = ["--roofline-seconds", "0.01"]


def _has_amx() -> bool:
    return {"amx_tile", "amx_bf16"} <= cpu_flags()


def run_script(name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, os.path.join(BENCH, name), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env=env)
    return proc


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (f"exit {proc.returncode}\nstdout:\n{proc.stdout}\n"
                                  f"stderr:\n{proc.stderr[-4000:]}")


def load_module(name: str):
    """Imports benchmarks/<name>.py (its imports find the helper modules beside it)."""
    if name in sys.modules:
        return sys.modules[name]
    sys.path.insert(0, BENCH)
    try:
        spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(BENCH)


def check_roofline(roofline: dict) -> None:
    assert "error" not in roofline, roofline
    assert roofline["peak_matmul_flops_per_s"] > 0
    assert roofline["memory_bandwidth_bytes_per_s"] > 0
    assert 0 < roofline["prefill"]["fraction_of_matmul_peak"] < 1
    assert 0 < roofline["decode"]["fraction_of_bandwidth"] < 1
    assert roofline["weight_bytes_source"] == "as loaded"  # the engine's own weights, in this process


# --------------------------------------------------------------------------- throughput

def test_throughput_vllm(tiny_checkpoints, tmp_path):
    out = tmp_path / "throughput.json"
    proc = run_script("benchmark_throughput.py", "--model", tiny_checkpoints["llama"],
                      "--input-len", "16", "--output-len", "4", "--num-prompts", "4",
                      "--max-num-batched-tokens", "32", *ENGINE, "--disable-tqdm", *QUICK_ROOFLINE,
                      "--output-json", str(out))
    check_ok(proc)
    assert THROUGHPUT_LINE.search(proc.stdout), proc.stdout
    result = json.loads(out.read_text())
    assert result.keys() >= VLLM_THROUGHPUT_KEYS
    assert result["num_requests"] == 4
    assert result["total_num_tokens"] == 4 * (16 + 4)
    assert result["generated_tokens"] == 4 * 4
    assert result["backend"] == "vllm"
    assert result["output_tokens_per_second"] > 0
    assert math.isclose(result["tokens_per_second"], result["total_num_tokens"] / result["elapsed_time"])
    assert {"cpu_model", "nproc", "torch_version"} <= result["machine"].keys()
    if platform.machine() == "x86_64" and os.path.exists("/proc/cpuinfo"):  # Linux lists the generation there
        assert isinstance(result["machine"]["cpu_family"], int)
        assert isinstance(result["machine"]["cpu_model_number"], int)
    assert result["args"]["input_len"] == 16
    # The warm-up is not in the measured counters: 4 x 16 prompt tokens and 4 x 3 decodes are
    # computed (the engine may count a prompt's last token as a decode, so only the sum is fixed).
    stats = result["engine_stats"]
    assert stats["num_prefill_tokens"] + stats["num_decode_tokens"] == 4 * 16 + 4 * 3
    composition = result["step_composition"]
    assert sum(c["prefill_tokens"] + c["decode_tokens"] for c in composition.values()) == 76
    assert sum(c["steps"] for c in composition.values()) == stats["num_steps"]
    check_roofline(result["roofline"])


def test_throughput_hf_backend_with_dataset(tiny_checkpoints, tmp_path):
    dataset = tmp_path / "workload.jsonl"
    dataset.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "The capital of France is", "output_len": 3},
        {"prompt_token_ids": [100, 200, 300, 400, 500, 600, 700], "output_len": 5},
        {"prompt": "Once upon a time", "output_len": 4},
    ]) + "\n")
    out = tmp_path / "hf.json"
    proc = run_script("benchmark_throughput.py", "--backend", "hf", "--hf-max-batch-size", "2",
                      "--model", tiny_checkpoints["llama"], "--dataset", str(dataset),
                      "--num-prompts", "3", "--output-json", str(out))
    check_ok(proc)
    assert THROUGHPUT_LINE.search(proc.stdout), proc.stdout
    result = json.loads(out.read_text())
    assert result.keys() >= VLLM_THROUGHPUT_KEYS
    assert result["backend"] == "hf"
    assert result["num_requests"] == 3
    assert result["total_output_tokens"] == 3 + 5 + 4
    assert result["num_batches"] == 2
    # Every row of a batch generates the batch's longest output (min_new_tokens = max_new_tokens).
    assert result["generated_tokens"] == 2 * 5 + 1 * 4


def test_throughput_dataset_output_len_override_vllm(tiny_checkpoints, tmp_path):
    dataset = tmp_path / "workload.json"
    dataset.write_text(json.dumps([{"prompt": "Hello there, how are you", "output_len": 50},
                                   {"prompt": "Tell me a story", "output_len": 60}]))
    out = tmp_path / "t.json"
    proc = run_script("benchmark_throughput.py", "--model", tiny_checkpoints["llama"],
                      "--dataset", str(dataset), "--output-len", "3", "--num-prompts", "5",
                      "--no-enable-chunked-prefill", *ENGINE, "--disable-tqdm", "--no-roofline",
                      "--output-json", str(out))
    check_ok(proc)
    result = json.loads(out.read_text())
    assert result["num_requests"] == 2
    assert result["total_output_tokens"] == 6
    assert result["enable_chunked_prefill"] is False
    assert "roofline" not in result


@pytest.mark.parametrize("args,named", [
    (["--backend", "hf", "--input-len", "4", "--output-len", "2"], "--hf-max-batch-size"),
    ([], "--input-len"),
    (["--input-len", "4", "--output-len", "2", "--roofline-seconds", "0"], "--roofline-seconds"),
])
def test_throughput_argument_errors(tiny_checkpoints, capsys, args, named):
    """The script's checks of its flags, called as its __main__ calls them (in this process):
    parser.error exits with status 2, naming the missing flag."""
    throughput = load_module("benchmark_throughput")
    parser = throughput.make_parser()
    with pytest.raises(SystemExit) as exit_info:
        throughput.check_args(parser, parser.parse_args([*args, "--model", tiny_checkpoints["llama"]]))
    assert exit_info.value.code == 2 and named in capsys.readouterr().err


def test_throughput_llama_cpp_backend(tiny_checkpoints, tmp_path):
    """With llama-cpp-python missing (CI) the backend fails with a clear message; with it, it runs."""
    has_llama_cpp = importlib.util.find_spec("llama_cpp") is not None
    out = tmp_path / "llama_cpp.json"
    args = ["--backend", "llama.cpp", "--input-len", "8", "--output-len", "3", "--num-prompts", "3",
            "--output-json", str(out)]
    if not has_llama_cpp:
        args += ["--model", tiny_checkpoints["llama"]]
    proc = run_script("benchmark_throughput.py", *args)
    if has_llama_cpp:  # the default model is a GGUF
        check_ok(proc)
        assert THROUGHPUT_LINE.search(proc.stdout)
        assert json.loads(out.read_text())["generated_tokens"] == 9
    else:
        assert proc.returncode != 0
        assert "llama-cpp-python" in proc.stderr + proc.stdout


# --------------------------------------------------------------------------- latency

def test_latency(tiny_checkpoints, tmp_path):
    out = tmp_path / "latency.json"
    proc = run_script("benchmark_latency.py", "--model", tiny_checkpoints["llama"],
                      "--input-len", "8", "--output-len", "4", "--batch-size", "2",
                      "--num-iters-warmup", "1", "--num-iters", "3", *ENGINE,
                      "--quantization", "int8", *QUICK_ROOFLINE, "--output-json", str(out))
    check_ok(proc)
    assert re.search(r"^Avg latency: [0-9.e-]+ seconds$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^99% percentile latency: [0-9.e-]+ seconds$", proc.stdout, re.M)
    result = json.loads(out.read_text())
    assert {"avg_latency", "latencies", "percentiles"} <= result.keys()
    assert len(result["latencies"]) == 3
    assert set(result["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert math.isclose(result["avg_latency"], sum(result["latencies"]) / 3)
    assert result["percentiles"]["10"] <= result["percentiles"]["99"]
    # 3 iterations x 2 prompts x (8 prompt tokens + 3 decodes)
    stats = result["engine_stats"]
    assert stats["num_prefill_tokens"] + stats["num_decode_tokens"] == 3 * 2 * (8 + 3)
    assert result["avg_decode_steps"] == 3
    check_roofline(result["roofline"])
    # int8 weights: a decode step reads the linear layers' Q8_0 blocks (34 bytes per 32 weights)
    # and the lm_head in the run's dtype (bf16, or float32 where the CPU has no native bf16); the
    # norms, a few hundred of the body's parameters, stay in that dtype.
    params, size = result["roofline"]["params"], getattr(torch, result["dtype"]).itemsize
    saved = size * (params["matmul_body"] + params["lm_head"]) - result["roofline"]["weight_bytes_per_step"]
    most = (size - 34 / 32) * params["matmul_body"]
    assert 0.96 * most < saved <= most


def test_step_host(tiny_checkpoints, tmp_path):
    out = tmp_path / "step_host.json"
    proc = run_script("benchmark_step_host.py", "--model", tiny_checkpoints["llama"], "--num-seqs", "1,5",
                      "--input-len", "20", "--repeats", "5", *ENGINE, "--output-json", str(out))
    check_ok(proc)
    result = json.loads(out.read_text())
    assert [r["num_seqs"] for r in result["results"]] == [1, 5]
    for r in result["results"]:
        for name in ("schedule", "undo", "prepare"):
            assert 0 < r[name]["best_us"] <= r[name]["median_us"]
        assert r["per_seq_us"]["prepare"] == r["prepare"]["median_us"] / r["num_seqs"]
    assert re.search(r"^   5 sequences: schedule +[0-9.]+ us", proc.stdout, re.M), proc.stdout


# --------------------------------------------------------------------------- workloads A-E

def test_workloads(tiny_checkpoints, tmp_path):
    out = tmp_path / "workloads.json"
    proc = run_script("benchmark_workloads.py", "--model", tiny_checkpoints["llama"], "--scale", "0.02",
                      "--max-model-len", "256", "--enforce-eager", "--block-size", "16", *QUICK_ROOFLINE,
                      "--dtype", "float32", "--hf-dtype", "bfloat16", "--output-json", str(out))
    check_ok(proc)
    result = json.loads(out.read_text())
    assert result["dtypes"] == {"vllm": "float32", "hf": "bfloat16"}  # transformers' as loaded
    # Dense FLOPs over the time, against the matmul peak. At --scale 0.02 A has 16 prompts of 5
    # tokens, B one of 41, D 4 of 40 and 16 of 1, with one output token each: the body runs on the
    # prompts alone.
    body = load_module("roofline").model_param_counts(tiny_checkpoints["llama"])["matmul_body"]
    peak = result["machine_roofline"]["matmul"]["flops_per_s"]
    for backend in ("vllm", "hf"):
        values = result["workloads"][backend]
        for key in ("A_total_tokens_per_s", "B_ttft_s", "C_decode_tokens_per_s", "D_wall_s",
                    "C_fraction_of_memory_bandwidth"):
            assert values[key] > 0, (backend, key)
        for key, tokens, seconds in (("A", 16 * 5, 16 * (5 + 1) / values["A_total_tokens_per_s"]),
                                     ("B", 41, values["B_ttft_s"]), ("D", 4 * 40 + 16, values["D_wall_s"])):
            expected = 2 * body * tokens / seconds / peak
            assert values[f"{key}_fraction_of_matmul_peak"] == pytest.approx(expected), (backend, key)
        assert len(values["C_memory_bounds_bytes_per_s"]) == 3 and min(values["C_memory_bounds_bytes_per_s"]) > 0
    ours = result["workloads"]["vllm"]
    assert 0 < ours["C_model_share_of_decode_time"] < 1  # the host's part of a step is never nothing
    assert ours["C_model_fraction_of_memory_bandwidth"] == pytest.approx(
        ours["C_fraction_of_memory_bandwidth"] / ours["C_model_share_of_decode_time"])
    assert "C_model_share_of_decode_time" not in result["workloads"]["hf"]
    # D's steps: every prompt token in one of them (its one output token each comes from the
    # prompt's last chunk: no decodes), and their seconds within the wall time.
    steps = ours["D_steps"]
    assert sum(k["prefill_tokens"] for k in steps.values()) == 4 * 40 + 16
    assert sum(k["decode_tokens"] for k in steps.values()) == 0  # one output token each
    assert 0 < sum(k["seconds"] for k in steps.values()) <= ours["D_wall_s"]
    assert "D_steps" not in result["workloads"]["hf"]
    assert re.search(r"^D steps: prefill_only \d+ \([0-9.]+ s\), decode_only \d+", proc.stdout, re.M), proc.stdout
    e = result["workloads"]["vllm"]["E"]
    assert e["chunked"]["p99_gap_s"] <= e["chunked"]["max_gap_s"]
    for name in ("chunked", "unchunked"):  # each figure the mean of its two runs
        runs = e[name]["runs"]
        assert len(runs) == 2
        assert e[name]["total_tokens_per_s"] == pytest.approx((runs[0]["total_tokens_per_s"]
                                                               + runs[1]["total_tokens_per_s"]) / 2)
    assert set(result["ratios"]) == {"A_throughput_vs_hf", "B_ttft_hf_over_ours", "C_decode_vs_hf",
                                     "D_wall_ours_over_hf"}
    assert re.search(r"^A_throughput_vs_hf: [0-9.]+$", proc.stdout, re.M), proc.stdout
    bad = run_script("benchmark_workloads.py", "--workloads", "A,Z")
    assert bad.returncode != 0 and "unknown workloads" in bad.stderr


def test_ab_alternates_two_checkouts(tiny_checkpoints, tmp_path):
    """This checkout against itself as the base: each workload in every round on both workers,
    the medians and speedups from those figures; bad arguments are refused by name."""
    out = tmp_path / "ab.json"
    proc = run_script("benchmark_ab.py", "--base", REPO, "--model", tiny_checkpoints["llama"], "--scale", "0.02",
                      "--rounds", "2", "--max-model-len", "256", "--block-size", "16", "--enforce-eager",
                      "--kv-cache-memory-bytes", str(32 * 1024**2), "--output-json", str(out))
    check_ok(proc)
    result = json.loads(out.read_text())
    assert set(result["workloads"]) == {"A", "B", "C"}
    for name, w in result["workloads"].items():
        assert len(w["this"]) == len(w["base"]) == 2 and min(w["this"] + w["base"]) > 0
        this, base = w["median_this"], w["median_base"]
        assert this == pytest.approx(sum(w["this"]) / 2) and base == pytest.approx(sum(w["base"]) / 2)
        assert w["speedup_this_over_base"] == pytest.approx(base / this if name == "B" else this / base)
    assert result["base"]["path"] == os.path.realpath(REPO)
    for argv, named in ((["--base", REPO, "--workloads", "A,Z"], "unknown workloads"),
                        (["--base", str(tmp_path)], "not a checkout"), (["--base", REPO, "--rounds", "0"], "--rounds")):
        bad = run_script("benchmark_ab.py", *argv)
        assert bad.returncode != 0 and named in bad.stderr, bad.stderr


def test_ab_gives_both_workers_the_engine_flags():
    ab = load_module("benchmark_ab")
    args = ab.parse_args(["--base", REPO, "--dtype", "float32", "--block-size", "16"])
    assert ab._engine_kwargs(args) == {"kv_cache_memory_bytes": 1 << 30, "enable_chunked_prefill": True,
                                       "dtype": "float32", "block_size": 16}


def test_prefix_caching_workload(tiny_checkpoints, tmp_path):
    out = tmp_path / "prefix_caching.json"
    proc = run_script("benchmark_prefix_caching.py", "--model", tiny_checkpoints["llama"], "--num-requests", "4",
                      "--scale", "0.05", "--max-model-len", "256", "--block-size", "16",
                      "--max-num-batched-tokens", "32", "--max-num-seqs", "4", "--output-json", str(out))
    check_ok(proc)
    result = json.loads(out.read_text())
    assert result["workload"] == {"num_requests": 4, "shared_prefix_len": 77, "own_len": 3, "output_len": 3}
    on, off = result["modes"]["caching_on"], result["modes"]["caching_off"]
    # The first request computes the system prompt in 3 steps of 32; the 3 others find its 4
    # full blocks (named once computed, so from its last chunk's step on).
    assert on["prefix_cache_hits"] == 3 * 64 and on["prefix_cache_queries"] == 4 * 80
    assert off["prefix_cache_queries"] == 0
    assert on["engine_stats"]["num_prefill_tokens"] < off["engine_stats"]["num_prefill_tokens"]
    assert set(result["ratios"]) == {"ttft_p50_off_over_on", "ttft_p99_off_over_on", "throughput_on_over_off"}
    assert re.search(r"^throughput_on_over_off: [0-9.]+$", proc.stdout, re.M), proc.stdout


@pytest.mark.skipif(not _has_amx(), reason="the tile-overlap benchmark needs AMX")
def test_tile_load_overlap(tmp_path):
    out = tmp_path / "overlap.json"
    proc = run_script("benchmark_tile_load_overlap.py", "--iterations", "2000", "--output-json", str(out))
    check_ok(proc)
    result = json.loads(out.read_text())["ns_per_iteration"]
    assert set(result) == {"loads and products", "products only", "loads only"}
    for times in result.values():
        assert set(times) == {"tile alone", "vector alone", "one after the other", "interleaved"}
        assert all(0 < t < 1e6 for t in times.values())
    proc = run_script("benchmark_tile_load_overlap.py", "--vector-rows", "12")
    assert proc.returncode != 0 and "multiple of 8" in proc.stderr


@pytest.mark.skipif(not {"avx512_bf16", "avx512bw", "avx512dq"} <= cpu_flags(),
                    reason="the prefill kernel needs AVX512-BF16")
def test_prefill_attention(tmp_path):
    out = tmp_path / "prefill.json"
    proc = run_script("benchmark_prefill_attention.py", "--queries", "40", "--context", "50", "--block-size", "16",
                      "--rounds", "2", "--repeats", "1", "--output-json", str(out))
    check_ok(proc)
    result = json.loads(out.read_text())
    assert set(result["paths"]) == {"kernel", "torch"} and result["kernel_speedup_over_torch"] > 0
    assert result["max_abs_difference"] < 0.05  # the two paths attend alike
    assert all(0 < p["fraction_of_matmul_peak"] < 1 for p in result["paths"].values())


@pytest.mark.skipif(cpu_tile_gemm.max_rows() == 0, reason="no tile GEMM here (it needs AMX or AVX512-BF16)")
def test_tile_gemm(tmp_path):
    out = tmp_path / "tile_gemm.json"
    proc = run_script("benchmark_tile_gemm.py", "--rows", "8", "33", "--shapes", "576x576", "--rounds", "1",
                      "--min-seconds", "0.001", "--output-json", str(out))
    check_ok(proc)
    result = json.loads(out.read_text())
    assert [(p["in"], p["out"], p["rows"]) for p in result["products"]] == [(576, 576, 8), (576, 576, 33)]
    for product in result["products"]:
        assert product["max_abs_difference_from_float32"] < 0.05  # bf16 output of the same product
        assert all(product[name]["fraction_of_matmul_peak"] > 0 for name in ("tile", "onednn_blocked", "F.linear"))
    assert result["tile_copy"] in ("amx", "avx512")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv(tmp_path, dtype):
    if cpu_gemv.max_rows(dtype) == 0:
        pytest.skip(f"no C {dtype} GEMV here (it needs AVX512-BF16, or AVX2 for float32, and a C compiler)")
    out = tmp_path / "gemv.json"
    rows = [1, 3] if dtype == torch.bfloat16 else [1, 3, 9]  # float32: past a group of 4
    proc = run_script("benchmark_gemv.py", "--layers", "2", "--vocab", "4096", "--repeats", "2",
                      "--dtype", str(dtype).removeprefix("torch."), "--rows", ",".join(map(str, rows)),
                      "--output-json", str(out))
    check_ok(proc)
    result = json.loads(out.read_text())
    assert result["rows"] == rows
    for name in ("layers", "lm_head"):
        speeds = result["GB_per_s"][name]
        assert set(speeds) == {"read", "read_prefetch", *(f"{kind}_x{m}" for kind in ("gemv", "linear") for m in rows)}
        read = max(speeds["read"], speeds["read_prefetch"])
        for kind in ("gemv", "linear"):
            assert result[f"{kind}_over_read"][name] == pytest.approx(
                {f"{kind}_x{m}": speeds[f"{kind}_x{m}"] / read for m in rows})
    assert result["dtype"] == str(dtype).removeprefix("torch.")
    assert result["machine"]["cpu_model"] and result["args"]["layers"] == 2


def test_sharing_arguments(capsys):
    """The engine's and the workloads' flags go through to benchmark_workloads.py; a policy or a
    workload it does not run is refused at once (each run is a process of its own, run twice)."""
    sharing = load_module("benchmark_sharing")
    args = sharing.parse_args(["--policies", "default,1-thread", "--workloads", "C", "--model", "m.gguf",
                               "--roofline-seconds", "0.1"])
    assert args.policies == "default,1-thread" and args.workloads == "C"
    assert args.workload_args == ["--model", "m.gguf", "--roofline-seconds", "0.1"]
    for argv, named in ((["--policies", "default,eager"], "eager"), (["--workloads", "A,B"], "--workloads")):
        with pytest.raises(SystemExit):
            sharing.parse_args(argv)
        assert named in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(f[:-3] for f in os.listdir(BENCH) if f.endswith(".py")))
def test_every_benchmark_module_imports(name, monkeypatch):
    """Each script and helper imports (a script's main() is not run): one that still imports a
    moved or deleted module fails here, even where its smoke test is skipped or missing."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # scripts put their folder first on it
    load_module(name)


@pytest.mark.skipif(shutil.which("cc") is None, reason="the decode kernel needs a C compiler")
def test_decode_attention(tmp_path):
    out = tmp_path / "decode.json"
    proc = run_script("benchmark_decode_attention.py", "--contexts", "300x2,20x3", "--layers", "3",
                      "--block-size", "16", "--rounds", "2", "--repeats", "1", *QUICK_ROOFLINE,
                      "--output-json", str(out))
    check_ok(proc)
    result = json.loads(out.read_text())
    assert set(result["placements"]) == {"cold", "warm"}
    assert result["read_bytes"] == (2 * 300 + 3 * 20) * 3 * 2 * 3 * 64 * 2  # keys and values, bf16
    assert all(p["ms_median"] > 0 for p in result["placements"].values())
    assert result["cold_fraction_of_bandwidth"] > 0
    proc = run_script("benchmark_decode_attention.py", "--contexts", "300x2", "--layers", "2", "--block-size", "16",
                      "--rounds", "1", "--repeats", "1", "--dtype", "float32", *QUICK_ROOFLINE,
                      "--output-json", str(out))
    check_ok(proc)
    result = json.loads(out.read_text())
    assert result["dtype"] == "float32" and result["read_bytes"] == 2 * 300 * 2 * 2 * 3 * 64 * 4
    for argv, named in ((["--contexts", "300"], "LENxCOUNT"), (["--dtype", "float32", "--copy", "amx"], "bf16 only")):
        proc = run_script("benchmark_decode_attention.py", *argv)
        assert proc.returncode != 0 and named in proc.stderr, argv


@pytest.mark.skipif(shutil.which("cc") is None, reason="the instruction peaks are measured in C")
def test_dot_product_peaks_are_measured_for_the_instructions_this_cpu_has():
    roofline = load_module("roofline")
    peaks = roofline.measure_dot_product_peaks(iterations=20_000, reps=1)
    flags = cpu_flags()
    # float32 FMAs and int8 products in zmm registers, or AVX2's in ymm: every x86-64-v3 CPU
    expected = {name for name, needs in (("float32", {"avx2", "fma"}), ("bfloat16", {"avx512_bf16", "avx512bw"}),
                                         ("int8", {"avx2"})) if needs <= flags}
    assert set(peaks) == expected
    assert all(rate > 1e9 for rate in peaks.values())  # multiply-adds per second, of every core


@pytest.mark.skipif("avx2" not in cpu_flags(), reason="the int8 products need AVX2")
def test_gguf_products(tmp_path):
    out = tmp_path / "products.json"
    proc = run_script("benchmark_gguf_products.py", "--types", "Q4_1", "--rows", "1,16", "--rounds", "1",
                      "--output-json", str(out))
    check_ok(proc)
    result = json.loads(out.read_text())
    peaks = result["dot_product_peaks_macs_per_s"]
    assert "int8" in peaks and ("bfloat16" in peaks) == ({"avx512_bf16", "avx512bw"} <= cpu_flags())
    assert len(result["results"]) == 2 * 4  # two row counts of the four shapes
    for row in result["results"]:
        assert row["chosen"] in row["fraction_of_peak"] and {"int8", "gemm"} <= set(row["fraction_of_peak"])
        assert all(0 < f < 2 for f in row["fraction_of_peak"].values())


def test_recorded_workloads_are_one_full_run():
    """README_GAUDI_CHUNKED's table quotes benchmarks/results/workloads.json: it must hold one run
    of all five workloads at full size, on committed code, beside transformers and llama.cpp.
    (A quick run of a subset once replaced it without anyone noticing.)"""
    with open(os.path.join(BENCH, "results", "workloads.json")) as f:
        recorded = json.load(f)
    args = recorded["args"]
    assert args["workloads"].split(",") == ["A", "B", "C", "D", "E"], args["workloads"]
    assert args["backends"].split(",") == ["vllm", "hf", "llama.cpp"], args["backends"]
    assert args["scale"] == 1.0
    assert recorded["machine"]["git_dirty"] is False, "measured on uncommitted code"
    assert set(recorded["workloads"]) == {"vllm", "hf", "llama.cpp"}
    assert {"A_total_tokens_per_s", "B_ttft_s", "C_decode_tokens_per_s", "D_wall_s",
            "E"} <= set(recorded["workloads"]["vllm"])


# --------------------------------------------------------------------------- serving

SERVING_TINY = ["--num-prompts", "5", "--short-input-len", "8:24", "--long-input-len", "150:200",
                "--output-len-range", "3:6", "--max-num-batched-tokens", "64"]


def test_serving_compare_chunked(tiny_checkpoints, tmp_path):
    """Over HTTP: the script starts `vllm serve` with chunking on, then off, passing on the engine
    flags it does not know itself."""
    out = tmp_path / "serving.json"
    png = tmp_path / "serving.png"
    proc = run_script("benchmark_serving.py", "--model", tiny_checkpoints["llama"], *SERVING_TINY,
                      "--request-rate", "50", "--burstiness", "0.5", "--compare-chunked",
                      "--goodput", "ttft:60000", "tpot:60000", *ENGINE, "--max-step-latency-ms", "500",
                      "--output-json", str(out), "--plot", str(png))
    check_ok(proc)
    assert "Serving Benchmark Result (chunked)" in proc.stdout
    assert "Serving Benchmark Result (unchunked)" in proc.stdout
    assert re.search(r"^P99 ITL \(ms\):\s+[0-9.]+", proc.stdout, re.M)
    assert re.search(r"^Server overhead per request, E2EL \(ms\):\s+-?[0-9.]+", proc.stdout, re.M)
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"chunked", "unchunked"}
    for name, run in result["runs"].items():
        assert run["completed"] == 5 and run["failed"] == 0, (name, run["errors"])
        for metric in ("ttft", "tpot", "itl", "e2el"):
            for stat in ("mean", "median", "p99", "max"):
                assert run[f"{stat}_{metric}_ms"] >= 0
            assert run[f"max_{metric}_ms"] >= run[f"p99_{metric}_ms"]
        assert run["request_goodput:"] == run["request_goodput"] == pytest.approx(run["request_throughput"])
        assert sum(run["output_lens"]) == run["total_output_tokens"]
        # The server counted what the client sent and received (the warm-up request is not in it).
        server = run["server"]
        assert server["prompt_tokens"] == run["total_input_tokens"]
        assert server["generation_tokens"] == run["total_output_tokens"]
        assert server["engine_mean_e2el_ms"] <= run["mean_e2el_ms"] + 1.0
        assert all(len(times) == n for times, n in zip(run["token_times"], run["output_lens"]))
        assert result["workload"]["num_long"] == 1
    chunked, unchunked = result["runs"]["chunked"]["server"], result["runs"]["unchunked"]["server"]
    assert unchunked["prefill_chunks"] == 5 < chunked["prefill_chunks"]  # whole prompts vs chunks
    assert chunked["mean_prefill_chunk_tokens"] <= 64
    assert unchunked["mixed_steps"] == 0
    assert "--no-enable-chunked-prefill" in result["servers"]["unchunked"]["flags"]
    assert "--max-num-batched-tokens" not in result["servers"]["unchunked"]["flags"]
    # The latency target goes to the chunked server only (the unchunked one refuses it).
    assert "--max-step-latency-ms" in result["servers"]["chunked"]["flags"]
    assert "--max-step-latency-ms" not in result["servers"]["unchunked"]["flags"]
    assert "comparison" in result and {"p99_itl_ms", "max_itl_ms"} <= set(result["comparison"])
    assert result["comparison"]["max_itl_ms"]["chunked"] >= result["comparison"]["p99_itl_ms"]["chunked"]
    assert result["mean_ttft_ms"] == result["runs"]["chunked"]["mean_ttft_ms"]  # top level = first run
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.stat().st_size > 0
    else:
        assert "matplotlib is not installed" in proc.stdout
        assert not png.exists()


def test_serving_capacity_search_against_a_running_server(tiny_checkpoints, tmp_path):
    from tests.server_utils import ServerThread
    from vllm import AsyncLLMEngine, EngineArgs
    from vllm.entrypoints.openai.api_server import build_app

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(
        model=tiny_checkpoints["llama"], max_num_batched_tokens=64, enforce_eager=True, block_size=16,
        kv_cache_memory_bytes=32 * 1024**2))
    out = tmp_path / "capacity.json"
    with ServerThread(build_app(engine, ["tiny"])) as server:
        proc = run_script("benchmark_serving.py", "--base-url", server.url, "--tokenizer",
                          tiny_checkpoints["llama"], "--num-prompts", "5", "--dataset-name", "random",
                          "--random-input-len", "48", "--random-output-len", "4", "--random-range-ratio",
                          "0.5", "--max-concurrency", "2",
                          "--capacity-search", "--itl-slo-ms", "600000", "--ttft-slo-ms", "0.001",
                          "--probe-min-prompts", "5", "--probe-seconds", "0.05", "--start-rate", "10",
                          "--rate-steps", "3", "--min-rate", "1", "--max-rate", "100", "--output-json", str(out))
    check_ok(proc)
    result = json.loads(out.read_text())
    assert result["model_id"] == "tiny"  # asked from /v1/models
    search = result["capacity_search"]["servers"]["server"]
    assert result["capacity_search"]["rate_grid"] == [1, 10, 100]
    # No TTFT is under a microsecond: every probe misses, down to the lowest rate.
    assert search["capacity"] == {"600000": None}
    # From the start rate down to the lowest: 5 requests each (the minimum over 10 x 0.05 s).
    assert [p["request_rate"] for p in search["probes"]] == [1, 10]
    assert all(p["completed"] == 5 and p["meets_itl_targets_ms"] == [] for p in search["probes"])
    definition = result["capacity_search"]["probe_workload"]
    assert definition["dataset_name"] == "random" and definition["probe_seconds"] == 0.05
    assert definition["per_rate"]["10"]["num_prompts"] == 5 and result["capacity_search"]["start_rate"] == 10
    # Each probe sends prompts of its own: the prefix cache serves nothing from the one before
    # (random token ids; a chat template would share its first tokens).
    assert all(p["server"]["prefix_cache_hits"] == 0 for p in search["probes"])
    assert "below 1 req/s" in proc.stdout


def test_serving_capacity_latency_targets_against_fixed_budgets(tiny_checkpoints, tmp_path):
    """--compare-budgets starts a server per latency target and per fixed budget; the budget
    server is probed once per rate for both targets."""
    out = tmp_path / "capacity_targets.json"
    proc = run_script("benchmark_serving.py", "--model", tiny_checkpoints["llama"], "--num-prompts", "3",
                      "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "4",
                      "--endpoint", "/v1/chat/completions",
                      "--capacity-search", "--itl-slo-ms", "600000", "900000", "--compare-budgets", "32",
                      "--rate-steps", "2", "--min-rate", "1", "--max-rate", "100", "--start-rate", "100",
                      "--probe-seconds", "0.03", "--probe-min-prompts", "3", *ENGINE,
                      "--output-json", str(out))
    check_ok(proc)
    assert re.search(r"^Capacity search: 3 server\(s\), rates 1, 100 req/s from 100; .* estimated [0-9.]+ min",
                     proc.stdout, re.M)
    # Both meet the targets at the grid's top rate: lower bounds, nothing to compare.
    assert re.search(r"^\s*600000 ms \|\s+>=100.00 \|\s+>=100.00 \|\s+32 \|\s+n/a$", proc.stdout, re.M), proc.stdout
    result = json.loads(out.read_text())
    flags = {name: server["flags"] for name, server in result["servers"].items()}
    assert flags["target-600000ms"][-4:] == ["--max-num-batched-tokens", "32", "--max-step-latency-ms", "600000"]
    assert flags["budget-32"][-2:] == ["--max-num-batched-tokens", "32"]
    assert "--max-step-latency-ms" not in flags["budget-32"]
    searches = result["capacity_search"]["servers"]
    assert searches["budget-32"]["capacity"] == {"600000": 100, "900000": 100}
    assert len(searches["budget-32"]["probes"]) == 1  # one run at 100 req/s, judged against both
    assert all(p["completed"] == 3 for s in searches.values() for p in s["probes"])
    rows = result["capacity_by_target"]
    assert [r["latency_target_server"] for r in rows] == ["target-600000ms", "target-900000ms"]
    assert all(r["latency_target_capacity"] == r["best_fixed_capacity"] == 100 for r in rows)
    assert all(r["latency_target_ge_best_fixed"] is None and len(r["at_grid_top"]) == 2 for r in rows)


def test_serving_helpers():
    bs = load_module("benchmark_serving")
    # Arrivals: gamma gaps with mean 1 / rate; inf = all at once.
    gaps = bs.unit_intervals(20000, 1.0, seed=0)
    assert abs(sum(gaps) / len(gaps) - 1.0) < 0.05
    offsets = bs.arrival_offsets(gaps[:5], 2.0)
    assert offsets[0] == 0.0 and offsets[1] == pytest.approx(gaps[1] / 2.0)
    assert bs.arrival_offsets(gaps[:3], float("inf")) == [0.0, 0.0, 0.0]
    bursty = bs.unit_intervals(20000, 0.25, seed=0)
    assert abs(sum(bursty) / len(bursty) - 1.0) < 0.1
    # Goodput SLOs in vLLM's syntax.
    assert bs.parse_goodput(["ttft:500", "tpot:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    for bad in (["ttft"], ["itl:5"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            bs.parse_goodput(bad)
    # Metrics: two requests, known times.
    R = bs.RequestRecord
    a = R("a", 10, 3, "short", arrival=0.0, token_times=[0.5, 0.6, 0.8], finish=0.8)
    b = R("b", 20, 2, "long", arrival=1.0, token_times=[3.0, 3.5], finish=3.5)
    m = bs.compute_metrics([a, b], duration=4.0, slos={"ttft": 1000}, metric_percentiles=[99])
    assert m["completed"] == 2 and m["total_input_tokens"] == 30 and m["total_output_tokens"] == 5
    assert m["mean_ttft_ms"] == pytest.approx((500 + 2000) / 2)
    assert m["mean_tpot_ms"] == pytest.approx((150 + 500) / 2)
    assert m["median_itl_ms"] == pytest.approx(200)
    assert m["mean_e2el_ms"] == pytest.approx((800 + 2500) / 2)
    assert m["request_goodput"] == pytest.approx(1 / 4.0)  # only a meets TTFT <= 1 s
    assert m["request_throughput"] == pytest.approx(0.5)
    assert m["by_kind"]["long"]["mean_ttft_ms"] == pytest.approx(2000)
    # Capacity probes send fresh random prompts of the same lengths; dataset prompts stay.
    class Tokenizer:
        all_special_ids = [0]

        def __len__(self):
            return 100

        def decode(self, ids):
            return " ".join(map(str, ids))

    work = [{"prompt_token_ids": [5] * 30, "prompt_len": 30, "output_len": 3, "kind": "long"},
            {"prompt_token_ids": [7, 8], "prompt_len": 2, "output_len": 1, "kind": "dataset"}]
    # Capacity probes: rate x --probe-seconds requests, at least --probe-min-prompts, a quarter
    # of them long by default; each rate's prompts its own; cut short past the TTFT bound.
    parser = bs.make_parser()
    args = parser.parse_args(["--capacity-search", "--itl-slo-ms", "50"])
    bs.check_args(parser, args, [])
    assert (bs.probe_size(args, 0.25), bs.probe_size(args, 2.0)) == (16, 48) and args.long_fraction == 0.25
    grid, start = bs.capacity_grid(args)
    assert grid[0] == 0.25 and grid[-1] == 16 and grid[start] == 1.0 and len(grid) == 13
    lengths = {"short_input_len": (3, 5), "long_input_len": (20, 30), "output_len_range": (2, 4)}
    vars(args).update(lengths)
    probe, gaps = bs.probe_workload(args, Tokenizer(), start, 1.0, chat=False)
    assert len(probe) == len(gaps) == 24 and sum(w["kind"] == "long" for w in probe) == 6
    other, _ = bs.probe_workload(args, Tokenizer(), start + 1, 1.414, chat=False)
    assert other[0]["prompt_token_ids"] != probe[0]["prompt_token_ids"]
    assert bs.probe_timeout(args, [0.0, 20.0]) == 20.0 + 10.0 + bs.PROBE_DRAIN_S
    plain = parser.parse_args([])
    bs.check_args(parser, plain, [])
    assert plain.long_fraction == 0.1
    a, b = bs.fresh_prompts(work, Tokenizer(), 1, chat=True), bs.fresh_prompts(work, Tokenizer(), 2, chat=False)
    assert [len(w["prompt_token_ids"]) for w in a] == [30, 2] and a[1] is work[1]
    assert a[0]["prompt_token_ids"] != b[0]["prompt_token_ids"] != work[0]["prompt_token_ids"]
    assert a == bs.fresh_prompts(work, Tokenizer(), 1, chat=True) and 0 not in a[0]["prompt_token_ids"]
    assert a[0]["prompt_text"] == Tokenizer().decode(a[0]["prompt_token_ids"]) and "prompt_text" not in b[0]


def _fake_run(p99_itl_ms: float, ttft_ms: float, failed: int = 0) -> dict:
    """A run's metrics as compute_metrics gives them: 2% of the gaps at p99_itl_ms, the rest at
    half of it (so the P99 is not the median); every TTFT the same."""
    gaps = [p99_itl_ms / 2000] * 98 + [p99_itl_ms / 1000] * 2
    return {"itls": [gaps], "ttfts": [ttft_ms / 1000] * 10 + [None] * failed, "failed": failed,
            "request_throughput": 1.0}


def test_capacity_search_reuses_each_probe_for_every_target():
    sc = load_module("serving_capacity")
    grid = sc.rate_grid(0.5, 8.0, 9)  # 0.5, 0.71, 1, 1.41, 2, 2.83, 4, 5.66, 8
    assert grid[0] == 0.5 and grid[-1] == 8.0 and grid[4] == pytest.approx(2.0)
    calls = []

    def run_at(rate):
        calls.append(rate)
        return _fake_run(40.0 * rate, 500.0 * rate)  # P99 ITL 40 ms per req/s

    slos = [sc.Slo(t, ttft_ms=10000.0) for t in (50.0, 100.0, 200.0)]
    found = sc.search_server("budget-512", grid, slos, run_at)
    assert found["capacity"] == {"50": 1.0, "100": 2.0, "200": pytest.approx(4.0)}
    assert found["capacity_is_grid_top"] == {"50": False, "100": False, "200": False}
    # Upward, the rate doubles until the 50 ms target misses (0.5, 1, 2), then one bisection
    # (1.41); the looser targets go on from there: 8 runs, none repeated.
    assert calls[:4] == [0.5, 1.0, 2.0, 1.414]
    assert len(calls) == len(set(calls)) == 8 <= sc.max_probes(len(grid), 3)
    probe = {p["request_rate"]: p for p in found["probes"]}[2.0]
    assert probe["p99_itl_ms"] == pytest.approx(80.0) and probe["meets_itl_targets_ms"] == [100.0, 200.0]
    # The TTFT bound (P99, 10 s by default) binds first when the server queues: 3 s per req/s.
    found = sc.search_server("queueing", grid, slos, lambda r: _fake_run(40.0 * r, 3000.0 * r))
    assert found["capacity"] == {"50": 1.0, "100": 2.0, "200": pytest.approx(2.83, abs=0.01)}
    # A run with failed requests misses every target; nothing meeting a target is None.
    found = sc.search_server("failing", grid, slos, lambda r: _fake_run(1.0, 1.0, failed=1))
    assert found["capacity"] == {"50": None, "100": None, "200": None}
    # From a start in the middle the rate halves while the probes miss, then bisects.
    calls.clear()
    found = sc.search_server("slow", grid, slos[:1], lambda r: calls.append(r) or _fake_run(80.0 * r, 1.0), start=6)
    assert calls == [4.0, 2.0, 1.0, 0.5, 0.7071] and found["capacity"] == {"50": 0.5}
    assert len(calls) <= sc.max_probes(len(grid), 1, start=6)
    # A server that meets the target at the top rate has a capacity of at least that: flagged.
    found = sc.search_server("fast", grid, slos[:1], lambda r: _fake_run(1.0, 1.0), start=4)
    assert found["capacity"] == {"50": 8.0} and found["capacity_is_grid_top"] == {"50": True}
    assert [p["request_rate"] for p in found["probes"]] == [2.0, 4.0, 8.0]


def test_capacity_bracket_ignores_a_pass_above_a_miss():
    sc = load_module("serving_capacity")
    grid = sc.rate_grid(1.0, 8.0, 4)  # 1, 2, 4, 8
    slo = sc.Slo(100.0, 10000.0)
    noisy = [sc.Probe(1.0, 50, 0), sc.Probe(2.0, 150, 0), sc.Probe(4.0, 90, 0)]
    assert sc.capacity(grid, noisy, slo) == 1.0
    assert sc.next_rate(grid, noisy, slo) is None
    assert sc.next_rate(grid, [], slo) == 1.0 and sc.next_rate(grid, [], slo, start=2) == 4.0
    assert sc.next_rate(grid, [sc.Probe(1.0, 50, 0)], slo) == 4.0  # up two grid steps
    assert sc.next_rate(grid, [sc.Probe(4.0, 50, 0)], slo) == 8.0  # up to the grid's top
    assert sc.next_rate(grid, [sc.Probe(4.0, 150, 0)], slo) == 1.0  # down two
    assert sc.next_rate(grid, [sc.Probe(1.0, 50, 0), sc.Probe(4.0, 150, 0)], slo) == 2.0  # bisect
    with pytest.raises(ValueError):
        sc.rate_grid(2.0, 1.0, 4)


def test_capacity_compare_budgets_verdict_per_target():
    sc = load_module("serving_capacity")
    specs = sc.budget_servers(["--block-size", "16", "--max-num-batched-tokens", "99", "--enable-chunked-prefill",
                               "--max-step-latency-ms=7"], [50.0, 100.0, 200.0], [128, 512])
    flags = {s.name: s.flags for s in specs}
    assert list(flags) == ["target-50ms", "target-100ms", "target-200ms", "budget-128", "budget-512"]
    assert flags["target-50ms"] == ["--block-size", "16", "--enable-chunked-prefill",
                                    "--max-num-batched-tokens", "512", "--max-step-latency-ms", "50"]
    assert flags["budget-128"] == ["--block-size", "16", "--enable-chunked-prefill",
                                   "--max-num-batched-tokens", "128"]
    assert [s.itl_targets_ms for s in specs] == [[50.0], [100.0], [200.0]] + [[50.0, 100.0, 200.0]] * 2
    behaviour = {  # (P99 ITL, P99 TTFT) in ms at a rate
        "target-50ms": lambda r: (45.0, 2500.0 * r),   # capacity 4 (TTFT)
        "target-100ms": lambda r: (95.0, 1500.0 * r),  # 5.66
        "target-200ms": lambda r: (190.0, 1300.0 * r),  # 5.66
        "budget-128": lambda r: (30.0 * r, 2000.0 * r),  # 1.41, 2.83, 4 (TTFT)
        "budget-512": lambda r: (25.0 * r, 500.0 * r),  # 2, 4, 8
    }
    grid = sc.rate_grid(0.5, 8.0, 9)
    searches = {s.name: sc.search_server(s.name, grid, [sc.Slo(t, 10000.0) for t in s.itl_targets_ms],
                                         lambda r, f=behaviour[s.name]: _fake_run(*f(r)))
                for s in specs}
    rows = sc.compare(specs, searches)
    assert [(r["itl_slo_ms"], r["latency_target_server"], r["best_fixed_budget"]) for r in rows] == [
        (50.0, "target-50ms", 512), (100.0, "target-100ms", 512), (200.0, "target-200ms", 512)]
    assert [r["latency_target_capacity"] for r in rows] == pytest.approx([4.0, 5.66, 5.66], abs=0.01)
    assert [r["fixed_budget_capacity"][128] for r in rows] == pytest.approx([1.41, 2.83, 4.0], abs=0.01)
    assert [r["best_fixed_capacity"] for r in rows] == pytest.approx([2.0, 4.0, 8.0])
    assert [r["latency_target_ge_best_fixed"] for r in rows] == [True, True, False]
    table = sc.format_table(rows, 0.5)
    assert "budget 512" in table and table.count(" yes") == 2 and table.count(" NO") == 1
    assert rows[2]["at_grid_top"] == ["budget-512"] and "|     >=8.00 |" in table  # a lower bound
    # Start-up plus probes of 10 s: up from 0.5 to 4 req/s (4 probes), then one bisection per
    # target (1 per target server, 3 per budget one); at most 8 and 9.
    assert sc.estimate_seconds(specs, grid, lambda r: 10.0) == (3 * (60 + 10 * 5) + 2 * (60 + 10 * 7),
                                                                3 * (60 + 10 * 8) + 2 * (60 + 10 * 9))
    # No server meets a target at any rate: nothing to compare.
    none = {name: {"capacity": {"50": None}} for name in ("target-50ms", "budget-128")}
    row, = sc.compare(sc.budget_servers([], [50.0], [128]), none)
    assert row["latency_target_ge_best_fixed"] is None and row["best_fixed_budget"] is None
    assert "n/a" in sc.format_table([row], 0.5)
