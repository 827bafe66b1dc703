"""Offline throughput: how fast a fixed set of requests is processed, vLLM's benchmark shape.

Backends:
  vllm       this engine through `LLM.generate` with `{"prompt_token_ids": ...}` prompts. The
             clock runs after the engine is built and after one small warm-up generate.
  hf         transformers `generate` in batches of --hf-max-batch-size (left padding with an
             attention mask, greedy, min_new_tokens = max_new_tokens = the batch's output length).
  llama.cpp  llama-cpp-python's low-level batch API (optional, not in the test requirements):
             continuous batching of up to --max-num-seqs sequences, --max-num-batched-tokens per
             llama_decode, greedy. Needs a .gguf model (the default one is). Extra buffer types
             (the AMX/repack path, which crashes on this CPU) are turned off.

Workload:
  synthetic (default)  --num-prompts prompts of exactly --input-len random token ids (special
                       tokens excluded, seeded by --seed), each generating exactly --output-len
                       tokens (ignore_eos).
  --dataset FILE       JSON (a list) or JSON Lines (one record per line) of records
                           {"prompt": "some text", "output_len": 128}
                           {"prompt_token_ids": [1, 2, 3], "output_len": 64}
                       (ShareGPT records with "conversations" also work: first turn = prompt,
                       token count of the second turn = output length). The first --num-prompts
                       records are used in file order; --output-len overrides every output_len.
                       Outputs still have exactly output_len tokens (ignore_eos).

Output: vLLM's line
    Throughput: X requests/s, Y total tokens/s, Z output tokens/s
and, with --output-json PATH (or --save-result: benchmarks/results/<name>.json), vLLM's keys
elapsed_time, num_requests, total_num_tokens, requests_per_second, tokens_per_second plus
output_tokens_per_second, backend, args, machine, engine step statistics and (vllm backend)
a roofline section: prefill as a fraction of the measured bf16 matmul peak and decode as a
fraction of the measured memory bandwidth (see roofline.py).

Examples:
    python benchmarks/benchmark_throughput.py --input-len 128 --output-len 128 --num-prompts 64
    python benchmarks/benchmark_throughput.py --backend hf --hf-max-batch-size 16 \\
        --input-len 128 --output-len 128 --num-prompts 64
    python benchmarks/benchmark_throughput.py --dataset prompts.jsonl --num-prompts 100 \\
        --no-enable-chunked-prefill --output-json /tmp/unchunked.json
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import result_files  # noqa: E402
import engine_setup  # noqa: E402
import workload_prompts  # noqa: E402
import roofline  # noqa: E402
import step_stats  # noqa: E402

WARMUP_PROMPTS = 2
WARMUP_PROMPT_LEN = 16
WARMUP_OUTPUT_LEN = 4


# --------------------------------------------------------------------------- workload

def make_requests(args: argparse.Namespace, tokenizer) -> list[dict]:
    if args.dataset is not None:
        return workload_prompts.load_dataset(args.dataset, tokenizer, args.num_prompts, args.output_len)
    vocab, special = workload_prompts.tokenizer_vocab(tokenizer)
    rng = random.Random(args.seed)
    return [{"prompt_token_ids": workload_prompts.random_token_ids(rng, args.input_len, vocab, special),
             "prompt_len": args.input_len, "output_len": args.output_len}
            for _ in range(args.num_prompts)]


# --------------------------------------------------------------------------- backends

def run_vllm(requests: list[dict], args: argparse.Namespace) -> dict:
    from vllm import SamplingParams

    llm, init_s = engine_setup.build_llm(args)
    engine = llm.llm_engine

    warm = [{"prompt_token_ids": r["prompt_token_ids"][:WARMUP_PROMPT_LEN]}
            for r in requests[:WARMUP_PROMPTS]]
    t0 = time.perf_counter()
    llm.generate(warm, SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True,
                                      max_tokens=WARMUP_OUTPUT_LEN), use_tqdm=False)
    warmup_s = time.perf_counter() - t0

    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [SamplingParams(n=1, temperature=1.0, top_p=1.0, ignore_eos=True,
                             max_tokens=r["output_len"]) for r in requests]
    before = step_stats.stats_snapshot(engine)
    recorder = step_stats.StepRecorder(engine)
    start = time.perf_counter()
    outputs = recorder.generate(prompts, params)
    elapsed = time.perf_counter() - start
    stats = step_stats.stats_diff(before, step_stats.stats_snapshot(engine))

    errors = [o.error for o in outputs if getattr(o, "error", None)]
    extra = {
        "engine_init_seconds": init_s,
        "warmup_seconds": warmup_s,
        "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "num_errors": len(errors),
        "errors": errors[:10],
        "engine_stats": stats,
        "step_composition": recorder.composition(),
        "dtype": engine_setup.engine_dtype_name(llm, args),
    }
    if not args.no_roofline:
        extra["roofline"] = roofline.compute_roofline(
            args.model, extra["dtype"], recorder.records,
            fallback={"elapsed": elapsed, "prefill_tokens": stats["num_prefill_tokens"],
                      "decode_tokens": stats["num_decode_tokens"], "num_steps": stats["num_steps"]},
            weight_bytes=engine_setup.decode_weight_bytes(llm), min_seconds=args.roofline_seconds)
    return {"elapsed": elapsed, "extra": extra}


def run_hf(requests: list[dict], args: argparse.Namespace, tokenizer) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    dtype_name = engine_setup.resolve_dtype_name(args)
    directory, kwargs = engine_setup.hf_model_kwargs(engine_setup.resolve_model_path(args.model))
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype_name),
                                                 local_files_only=True, **kwargs).eval()
    init_s = time.perf_counter() - t0

    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = (eos[0] if isinstance(eos, (list, tuple)) else eos) or 0

    def generate(batch: list[dict]) -> int:
        width = max(r["prompt_len"] for r in batch)
        out_len = max(r["output_len"] for r in batch)
        ids = torch.tensor([[pad] * (width - r["prompt_len"]) + r["prompt_token_ids"] for r in batch])
        mask = torch.tensor([[0] * (width - r["prompt_len"]) + [1] * r["prompt_len"] for r in batch])
        config = GenerationConfig(do_sample=False, max_new_tokens=out_len, min_new_tokens=out_len,
                                  pad_token_id=pad, eos_token_id=eos, use_cache=True)
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)  # as vLLM's hf backend
        return int(out[:, width:].numel())

    batches = [requests[i:i + args.hf_max_batch_size]
               for i in range(0, len(requests), args.hf_max_batch_size)]
    with torch.inference_mode():
        t0 = time.perf_counter()
        warm = [{"prompt_token_ids": r["prompt_token_ids"][:WARMUP_PROMPT_LEN],
                 "prompt_len": min(r["prompt_len"], WARMUP_PROMPT_LEN),
                 "output_len": WARMUP_OUTPUT_LEN} for r in requests[:WARMUP_PROMPTS]]
        generate(warm)
        warmup_s = time.perf_counter() - t0

        generated = 0
        start = time.perf_counter()
        for i, batch in enumerate(batches):
            generated += generate(batch)
            if not args.disable_tqdm:
                result_files.log(f"hf: batch {i + 1}/{len(batches)} done, "
                           f"{time.perf_counter() - start:.1f} s")
        elapsed = time.perf_counter() - start
    return {"elapsed": elapsed, "extra": {"engine_init_seconds": init_s, "warmup_seconds": warmup_s,
                                          "generated_tokens": generated, "dtype": dtype_name,
                                          "num_batches": len(batches)}}


def _llama_fn(lc, *names):
    for name in names:
        fn = getattr(lc, name, None)
        if fn is not None:
            return fn
    raise RuntimeError(f"llama_cpp has none of {names}; this llama-cpp-python version is not supported")


def run_llama_cpp(requests: list[dict], args: argparse.Namespace) -> dict:
    try:
        import llama_cpp as lc
    except ImportError as e:
        raise SystemExit(
            "--backend llama.cpp needs the optional llama-cpp-python package, which could not be "
            f"imported ({e}). Install it with e.g. CMAKE_ARGS='-DGGML_NATIVE=ON' pip install "
            "llama-cpp-python (it compiles llama.cpp; not part of the test requirements).") from None
    import numpy as np

    path = engine_setup.resolve_model_path(args.model)
    if not (os.path.isfile(path) and path.endswith(".gguf")):
        raise SystemExit(f"--backend llama.cpp needs a .gguf model file, got {path}")
    n_seq = max(1, min(len(requests), args.max_num_seqs or 64, 64))
    budget = args.max_num_batched_tokens or 512
    max_len = max(r["prompt_len"] + r["output_len"] for r in requests)
    threads = args.threads or os.cpu_count() or 1

    quiet = None
    if not args.llama_cpp_verbose and hasattr(lc, "llama_log_set") and hasattr(lc, "llama_log_callback"):
        quiet = lc.llama_log_callback(lambda level, text, user_data: None)  # keep a reference
        lc.llama_log_set(quiet, None)

    t0 = time.perf_counter()
    try:
        lc.llama_backend_init()
    except TypeError:  # old versions took a numa flag
        lc.llama_backend_init(False)
    mparams = lc.llama_model_default_params()
    mparams.n_gpu_layers = 0
    if hasattr(mparams, "use_extra_bufts"):
        # Extra buffer types = weight repacking, including the AMX path that segfaults here.
        mparams.use_extra_bufts = False
    model = _llama_fn(lc, "llama_model_load_from_file", "llama_load_model_from_file")(
        path.encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    cparams = lc.llama_context_default_params()
    cparams.n_ctx = n_seq * max_len + 256
    cparams.n_batch = budget
    cparams.n_ubatch = budget
    cparams.n_seq_max = n_seq
    cparams.n_threads = threads
    cparams.n_threads_batch = threads
    ctx = _llama_fn(lc, "llama_init_from_model", "llama_new_context_with_model")(model, cparams)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    if hasattr(lc, "llama_model_get_vocab") and hasattr(lc, "llama_vocab_n_tokens"):
        n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    else:
        n_vocab = lc.llama_n_vocab(model)
    if hasattr(lc, "llama_get_memory") and hasattr(lc, "llama_memory_seq_rm"):
        memory = lc.llama_get_memory(ctx)

        def seq_rm(seq_id: int) -> None:
            lc.llama_memory_seq_rm(memory, seq_id, -1, -1)
    else:
        rm = _llama_fn(lc, "llama_kv_self_seq_rm", "llama_kv_cache_seq_rm")

        def seq_rm(seq_id: int) -> None:
            rm(ctx, seq_id, -1, -1)
    batch = lc.llama_batch_init(budget, 0, 1)
    init_s = time.perf_counter() - t0

    def add(i: int, token: int, pos: int, seq_id: int, logits: bool) -> None:
        batch.token[i] = token
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq_id
        batch.logits[i] = 1 if logits else 0

    def greedy(row: int) -> int:
        return int(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, row), shape=(n_vocab,)).argmax())

    def run(reqs: list[dict]) -> dict:
        """Continuous batching: decodes first, then prefill chunks up to the token budget."""
        waiting = list(range(len(reqs)))[::-1]
        free = list(range(n_seq))[::-1]
        active: list[dict] = []
        steps = generated = 0
        while waiting or active:
            while waiting and free:
                active.append({"req": reqs[waiting.pop()], "seq": free.pop(), "pos": 0, "out": 0,
                               "last": None})
            n = 0
            rows: list[tuple[dict, int]] = []
            for s in active:
                if s["last"] is not None and n < budget:
                    add(n, s["last"], s["pos"], s["seq"], True)
                    s["pos"] += 1
                    rows.append((s, n))
                    n += 1
            for s in active:
                plen = s["req"]["prompt_len"]
                if s["last"] is not None or n >= budget:
                    continue
                take = min(budget - n, plen - s["pos"])
                ids = s["req"]["prompt_token_ids"]
                for j in range(s["pos"], s["pos"] + take):
                    add(n, ids[j], j, s["seq"], j == plen - 1)
                    n += 1
                s["pos"] += take
                if s["pos"] == plen:
                    rows.append((s, n - 1))
            batch.n_tokens = n
            rc = lc.llama_decode(ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} (KV cache full?)")
            steps += 1
            for s, row in rows:
                s["last"] = greedy(row)
                s["req"].setdefault("generated", []).append(s["last"])
                s["out"] += 1
                generated += 1
                if s["out"] >= s["req"]["output_len"]:
                    seq_rm(s["seq"])
                    free.append(s["seq"])
            active = [s for s in active if s["out"] < s["req"]["output_len"]]
        return {"steps": steps, "generated": generated}

    try:
        t0 = time.perf_counter()
        run([{"prompt_token_ids": r["prompt_token_ids"][:WARMUP_PROMPT_LEN],
              "prompt_len": min(r["prompt_len"], WARMUP_PROMPT_LEN), "output_len": WARMUP_OUTPUT_LEN}
             for r in requests[:WARMUP_PROMPTS]])
        warmup_s = time.perf_counter() - t0
        start = time.perf_counter()
        counts = run(requests)
        elapsed = time.perf_counter() - start
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        _llama_fn(lc, "llama_model_free", "llama_free_model")(model)
    return {"elapsed": elapsed, "extra": {
        "engine_init_seconds": init_s, "warmup_seconds": warmup_s,
        "generated_tokens": counts["generated"], "llama_cpp_steps": counts["steps"],
        "llama_cpp_version": getattr(lc, "__version__", None), "n_seq_max": n_seq,
        "n_batch": budget, "n_threads": threads,
        "note": "llama.cpp runs the GGUF's own quantized weights (no dequantization)"}}


# --------------------------------------------------------------------------- main

def result_name(args: argparse.Namespace) -> str:
    mode = "chunked" if args.enable_chunked_prefill else "unchunked"
    work = (f"in{args.input_len}-out{args.output_len}" if args.dataset is None
            else os.path.splitext(os.path.basename(args.dataset))[0])
    backend = args.backend.replace(".", "")
    return f"throughput-{backend}{'-' + mode if args.backend == 'vllm' else ''}-{work}-n{args.num_prompts}"


def main(args: argparse.Namespace) -> dict:
    print(args)
    engine_setup.apply_threads(args)
    random.seed(args.seed)

    tokenizer = engine_setup.load_hf_tokenizer(args.model, args.tokenizer)
    requests = make_requests(args, tokenizer)

    if args.backend == "vllm":
        run = run_vllm(requests, args)
    elif args.backend == "hf":
        run = run_hf(requests, args, tokenizer)
    elif args.backend == "llama.cpp":
        run = run_llama_cpp(requests, args)
    else:
        raise ValueError(f"unknown backend {args.backend}")

    elapsed = run["elapsed"]
    total_num_tokens = sum(r["prompt_len"] + r["output_len"] for r in requests)
    total_output_tokens = sum(r["output_len"] for r in requests)
    print(f"Throughput: {len(requests) / elapsed:.2f} requests/s, "
          f"{total_num_tokens / elapsed:.2f} total tokens/s, "
          f"{total_output_tokens / elapsed:.2f} output tokens/s")
    extra = run["extra"]
    roofline.print_roofline(extra.get("roofline"))

    results = {
        "elapsed_time": elapsed,
        "num_requests": len(requests),
        "total_num_tokens": total_num_tokens,
        "requests_per_second": len(requests) / elapsed,
        "tokens_per_second": total_num_tokens / elapsed,
        "total_output_tokens": total_output_tokens,
        "output_tokens_per_second": total_output_tokens / elapsed,
        "total_input_tokens": total_num_tokens - total_output_tokens,
        "backend": args.backend,
        "model": engine_setup.resolve_model_path(args.model),
        "enable_chunked_prefill": args.enable_chunked_prefill if args.backend == "vllm" else None,
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "args": result_files.args_dict(args),
        "machine": result_files.machine_info(),
        **extra,
    }
    result_files.save_results(results, args.output_json, args.save_result, result_name(args))
    return results


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["vllm", "hf", "llama.cpp"], default="vllm")
    parser.add_argument("--dataset", type=str, default=None,
                        help="JSON/JSONL workload file (format above); default: synthetic prompts")
    parser.add_argument("--input-len", type=int, default=None,
                        help="prompt length in tokens of each synthetic request")
    parser.add_argument("--output-len", type=int, default=None,
                        help="output length of each request; overrides the dataset's output_len")
    parser.add_argument("--num-prompts", type=int, default=100,
                        help="number of requests (vLLM's default is 1000; 100 suits a 2-core CPU)")
    parser.add_argument("--hf-max-batch-size", type=int, default=None,
                        help="batch size of the hf backend (required for it)")
    parser.add_argument("--output-json", type=str, default=None,
                        help="write the results as JSON to this path")
    parser.add_argument("--save-result", action="store_true",
                        help="write the results to benchmarks/results/<name>.json "
                             "(when --output-json is not given)")
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--llama-cpp-verbose", action="store_true",
                        help="keep llama.cpp's own log output (llama.cpp backend)")
    parser.add_argument("--no-roofline", action="store_true",
                        help="skip the matmul/bandwidth microbenchmarks and the roofline fractions")
    roofline.add_roofline_args(parser)
    engine_setup.add_engine_args(parser)
    return parser


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.dataset is None:
        if args.input_len is None or args.output_len is None:
            parser.error("without --dataset, --input-len and --output-len are required")
        if args.input_len < 1 or args.output_len < 1:
            parser.error("--input-len and --output-len must be at least 1")
    elif args.input_len is not None:
        parser.error("--input-len is for synthetic prompts; it cannot be used with --dataset")
    if args.num_prompts < 1:
        parser.error("--num-prompts must be at least 1")
    if args.backend == "hf":
        if args.hf_max_batch_size is None:
            parser.error("the hf backend needs --hf-max-batch-size")
    elif args.hf_max_batch_size is not None:
        parser.error("--hf-max-batch-size is only for the hf backend")


if __name__ == "__main__":
    _parser = make_parser()
    _args = _parser.parse_args()
    check_args(_parser, _args)
    main(_args)
