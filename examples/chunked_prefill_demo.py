"""Chunked prefill on a mix of long and short prompts: the short ones are not held back.

Three short questions start decoding; then two long documents (~2000 and ~1500 tokens) arrive.
Without chunking, each long prompt is prefilled in one step and every running decode stalls
for that whole step. With chunked prefill the long prompts are cut into chunks that ride along
with the decodes, so the short requests keep producing tokens and finish early.

    python examples/chunked_prefill_demo.py                 # chunked prefill, default model
    python examples/chunked_prefill_demo.py --compare       # also without chunking, same requests
    python examples/chunked_prefill_demo.py --async         # streaming clients, two scheduling policies

The --async mode is the serving picture: each request is an asyncio task that arrives at its own
time and streams its tokens from one AsyncLLMEngine: two long documents amid six short chat turns.
It runs the same arrivals twice, with partial prefills (the defaults: a short prompt starts beside
the long one being prefilled, max_long_partial_prefills) and with FCFS chunking
(max_num_partial_prefills=1, where a short prompt waits for the long prompts ahead of it). Per
request and run it prints the TTFT and "steps": the engine steps that ended from its arrival to
its first token, counting the step under way when it arrives (its request is added between steps)
and the one that samples it. Then, per run, the short and long mean TTFT and, of the short
requests that arrived while an earlier long prompt was being prefilled, how many got their first
token before that prompt did. `--output-json PATH` writes every figure with the settings and the
machine; `--max-step-latency-ms` sizes each step from a time-between-tokens target instead of the
fixed budget.

    python examples/chunked_prefill_demo.py --async --output-json benchmarks/results/demo_async.json
"""

import argparse
import asyncio
import os
import sys
import time

from vllm import LLM, AsyncEngineArgs, AsyncLLMEngine, SamplingParams

_PASSAGE = (
    "The history of computing is a story of layers. Each generation of engineers built tools on "
    "top of the previous generation's work, hiding complexity behind cleaner interfaces. Punch "
    "cards gave way to assemblers, assemblers to compilers, and compilers to interpreters and "
    "virtual machines. Memory grew from kilobytes to terabytes while processors learned to run "
    "many instructions at once. ")


def long_prompt(tokenizer, num_tokens: int, topic: str) -> str:
    text = f"Please analyze the following text about {topic} and summarize it.\n\n"
    while len(tokenizer(text).input_ids) < num_tokens:
        text += _PASSAGE
    ids = tokenizer(text).input_ids[:num_tokens]
    return tokenizer.decode(ids) + "\n\nSummary:"


