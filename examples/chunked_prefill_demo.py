"""Chunked prefill on a mix of long and short prompts: the short ones are not held back.

Three short questions start decoding; then two long documents (~2000 and ~1500 tokens) arrive.
Without chunking, each long prompt is prefilled in one step and every running decode stalls
for that whole step. With chunked prefill the long prompts are cut into chunks that ride along
with the decodes, so the short requests keep producing tokens and finish early.

    python examples/chunked_prefill_demo.py                 # chunked prefill, default model
    python examples/chunked_prefill_demo.py --compare       # also without chunking, same requests
    python examples/chunked_prefill_demo.py --async         # streaming clients on AsyncLLMEngine

The --async mode is the serving picture: each request is an asyncio task that arrives at its own
time and streams its tokens from one AsyncLLMEngine; the short chat requests get their first token
while the long documents are still being prefilled, chunk by chunk. Per request it prints the
arrival, the TTFT, and "steps": the engine steps that ended from its arrival to its first token,
counting the step under way when it arrives (its request is added between steps) and the one
that samples it. A short request starts beside the long prompts being prefilled
(max_long_partial_prefills, on by default), so it sees two or three steps. `--max-num-partial-prefills 1` shows
plain FCFS chunking, where it waits for the long prompts ahead of it; `--max-step-latency-ms`
sizes each step from a time-between-tokens target instead of the fixed budget.
"""

import argparse
import asyncio
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


async def run_async(engine: AsyncLLMEngine, requests: list[tuple[float, str, str]], max_tokens: int) -> None:
    """Sends each (arrival seconds, name, prompt) request from its own task and times its stream."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tok = await engine.get_tokenizer()
    start = time.perf_counter()

    stats = engine.engine.stats

    async def client(delay: float, name: str, prompt: str) -> tuple:
        await asyncio.sleep(delay)
        sent, sent_step = time.perf_counter(), stats.num_steps
        first = first_step = None
        async for out in engine.generate(prompt, params, name):
            if first is None:
                # The first output comes out of the step that sampled it, already counted.
                first, first_step = time.perf_counter(), stats.num_steps
        done = time.perf_counter()
        return name, out, sent - start, first - sent, first_step - sent_step, done - sent, done - start

    results = await asyncio.gather(*(client(*r) for r in requests))
    await engine.shutdown()
    print(f"\n{'request':<8} | {'prompt':>6} | {'arrives':>7} | {'TTFT':>6} | {'steps':>5} | "
          f"{'latency':>7} | {'done at':>7} | output")
    for name, out, arrives, ttft, steps, latency, done_at in sorted(results, key=lambda r: r[6]):
        text = tok.decode(out.outputs[0].token_ids, skip_special_tokens=True).strip()
        text = text.replace("\n", " ")[:40]
        print(f"{name:<8} | {len(out.prompt_token_ids):>6} | {arrives:>6.2f}s | {ttft:>5.2f}s | "
              f"{steps:>5} | {latency:>6.2f}s | {done_at:>6.2f}s | {text}")
    for kind in ("small", "large"):
        rows = [r for r in results if r[0].startswith(kind)]
        print(f"{kind} requests: mean TTFT {sum(r[3] for r in rows) / len(rows):.2f} s "
              f"(at most {max(r[4] for r in rows)} steps after arrival), "
              f"mean latency {sum(r[5] for r in rows) / len(rows):.2f} s")
    print(f"{stats.num_steps} steps, {stats.num_mixed_steps} of them mixed prefill+decode")


def main_async(args: argparse.Namespace) -> None:
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=args.model, enable_chunked_prefill=True, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=64, max_model_len=args.max_model_len, dtype=args.dtype,
        max_num_partial_prefills=args.max_num_partial_prefills, max_step_latency_ms=args.max_step_latency_ms))
    tok = engine.engine.tokenizer
    questions = ["What is 2+2?", "Hello, how are you?", "Translate 'hello' to French.",
                 "Name a prime number.", "What colour is the sky?", "Give me a synonym for fast."]
    requests = [  # (arrival in seconds, name, prompt): two documents amid a stream of chat turns
        (0.00, "large_1", long_prompt(tok, args.long_tokens, "the history of computing")),
        (0.05, "large_2", long_prompt(tok, args.long_tokens * 3 // 4, "computer memory")),
    ] + [(0.02 + 0.15 * i, f"small_{i + 1}", chat_prompt(tok, q)) for i, q in enumerate(questions)]
    target = "" if args.max_step_latency_ms is None else f", step latency target {args.max_step_latency_ms} ms"
    print(f"=== AsyncLLMEngine, chunked prefill (budget {args.max_num_batched_tokens} tokens per step, "
          f"{args.max_num_partial_prefills} partial prefills{target}) ===")
    asyncio.run(run_async(engine, requests, args.max_tokens))


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
                        help="--async: prompts mid-prefill at once (1: FCFS, short prompts wait)")
    parser.add_argument("--max-step-latency-ms", type=float, default=None,
                        help="--async: size steps from this time-between-tokens target")
    args = parser.parse_args()
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
    warm_up(llm, requests[-1][2])
    chunked = run(llm, requests, args.max_tokens)
    if args.compare:
        del llm
        llm = LLM(args.model, enable_chunked_prefill=False, max_num_batched_tokens=4096, max_num_seqs=64,
                  max_model_len=args.max_model_len, dtype=args.dtype)
        print("\n=== without chunked prefill (whole prompts, prefill steps before decodes) ===")
        warm_up(llm, requests[-1][2])
        classic = run(llm, requests, args.max_tokens)
        print(f"\nlongest stall of a short request's decoding: {chunked['small_gap']:.2f} s chunked vs "
              f"{classic['small_gap']:.2f} s unchunked; wall time {chunked['wall']:.2f} s vs "
              f"{classic['wall']:.2f} s")


if __name__ == "__main__":
    main()
