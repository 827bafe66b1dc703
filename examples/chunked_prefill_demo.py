"""Chunked prefill on a mix of long and short prompts: the short ones are not held back.

Three short questions start decoding; then two long documents (~2000 and ~1500 tokens) arrive.
Without chunking, each long prompt is prefilled in one step and every running decode stalls
for that whole step. With chunked prefill the long prompts are cut into chunks that ride along
with the decodes, so the short requests keep producing tokens and finish early.

    python examples/chunked_prefill_demo.py                 # chunked prefill, default model
    python examples/chunked_prefill_demo.py --compare       # also without chunking, same requests
"""

import argparse
import time

from vllm import LLM, SamplingParams

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--compare", action="store_true", help="also run without chunked prefill")
    args = parser.parse_args()

    llm = LLM(args.model, enable_chunked_prefill=True, max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=64, max_model_len=4096, dtype=args.dtype)
    tok = llm.get_tokenizer()
    requests = [  # (arrival step, name, prompt)
        (0, "small_1", "What is 2+2?"),
        (0, "small_2", "Hello, how are you?"),
        (0, "small_3", "Translate 'hello' to French."),
        (4, "large_1", long_prompt(tok, 2000, "the history of computing")),
        (8, "large_2", long_prompt(tok, 1500, "computer memory")),
    ]
    print(f"=== chunked prefill (budget {args.max_num_batched_tokens} tokens per step) ===")
    chunked = run(llm, requests, args.max_tokens)
    if args.compare:
        del llm
        llm = LLM(args.model, enable_chunked_prefill=False, max_num_batched_tokens=4096, max_num_seqs=64,
                  max_model_len=4096, dtype=args.dtype)
        print("\n=== without chunked prefill (whole prompts, prefill steps before decodes) ===")
        classic = run(llm, requests, args.max_tokens)
        print(f"\nlongest stall of a short request's decoding: {chunked['small_gap']:.2f} s chunked vs "
              f"{classic['small_gap']:.2f} s unchunked; wall time {chunked['wall']:.2f} s vs "
              f"{classic['wall']:.2f} s")


if __name__ == "__main__":
    main()