def warm_up(llm: LLM, long: str) -> None:
    """One untimed generation with a long and a short prompt, so that neither timed run pays the
    first calls' costs (kernel loading, oneDNN's code generation per shape)."""
    llm.generate([long, "Hi"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)


def run(llm: LLM, requests: list[tuple[int, str, str]], max_tokens: int) -> dict:
    """Adds each (arrival_step, name, prompt) request at its step and times every token."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    pending = sorted(requests)
    arrival: dict[str, float] = {}
    token_times: dict[str, list[float]] = {}
    done: dict = {}
    start = time.perf_counter()
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, name, prompt = pending.pop(0)
            arrival[name] = time.perf_counter() - start
            engine.add_request(name, prompt, params)
        for out in engine.step():
            token_times.setdefault(out.request_id, []).append(time.perf_counter() - start)
            if out.finished:
                done[out.request_id] = out
        step += 1
    wall = time.perf_counter() - start
    print(f"\n{'request':<8} | {'prompt':>6} | {'arrives':>7} | {'TTFT':>6} | {'max gap':>7} | "
          f"{'latency':>7} | output")
    latency, max_gap = {}, {}
    for _, name, _ in sorted(requests, key=lambda r: token_times[r[1]][-1]):
        out, times = done[name], token_times[name]
        latency[name] = times[-1] - arrival[name]
        gap = max_gap[name] = max((b - a for a, b in zip(times, times[1:])), default=0.0)
        text = out.outputs[0].text.strip().replace("\n", " ")[:40]
        print(f"{name:<8} | {len(out.prompt_token_ids):>6} | {arrival[name]:>6.2f}s | "
              f"{times[0] - arrival[name]:>5.2f}s | {gap:>6.2f}s | {latency[name]:>6.2f}s | {text}")
    prompt_tokens = sum(len(o.prompt_token_ids) for o in done.values())
    output_tokens = sum(len(o.outputs[0].token_ids) for o in done.values())
    small = [latency[n] for _, n, _ in requests if n.startswith("small")]
    large = [latency[n] for _, n, _ in requests if n.startswith("large")]
    stats = engine.stats
    print(f"\nwall time {wall:.2f} s | {(prompt_tokens + output_tokens) / wall:.0f} total tokens/s | "
          f"{output_tokens / wall:.1f} output tokens/s")
    print(f"small requests: mean latency {sum(small) / len(small):.2f} s | "
          f"large requests: mean latency {sum(large) / len(large):.2f} s")
    print(f"{stats.num_steps} steps, {stats.num_mixed_steps} of them mixed prefill+decode, "
          f"{stats.num_preemptions} preemptions")
    return {"wall": wall, "small_gap": max(max_gap[n] for _, n, _ in requests if n.startswith("small"))}


def chat_prompt(tokenizer, question: str) -> str:
    """The question in the model's chat format, or as is when the tokenizer has no template."""
    if not getattr(tokenizer, "chat_template", None):
        return question
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)


