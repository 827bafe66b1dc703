"""Workload prompts: random token ids that avoid special tokens, and workload files (JSON, JSON
Lines or ShareGPT) read into token ids and output lengths."""

from __future__ import annotations

import json


def random_token_ids(rng, length: int, vocab_size: int, special_ids=()) -> list[int]:
    """`length` random token ids in [0, vocab_size) that are not special tokens."""
    special = set(special_ids)
    out: list[int] = []
    while len(out) < length:
        t = rng.randrange(vocab_size)
        if t not in special:
            out.append(t)
    return out


def tokenizer_vocab(tokenizer) -> tuple[int, list[int]]:
    """(vocabulary size, special token ids) of a transformers tokenizer."""
    return len(tokenizer), list(getattr(tokenizer, "all_special_ids", []) or [])


def load_dataset(path: str, tokenizer, num_prompts: int | None = None,
                 fixed_output_len: int | None = None) -> list[dict]:
    """Reads a workload file; returns [{"prompt_token_ids", "prompt_len", "output_len"}].

    The file is JSON (a list of records) or JSON Lines (one record per line). A record is
        {"prompt": "text", "output_len": 128}            text, tokenized with the model's tokenizer
        {"prompt_token_ids": [1, 2, 3], "output_len": 64} token ids as they are
    and ShareGPT records ({"conversations": [{"value": question}, {"value": answer}, ...]}) work
    too: the first turn is the prompt and the second turn's token count the output length.
    Records are used in file order; `fixed_output_len` (--output-len) overrides every output_len.
    """
    with open(path) as f:
        text = f.read()
    stripped = text.lstrip()
    if stripped.startswith("["):
        records = json.loads(text)
    else:
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    out: list[dict] = []
    for i, rec in enumerate(records):
        if num_prompts is not None and len(out) >= num_prompts:
            break
        if not isinstance(rec, dict):
            raise ValueError(f"{path}: record {i} is not an object")
        output_len = rec.get("output_len")
        if "prompt_token_ids" in rec:
            ids = [int(t) for t in rec["prompt_token_ids"]]
        elif "prompt" in rec:
            ids = tokenizer(rec["prompt"]).input_ids
        elif "conversations" in rec:
            turns = rec["conversations"]
            if len(turns) < 2:
                continue
            ids = tokenizer(turns[0]["value"]).input_ids
            if output_len is None:
                output_len = len(tokenizer(turns[1]["value"]).input_ids)
        else:
            raise ValueError(f"{path}: record {i} has none of prompt, prompt_token_ids, conversations")
        if fixed_output_len is not None:
            output_len = fixed_output_len
        if output_len is None:
            raise ValueError(f"{path}: record {i} has no output_len (or pass --output-len)")
        if not ids or int(output_len) < 1:
            continue
        out.append({"prompt_token_ids": ids, "prompt_len": len(ids), "output_len": int(output_len)})
    if not out:
        raise ValueError(f"{path}: no usable records")
    return out
