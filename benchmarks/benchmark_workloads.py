"""The five workloads of the performance goals, this engine beside transformers, in one run.

    A  16 prompts x 256 tokens, 64 outputs each          total tokens/s (hf: one batch of 16)
    B  one 2048-token prompt                               time to first token
    C  batch-1 decode (16-token prompt, 128 outputs)       decode tokens/s
    D  4 x 2000-token + 16 x 32-token prompts, 64 outputs  wall time (hf: one request at a time)
    E  8 streams decoding 64 tokens; after their 8th token two 2000-token prompts (64 outputs)
       arrive. Inter-token gaps of the 8 streams (P99 and max) and total tokens/s, chunked
       (budget 256) against unchunked (whole prompts in one step), each the mean of two runs
       in the order chunked, unchunked, unchunked, chunked; engine only.

Prompts are random token ids, outputs greedy with exactly the requested length (ignore_eos).
A, B and D report their dense FLOPs (2 x body parameters per token the body runs on: every
prompt token and every output token but the last; attention left out) as a fraction of the bf16
matmul peak, and C decode as a fraction of memory bandwidth (every weight read once per step),
both ceilings measured in the same run: the matmul peak at its start, the bandwidth right before
and after each of C's runs (the higher of the two is that run's bound; the best run's fraction is
quoted). For this engine C also gives that run's share of the decode time spent in the model
(LLMEngine.stats.model_forward_seconds) and the model's own rate as a fraction of the bound: the
rest of each step is the host's; D gives the count, seconds and tokens of its prefill-only,
decode-only and mixed steps (D_steps). `--scale` shrinks every length (for smoke tests). transformers
runs in the engine's dtype unless `--hf-dtype` names another: on a CPU without bf16 dot products
its float32 is faster than its bf16, and the fair baseline is its faster one.

    python benchmarks/benchmark_workloads.py --output-json benchmarks/results/workloads.json
"""

import argparse
import copy
import functools
import random
import statistics
import time

import result_files
import engine_setup
import roofline
import step_stats

REPEATS = 3  # B and C: best of
C_BOUND_SECONDS = 0.05  # per method, each bandwidth measurement beside a C run (best of 3 or more reads)


def _prompts(rng: random.Random, lengths: list[int], vocab: int) -> list[list[int]]:
    return [[rng.randrange(1000, vocab) for _ in range(n)] for n in lengths]


def _size(n: int, scale: float) -> int:
    return max(1, round(n * scale))


class Engine:
    """The workloads on this engine: `vllm.LLM` and its `LLMEngine` step loop. Each timed run
    starts from an empty prefix cache, so it computes every prompt (a repeat, or a prompt of the
    warm-up, would otherwise find its blocks cached)."""

    def __init__(self, args: argparse.Namespace, **overrides) -> None:
        self.llm, self.init_seconds = engine_setup.build_llm(args, **overrides)
        self.engine = self.llm.llm_engine

    def decode_weight_bytes(self) -> int:
        """Bytes of the weights a decode step reads, as loaded (GGUF blocks at their own size)."""
        weight_bytes = engine_setup.decode_weight_bytes(self.llm)
        assert weight_bytes is not None, "the workloads run the model in this process"
        return weight_bytes

    def generate(self, prompts: list[list[int]], output_len: int) -> float:
        from vllm import SamplingParams
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        assert self.llm.reset_prefix_cache()
        start = time.perf_counter()
        self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start

    def generate_steps(self, prompts: list[list[int]], output_len: int) -> tuple[float, dict]:
        """`generate` through the engine's step loop: the wall time, and the count, seconds and
        tokens of its prefill-only, decode-only and mixed steps (step_stats.StepRecorder)."""
        from vllm import SamplingParams
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        assert self.llm.reset_prefix_cache()
        recorder = step_stats.StepRecorder(self.engine)
        start = time.perf_counter()
        recorder.generate([{"prompt_token_ids": p} for p in prompts], [params] * len(prompts))
        return time.perf_counter() - start, recorder.composition()

    def token_times(self, prompt: list[int], output_len: int, forward: list[float] | None = None) -> list[float]:
        """Runs one request alone; the time each of its tokens arrived (first = TTFT), and into
        `forward` (if given) the engine's seconds in the model so far at each."""
        from vllm import SamplingParams
        assert self.llm.reset_prefix_cache()
        start = time.perf_counter()
        self.engine.add_request("single", {"prompt_token_ids": prompt},
                                SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
        times = []
        while self.engine.has_unfinished_requests():
            if self.engine.step():
                times.append(time.perf_counter() - start)
                if forward is not None:
                    forward.append(self.engine.stats.model_forward_seconds)
        return times

    def arrivals(self, streams: list[list[int]], stream_len: int, late: list[list[int]],
                 late_len: int, after_tokens: int) -> dict:
        """Workload E: `late` prompts arrive once every stream has `after_tokens` tokens."""
        from vllm import SamplingParams
        engine = self.engine
        assert self.llm.reset_prefix_cache()
        for i, p in enumerate(streams):
            engine.add_request(f"s{i}", {"prompt_token_ids": p},
                               SamplingParams(temperature=0, max_tokens=stream_len, ignore_eos=True))
        times: dict[str, list[float]] = {f"s{i}": [] for i in range(len(streams))}
        added = False
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id in times:
                    times[out.request_id].append(time.perf_counter() - start)
            if not added and all(len(t) >= after_tokens for t in times.values()):
                for i, p in enumerate(late):
                    engine.add_request(f"late{i}", {"prompt_token_ids": p},
                                       SamplingParams(temperature=0, max_tokens=late_len, ignore_eos=True))
                added = True
        wall = time.perf_counter() - start
        gaps = sorted(b - a for t in times.values() for a, b in zip(t, t[1:]))
        tokens = sum(map(len, streams + late)) + len(streams) * stream_len + len(late) * late_len
        return {"p99_gap_s": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], "max_gap_s": gaps[-1],
                "median_gap_s": statistics.median(gaps), "wall_s": wall, "total_tokens_per_s": tokens / wall}