async def run_async(engine: AsyncLLMEngine, requests: list[tuple[float, str, str]], max_tokens: int,
                    warm_up_prompts: list[str]) -> dict:
    """Sends each (arrival seconds, name, prompt) request from its own task and times its stream;
    returns each request's times and the engine's step counts."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    # Untimed, with prompts of their own (the prefix cache would otherwise serve the timed ones):
    # the first calls' costs (kernel loading, code generation per shape) stay out.
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i, prompt in enumerate(warm_up_prompts):
        async for _ in engine.generate(prompt, warm, f"warmup_{i}"):
            pass
    stats = engine.engine.stats
    steps_before, mixed_before = stats.num_steps, stats.num_mixed_steps
    start = time.perf_counter()

    async def client(delay: float, name: str, prompt: str) -> dict:
        await asyncio.sleep(delay)
        sent, sent_step = time.perf_counter(), stats.num_steps
        first = first_step = None
        async for out in engine.generate(prompt, params, name):  # noqa: B007 (the last one is kept)
            if first is None:
                # The first output comes out of the step that sampled it, already counted.
                first, first_step = time.perf_counter(), stats.num_steps
        done = time.perf_counter()
        return {"name": name, "kind": "short" if name.startswith("small") else "long",
                "prompt_tokens": len(out.prompt_token_ids), "arrival_s": sent - start,
                "ttft_s": first - sent, "first_token_at_s": first - start,
                "steps_to_first_token": first_step - sent_step, "latency_s": done - sent,
                "done_at_s": done - start,
                "output": out.outputs[0].text.strip().replace("\n", " ")[:40]}

    rows = await asyncio.gather(*(client(*r) for r in requests))
    await engine.shutdown()
    return {"requests": rows, "num_steps": stats.num_steps - steps_before,
            "num_mixed_steps": stats.num_mixed_steps - mixed_before}


def summarize(rows: list[dict]) -> dict:
    """Short and long TTFT, and the demo's claim, measured: each short request that arrived while
    a long prompt that came before it had no first token yet, got its own first token first."""
    short = [r for r in rows if r["kind"] == "short"]
    long = [r for r in rows if r["kind"] == "long"]
    behind_long = [s for s in short if any(g["arrival_s"] < s["arrival_s"] < g["first_token_at_s"] for g in long)]
    jumped = [s for s in behind_long
              if all(s["first_token_at_s"] < g["first_token_at_s"] for g in long
                     if g["arrival_s"] < s["arrival_s"] < g["first_token_at_s"])]
    return {"short_mean_ttft_s": sum(r["ttft_s"] for r in short) / len(short),
            "short_max_ttft_s": max(r["ttft_s"] for r in short),
            "short_max_steps_to_first_token": max(r["steps_to_first_token"] for r in short),
            "long_mean_ttft_s": sum(r["ttft_s"] for r in long) / len(long),
            "short_arrived_during_long_prefill": len(behind_long),
            "short_answered_before_that_long_prompt": len(jumped)}


def print_comparison(runs: dict[str, dict]) -> None:
    """Per request, each run's TTFT and steps from arrival to first token; then per run, the means."""
    names = list(runs)
    widths = [max(len(n), 18) for n in names]
    print(f"\n{'request':<8} | {'prompt':>6} | {'arrives':>7} | "
          + " | ".join(f"{n:>{w}}" for n, w in zip(names, widths)))
    by_name = {n: {r["name"]: r for r in runs[n]["requests"]} for n in names}
    for row in sorted(runs[names[0]]["requests"], key=lambda r: r["arrival_s"]):
        same = [by_name[n][row["name"]] for n in names]
        cells = [f"{r['ttft_s']:>6.2f}s, {r['steps_to_first_token']:>3} steps" for r in same]
        print(f"{row['name']:<8} | {row['prompt_tokens']:>6} | {row['arrival_s']:>6.2f}s | "
              + " | ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    print("(TTFT, and the engine steps that ended from the arrival to the first token)")
    for n in names:
        s = runs[n]["summary"]
        print(f"\n{n}: short requests: mean TTFT {s['short_mean_ttft_s']:.2f} s, at most "
              f"{s['short_max_steps_to_first_token']} steps after arrival; long requests: mean TTFT "
              f"{s['long_mean_ttft_s']:.2f} s; {runs[n]['num_steps']} steps, {runs[n]['num_mixed_steps']} mixed")
        print(f"  of the {s['short_arrived_during_long_prefill']} short requests that arrived while an "
              f"earlier long prompt was being prefilled, {s['short_answered_before_that_long_prompt']} got "
              f"their first token before it")


def main_async(args: argparse.Namespace) -> None:
    """The same arrivals with partial prefills (the defaults), then with FCFS chunking."""
    runs, settings = {}, {}
    policies = {"partial_prefills": args.max_num_partial_prefills, "fcfs": 1}
    for name, partial in policies.items():
        engine_args = AsyncEngineArgs(
            model=args.model, enable_chunked_prefill=True, max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=64, max_model_len=args.max_model_len, dtype=args.dtype,
            max_num_partial_prefills=partial, max_step_latency_ms=args.max_step_latency_ms)
        engine = AsyncLLMEngine.from_engine_args(engine_args)
        tok = engine.engine.tokenizer
        questions = ["What is 2+2?", "Hello, how are you?", "Translate 'hello' to French.",
                     "Name a prime number.", "What colour is the sky?", "Give me a synonym for fast."]
        requests = [  # (arrival in seconds, name, prompt): two documents amid a stream of chat turns
            (0.00, "large_1", long_prompt(tok, args.long_tokens, "the history of computing")),
            (0.05, "large_2", long_prompt(tok, args.long_tokens * 3 // 4, "computer memory")),
        ] + [(0.02 + 0.15 * i, f"small_{i + 1}", chat_prompt(tok, q)) for i, q in enumerate(questions)]
        target = "" if args.max_step_latency_ms is None else f", step latency target {args.max_step_latency_ms} ms"
        print(f"=== {name}: AsyncLLMEngine, chunked prefill (budget {args.max_num_batched_tokens} tokens per "
              f"step, max_num_partial_prefills={partial}{target}) ===", flush=True)
        warm_up_prompts = [long_prompt(tok, args.long_tokens, "warming up"), chat_prompt(tok, "Hi")]
        runs[name] = asyncio.run(run_async(engine, requests, args.max_tokens, warm_up_prompts))
        runs[name]["summary"] = summarize(runs[name]["requests"])
        config = engine.engine.config.scheduler
        settings[name] = {"max_num_partial_prefills": config.max_num_partial_prefills,
                          "max_long_partial_prefills": config.max_long_partial_prefills,
                          "long_prompt_threshold": config.long_prompt_threshold}
    print_comparison(runs)
    if args.output_json:
        write_results(args, runs, settings)


def write_results(args: argparse.Namespace, runs: dict, run_settings: dict) -> None:
    """The runs, the settings and the machine (CPU model, load, commit), as the benchmarks write."""
    benchmarks = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    sys.path.insert(0, benchmarks)
    import result_files

    for name, run in runs.items():
        run["settings"] = run_settings[name]
    results = {"command": " ".join(["python", *sys.argv]),
               "settings": {k: getattr(args, k) for k in ("model", "dtype", "max_num_batched_tokens",
                                                          "max_model_len", "max_tokens", "long_tokens",
                                                          "max_step_latency_ms")},
               "runs": runs, "machine": result_files.machine_info()}
    print(f"Results written to {result_files.write_json(results, args.output_json)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--compare", action="store_true", help="also run without chunked prefill")
    parser.add_argument("--async", dest="use_async", action="store_true",
                        help="staggered streaming clients on AsyncLLMEngine instead")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--long-tokens", type=int, default=2000, help="length of the longest prompt")
    parser.add_argument("--max-num-partial-prefills", type=int, default=4,
                        help="--async: prompts mid-prefill at once in the first run (the second, "
                             "FCFS, has 1)")
    parser.add_argument("--max-step-latency-ms", type=float, default=None,
                        help="--async: size steps from this time-between-tokens target")
    parser.add_argument("--output-json", default=None,
                        help="--async: write each request's times, the settings and the machine here")
    args = parser.parse_args()
    if args.output_json and not args.use_async:
        parser.error("--output-json goes with --async")
    if args.use_async and args.max_num_partial_prefills < 2:
        parser.error("--max-num-partial-prefills: the first --async run needs 2 or more "
                     "(the second is FCFS, 1)")
    if args.use_async:
        main_async(args)
        return

    llm = LLM(args.model, enable_chunked_prefill=True, max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=64, max_model_len=args.max_model_len, dtype=args.dtype)
    tok = llm.get_tokenizer()
    requests = [  # (arrival step, name, prompt)
        (0, "small_1", "What is 2+2?"),
        (0, "small_2", "Hello, how are you?"),
        (0, "small_3", "Translate 'hello' to French."),
        (4, "large_1", long_prompt(tok, args.long_tokens, "the history of computing")),
        (8, "large_2", long_prompt(tok, args.long_tokens * 3 // 4, "computer memory")),
    ]
    print(f"=== chunked prefill (budget {args.max_num_batched_tokens} tokens per step) ===")
    # A prompt of its own: one of the timed ones would be served from the prefix cache.
    warm_up_prompt = long_prompt(tok, args.long_tokens, "warming up")
    warm_up(llm, warm_up_prompt)
    chunked = run(llm, requests, args.max_tokens)
    if args.compare:
        del llm
        llm = LLM(args.model, enable_chunked_prefill=False, max_num_batched_tokens=4096, max_num_seqs=64,
                  max_model_len=args.max_model_len, dtype=args.dtype)
        print("\n=== without chunked prefill (whole prompts, prefill steps before decodes) ===")
        warm_up(llm, warm_up_prompt)
        classic = run(llm, requests, args.max_tokens)
        print(f"\nlongest stall of a short request's decoding: {chunked['small_gap']:.2f} s chunked vs "
              f"{classic['small_gap']:.2f} s unchunked; wall time {chunked['wall']:.2f} s vs "
              f"{classic['wall']:.2f} s")


if __name__ == "__main__":
    main()