class HF:
    """The same workloads on transformers' `generate` (greedy, KV cache, no padding)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from transformers import AutoModelForCausalLM
        directory, kwargs = engine_setup.hf_model_kwargs(engine_setup.resolve_model_path(args.model))
        dtype = getattr(torch, args.hf_dtype or engine_setup.resolve_dtype_name(args))
        self.model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True,
                                                          **kwargs).eval()
        self.dtype = str(self.model.dtype).removeprefix("torch.")

    def generate(self, prompts: list[list[int]], output_len: int) -> float:
        """One `generate` call for the batch; all prompts must have one length (no padding)."""
        import torch
        assert len({len(p) for p in prompts}) == 1
        ids = torch.tensor(prompts)
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=output_len, min_new_tokens=output_len)
        return time.perf_counter() - start


class LlamaCpp:
    """The same workloads on llama.cpp (the GGUF's own quantized weights), through the
    continuous-batching loop of `benchmark_throughput.py --backend llama.cpp`; each call loads
    the model and warms up outside the timed part."""

    def __init__(self, args: argparse.Namespace) -> None:
        import benchmark_throughput
        self._run = benchmark_throughput.run_llama_cpp
        self.args = copy.copy(args)
        self.args.llama_cpp_verbose = False

    def generate(self, prompts: list[list[int]], output_len: int) -> float:
        requests = [{"prompt_token_ids": p, "prompt_len": len(p), "output_len": output_len}
                    for p in prompts]
        return self._run(requests, self.args)["elapsed"]


BACKENDS = {"vllm": Engine, "hf": HF, "llama.cpp": LlamaCpp}


def run(args: argparse.Namespace) -> dict:
    import torch
    engine_setup.apply_threads(args)
    s = args.scale
    rng = random.Random(args.seed)
    tokenizer = engine_setup.load_hf_tokenizer(args.model, args.tokenizer)
    vocab = len(tokenizer)
    want = set(args.workloads.split(","))
    result: dict = {"workloads": {}, "definitions": __doc__.split("\n\n")[1]}
    w = result["workloads"]

    dtype_name = engine_setup.resolve_dtype_name(args)
    result["dtypes"] = {}
    result["machine_roofline"] = roofline.measure_machine_roofline(dtype_name, args.roofline_seconds)
    params = roofline.model_param_counts(engine_setup.resolve_model_path(args.model))
    bytes_per_param = torch.finfo(getattr(torch, dtype_name)).bits // 8

    a_prompts = _prompts(rng, [_size(256, s)] * 16, vocab)
    b_prompt = _prompts(rng, [_size(2048, s)], vocab)[0]
    c_prompt = _prompts(rng, [_size(16, s)], vocab)[0]
    d_prompts = _prompts(rng, [_size(2000, s)] * 4 + [_size(32, s)] * 16, vocab)
    out_a, out_c = _size(64, s), max(2, _size(128, s))

    backends = args.backends.split(",")
    for backend in backends:
        result_files.log(f"{backend}: loading")
        runner = BACKENDS[backend](args)
        if backend in ("vllm", "hf"):  # llama.cpp computes in the GGUF's own types
            result["dtypes"][backend] = dtype_name if backend == "vllm" else runner.dtype
        runner.generate(a_prompts[:2], 4)  # warm-up
        res = w.setdefault(backend, {})
        # llama.cpp's quantized weights have another roofline
        of_matmul_peak = None if backend == "llama.cpp" else functools.partial(
            _fraction_of_matmul_peak, params["matmul_body"], result["machine_roofline"]["matmul"]["flops_per_s"])
        if "A" in want:
            elapsed = runner.generate(a_prompts, out_a)
            res["A_total_tokens_per_s"] = 16 * (len(a_prompts[0]) + out_a) / elapsed
            if of_matmul_peak:
                res["A_fraction_of_matmul_peak"] = of_matmul_peak(a_prompts, out_a, elapsed)
        if "B" in want:
            if backend == "vllm":
                ttft = min(runner.token_times(b_prompt, 1)[0] for _ in range(REPEATS))
            else:
                ttft = min(runner.generate([b_prompt], 1) for _ in range(REPEATS))
            res["B_ttft_s"] = ttft
            if of_matmul_peak:
                res["B_fraction_of_matmul_peak"] = of_matmul_peak([b_prompt], 1, ttft)
        if "C" in want:
            # A shared machine's bandwidth moves within minutes: each run's bound is measured
            # right before and after it (the higher of the two).
            rates, shares, bounds = [], [], []
            for _ in range(REPEATS):
                before = roofline.measure_memory_bandwidth(min_seconds=C_BOUND_SECONDS)["bytes_per_s"]
                rate, share = _decode_rate(runner, backend, c_prompt, out_c)
                rates.append(rate)
                shares.append(share)
                after = roofline.measure_memory_bandwidth(min_seconds=C_BOUND_SECONDS)["bytes_per_s"]
                bounds.append(max(before, after))
            res["C_decode_tokens_per_s"] = max(rates)
            if backend != "llama.cpp":
                weight_bytes = params["total"] * bytes_per_param  # a tied LM head counts once
                if backend == "vllm":  # as loaded: GGUF blocks at their own bytes
                    weight_bytes = runner.decode_weight_bytes()
                res["C_memory_bounds_bytes_per_s"] = bounds
                fractions = [weight_bytes * r / b for r, b in zip(rates, bounds)]
                best = max(range(REPEATS), key=fractions.__getitem__)
                res["C_fraction_of_memory_bandwidth"] = fractions[best]
                if backend == "vllm":
                    # The best run's time in the model, and the model's own rate against the bound:
                    # what the step loses beside the kernels is the host's (scheduling, inputs,
                    # sampling, outputs).
                    res["C_model_share_of_decode_time"] = shares[best]
                    res["C_model_fraction_of_memory_bandwidth"] = fractions[best] / shares[best]
        if "D" in want:
            if backend == "vllm":  # and where its time went: steps with prefill chunks, or only decodes
                res["D_wall_s"], res["D_steps"] = runner.generate_steps(d_prompts, out_a)
            elif backend == "hf":  # one at a time: its best strategy (batches pad to 2000 tokens)
                res["D_wall_s"] = sum(runner.generate([p], out_a) for p in d_prompts)
            else:
                res["D_wall_s"] = runner.generate(d_prompts, out_a)
            if of_matmul_peak:
                res["D_fraction_of_matmul_peak"] = of_matmul_peak(d_prompts, out_a, res["D_wall_s"])
        del runner

    if "E" in want and "vllm" in backends:
        streams = _prompts(rng, [_size(32, s)] * 8, vocab)
        late = _prompts(rng, [_size(2000, s)] * 2, vocab)
        engines = {"chunked": Engine(args, enable_chunked_prefill=True, max_num_batched_tokens=256),
                   "unchunked": Engine(args, enable_chunked_prefill=False, max_num_batched_tokens=None)}
        for engine in engines.values():
            engine.generate(a_prompts[:2], 4)  # warm-up
        # Two runs each, in the order A B B A: the two means see the same share of a drift in the
        # shared machine's speed during the four, where one run each would charge it to one.
        runs: dict[str, list[dict]] = {name: [] for name in engines}
        for name in ("chunked", "unchunked", "unchunked", "chunked"):
            # At least a few tokens per stream, so that there are gaps to measure at any scale.
            runs[name].append(engines[name].arrivals(streams, max(4, _size(64, s)), late, _size(64, s),
                                                     after_tokens=max(2, _size(8, s))))
        del engines
        e = {name: {**{key: statistics.mean(run[key] for run in results) for key in results[0]}, "runs": results}
             for name, results in runs.items()}
        e["p99_gap_ratio_chunked_over_unchunked"] = e["chunked"]["p99_gap_s"] / e["unchunked"]["p99_gap_s"]
        e["throughput_ratio_chunked_over_unchunked"] = (e["chunked"]["total_tokens_per_s"]
                                                       / e["unchunked"]["total_tokens_per_s"])
        w["vllm"]["E"] = e

    ratios = {}
    for other in ("hf", "llama.cpp"):
        if "vllm" not in w or other not in w:
            continue
        ours, ref = w["vllm"], w[other]
        if "A" in want:
            ratios[f"A_throughput_vs_{other}"] = ours["A_total_tokens_per_s"] / ref["A_total_tokens_per_s"]
        if "B" in want:
            ratios[f"B_ttft_{other}_over_ours"] = ref["B_ttft_s"] / ours["B_ttft_s"]
        if "C" in want:
            ratios[f"C_decode_vs_{other}"] = ours["C_decode_tokens_per_s"] / ref["C_decode_tokens_per_s"]
        if "D" in want:
            ratios[f"D_wall_ours_over_{other}"] = ours["D_wall_s"] / ref["D_wall_s"]
    result["ratios"] = ratios
    result["machine"] = result_files.machine_info()
    result["args"] = result_files.args_dict(args)
    return result


def _fraction_of_matmul_peak(body_params: int, peak_flops_per_s: float, prompts: list[list[int]], output_len: int,
                             seconds: float) -> float:
    """The dense FLOPs of generating `output_len` tokens for each prompt (the body runs on every
    prompt token and on every output token but the last) per second, over the matmul peak."""
    tokens = sum(len(p) + output_len - 1 for p in prompts)
    return 2.0 * body_params * tokens / seconds / peak_flops_per_s


def _decode_rate(runner, backend: str, prompt: list[int], out: int) -> tuple[float, float | None]:
    """Batch-1 decode tokens/s of one run, and (this engine) the share of its time in the model."""
    if backend == "vllm":
        forward: list[float] = []
        t = runner.token_times(prompt, out, forward)
        return (len(t) - 1) / (t[-1] - t[0]), (forward[-1] - forward[0]) / (t[-1] - t[0])
    # decode time = full generate minus a prefill-only generate
    return (out - 1) / (runner.generate([prompt], out) - runner.generate([prompt], 1)), None


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="A,B,C,D,E", help="comma-separated subset of A,B,C,D,E")
    parser.add_argument("--backends", default="vllm,hf",
                        help="comma-separated: vllm, hf, llama.cpp (needs llama-cpp-python)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every length (smoke tests)")
    parser.add_argument("--hf-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="transformers' dtype (default: the engine's)")
    parser.add_argument("--output-json", default=None, help="write the results here (without it, only print them)")
    roofline.add_roofline_args(parser)
    engine_setup.add_engine_args(parser)
    return parser


def main() -> None:
    parser = make_parser()
    args = parser.parse_args()
    unknown = set(args.workloads.split(",")) - set("ABCDE")
    if unknown:
        parser.error(f"unknown workloads {sorted(unknown)}; choose from A,B,C,D,E")
    if set(args.backends.split(",")) - set(BACKENDS):
        parser.error(f"--backends takes a subset of {sorted(BACKENDS)}")
    result = run(args)
    for backend, values in result["workloads"].items():
        print(f"{backend}: " + ", ".join(f"{k}={v:.4g}" for k, v in values.items() if isinstance(v, float)))
        if "E" in values:
            e = values["E"]
            print(f"E: P99 gap chunked {e['chunked']['p99_gap_s'] * 1e3:.0f} ms vs unchunked "
                  f"{e['unchunked']['p99_gap_s'] * 1e3:.0f} ms "
                  f"(ratio {e['p99_gap_ratio_chunked_over_unchunked']:.2f}), "
                  f"throughput ratio {e['throughput_ratio_chunked_over_unchunked']:.2f}")
        if "D_steps" in values:
            print("D steps: " + ", ".join(f"{kind} {k['steps']} ({k['seconds']:.2f} s)"
                                          for kind, k in values["D_steps"].items()))
    for k, v in result.get("ratios", {}).items():
        print(f"{k}: {v:.2f}")
    if args.output_json:  # only when asked: a run of a subset must not replace the recorded file
        print(f"Results written to {result_files.write_json(result, args.output_json)}")


if __name__ == "__main__":
    main()
