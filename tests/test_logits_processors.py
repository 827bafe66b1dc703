"""Logits processors against plain-loop references; min_p sampling; seeded rows stay independent."""

import math

import pytest
import torch

from vllm import SamplingParams
from vllm.model_executor.layers.logits_processors import (apply_allowed_token_ids, apply_bad_words,
                                                          apply_logit_bias, apply_min_p, apply_min_tokens,
                                                          apply_penalties, apply_token_masks)
from vllm.model_executor.layers.sampler import sample, sample_with_processors

V = 20
NEG_INF = float("-inf")


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3  # (R, V)


def _ids(n: int, seed: int) -> list[int]:
    # Few distinct ids, so tokens repeat and counts above 1 occur.
    return torch.randint(0, V // 2, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---------------------------------------------------------------- penalties

def _reference_penalties(row: list[float], p: SamplingParams, prompt: list[int],
                         output: list[int]) -> list[float]:
    out = list(row)
    for tok in range(V):
        if tok in prompt or tok in output:
            out[tok] = out[tok] / p.repetition_penalty if out[tok] > 0 else \
                out[tok] * p.repetition_penalty
        count = output.count(tok)
        out[tok] -= p.frequency_penalty * count
        if count > 0:
            out[tok] -= p.presence_penalty
    return out


_PENALTY_ROWS = [  # (params, prompt length, output length)
    (SamplingParams(repetition_penalty=1.3), 7, 5),
    (SamplingParams(frequency_penalty=0.5, presence_penalty=0.7), 4, 9),
    (SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.4, presence_penalty=1.2), 6, 3),
    (SamplingParams(), 5, 5),  # no penalty beside rows that have one
    (SamplingParams(repetition_penalty=1.5, frequency_penalty=2.0, presence_penalty=-2.0), 8, 0),
    (SamplingParams(presence_penalty=0.3), 3, 12),
]


def test_penalties_match_a_plain_loop_reference():
    params = [p for p, _, _ in _PENALTY_ROWS]
    prompts = [_ids(n, seed=10 + i) for i, (_, n, _) in enumerate(_PENALTY_ROWS)]
    outputs = [_ids(n, seed=20 + i) for i, (_, _, n) in enumerate(_PENALTY_ROWS)]
    logits = _logits(len(params))
    before = logits.clone()
    got = apply_penalties(logits, params, prompts, outputs)
    expected = torch.tensor([_reference_penalties(row, p, pr, out) for row, p, pr, out in
                             zip(logits.double().tolist(), params, prompts, outputs)],
                            dtype=torch.float64)
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(logits, before)  # the input is left alone
    assert not torch.equal(got[:3], before[:3]) and torch.equal(got[3], before[3])


def test_repetition_penalty_counts_the_prompt_and_the_others_only_the_output():
    logits = torch.tensor([[2.0, -2.0, 2.0, 1.0] + [0.0] * (V - 4)] * 2)       # (2, V)
    params = [SamplingParams(repetition_penalty=2.0), SamplingParams(frequency_penalty=1.0)]
    got = apply_penalties(logits, params, [[0, 1], [0, 1]], [[2], [2]])
    assert got[0, :4].tolist() == [1.0, -4.0, 1.0, 1.0]
    assert got[1, :4].tolist() == [2.0, -2.0, 1.0, 1.0]


# ---------------------------------------------------------------- min_tokens

@pytest.mark.parametrize("eos", [3, None])
def test_min_tokens_masks_eos_and_stop_ids_until_reached(eos):
    p = SamplingParams(min_tokens=3, stop_token_ids=[5, 7, V + 4])  # V + 4: not in the vocab
    ignoring = SamplingParams(min_tokens=3, ignore_eos=True)
    logits = _logits(5)
    params = [p, p, p, ignoring, SamplingParams(stop_token_ids=[5])]
    got = apply_min_tokens(logits, params, [0, 2, 3, 1, 0], eos)
    banned = {5, 7} | ({eos} if eos is not None else set())
    for row, masked in enumerate([banned, banned, set(), {eos} - {None}, set()]):
        for tok in range(V):
            expected = NEG_INF if tok in masked else logits[row, tok].item()
            assert got[row, tok].item() == expected, (row, tok)


def test_greedy_rows_see_min_tokens_and_penalties():
    logits = torch.zeros(2, V)
    logits[:, 4], logits[:, 9] = 5.0, 4.0  # EOS (4) is the argmax, then 9
    params = [SamplingParams(temperature=0, min_tokens=2),
              SamplingParams(temperature=0, presence_penalty=2.0)]
    gens = [torch.Generator().manual_seed(0)] * 2
    assert sample_with_processors(logits, params, gens, [[1], [1]], [[9], [4]], 4) == [9, 9]
    assert sample_with_processors(logits, params, gens, [[1], [1]], [[9, 9], [9]], 4) == [4, 4]


# ---------------------------------------------------------------- allowed ids, bad words, logit bias

def _with_bad_words(words: list[list[int]], **kwargs) -> SamplingParams:
    """SamplingParams whose bad words are already token ids, as the engine leaves them."""
    return SamplingParams(bad_words=[f"w{i}" for i in range(len(words))], _bad_words_token_ids=words, **kwargs)


def test_allowed_token_ids_leave_only_those_tokens():
    params = [SamplingParams(allowed_token_ids=[3, 7, 7]), SamplingParams(),
              SamplingParams(allowed_token_ids=[V - 1])]
    logits = _logits(3, seed=4)
    before = logits.clone()
    got = apply_allowed_token_ids(logits, params)
    for row, p in enumerate(params):
        for tok in range(V):
            kept = p.allowed_token_ids is None or tok in p.allowed_token_ids
            assert got[row, tok] == (logits[row, tok] if kept else NEG_INF), (row, tok)
    assert torch.equal(logits, before)


def test_bad_words_forbid_the_token_that_completes_one():
    # Row 0: a one-token word always; "4 5 6" when the output ends with 4 5; "9 1" not (ends 5).
    # Row 1: "4 5 6" needs 4 5 at the end of the output, not inside it; the prompt never counts.
    # Row 2: an output shorter than the word's head.
    params = [_with_bad_words([[2], [4, 5, 6], [9, 1]]), _with_bad_words([[4, 5, 6]]),
              _with_bad_words([[8, 8, 8, 3]]), SamplingParams()]
    outputs = [[1, 4, 5], [4, 5, 0], [8, 8], [2]]
    expected = {(0, 2), (0, 6)}
    logits = _logits(4, seed=5)
    before = logits.clone()
    got = apply_bad_words(logits, params, outputs)
    for row in range(4):
        for tok in range(V):
            assert got[row, tok] == (NEG_INF if (row, tok) in expected else logits[row, tok]), (row, tok)
    assert torch.equal(logits, before)


def test_logit_bias_adds_to_its_tokens_only():
    params = [SamplingParams(logit_bias={1: 5.0, "3": -2.5}), SamplingParams(),
              SamplingParams(logit_bias={1: -100, V - 1: 100})]
    logits = _logits(3, seed=6)
    got = apply_logit_bias(logits, params)
    expected = logits.clone()
    for row, p in enumerate(params):
        for tok, bias in (p.logit_bias or {}).items():
            expected[row, tok] += bias
    assert torch.equal(got, expected) and not torch.equal(got, logits)


def test_logit_bias_comes_before_the_penalties_and_masks_before_both():
    """vLLM's order. Token 0 has logit 1 and was generated; a bias of 2 then a repetition
    penalty of 2 make it (1 + 2) / 2 = 1.5, below token 1's 2 (the other order would give 2.5).
    Token 1 is then a bad word, and token 3 the only allowed one of the last row."""
    logits = torch.full((3, 4), -5.0)
    logits[:, 0], logits[:, 1] = 1.0, 2.0
    biased = dict(temperature=0, logit_bias={0: 2.0}, repetition_penalty=2.0)
    params = [SamplingParams(**biased), _with_bad_words([[1]], **biased),
              SamplingParams(allowed_token_ids=[3], **biased)]
    generators = [torch.Generator() for _ in params]
    assert sample_with_processors(logits, params, generators, [[]] * 3, [[0]] * 3, None) == [1, 0, 3]


def test_token_masks_unpack_bit_j_of_word_w_as_token_32w_plus_j():
    vocab = 70  # three words; the last one's upper bits lie past the vocabulary
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(9))
    allowed = [{0, 31, 32, 63, 69}, None, set(range(64, 70))]
    masks = []
    for row in allowed:
        if row is None:
            masks.append(None)
            continue
        words = [0, 0, 0]
        for token in row | {95}:  # a bit past the vocabulary is ignored
            words[token // 32] |= 1 << (token % 32)
        masks.append(torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32))
    got = apply_token_masks(logits, masks)
    for r, row in enumerate(allowed):
        for tok in range(vocab):
            kept = row is None or tok in row
            assert got[r, tok] == (logits[r, tok] if kept else NEG_INF), (r, tok)


# ---------------------------------------------------------------- fast paths

def test_processors_return_their_input_when_no_row_uses_them():
    logits = _logits(3)
    params = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(top_k=3)]
    ids = [[1, 2, 2], [3], []]
    assert apply_penalties(logits, params, ids, ids) is logits
    assert apply_min_tokens(logits, params, [0, 0, 0], eos_token_id=2) is logits
    assert apply_min_p(logits, params) is logits
    assert apply_allowed_token_ids(logits, params) is logits
    assert apply_bad_words(logits, params, ids) is logits
    assert apply_logit_bias(logits, params) is logits
    assert apply_token_masks(logits, None) is logits and apply_token_masks(logits, [None] * 3) is logits
    # A multi-token word whose head the output does not end with bans nothing.
    assert apply_bad_words(logits, [_with_bad_words([[5, 6]])] * 3, ids) is logits
    done = [SamplingParams(min_tokens=2)] * 3
    assert apply_min_tokens(logits, done, [2, 5, 3], eos_token_id=2) is logits


# ---------------------------------------------------------------- min_p

def _reference_min_p(row: list[float], min_p: float) -> list[float]:
    """Probabilities after min_p, renormalised, by direct loops."""
    probs = [math.exp(x) for x in row]
    probs = [q / sum(probs) for q in probs]
    kept = [q if q >= min_p * max(probs) else 0.0 for q in probs]
    return [q / sum(kept) for q in kept]


def test_min_p_matches_a_plain_loop_reference():
    min_ps = [0.0, 0.05, 0.2, 0.5, 1.0]
    logits = _logits(len(min_ps), seed=3)
    got = apply_min_p(logits, [SamplingParams(min_p=m) for m in min_ps]).softmax(dim=-1)
    rows = logits.double().tolist()
    expected = torch.tensor([_reference_min_p(row, m) for row, m in zip(rows, min_ps)],
                            dtype=torch.float64)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-6)
    assert (got[1:] == 0).any(dim=-1).all()  # every filtering row did drop something


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.5, 0), (2.0, 0), (1.0, 3)])
def test_min_p_samples_stay_in_the_min_p_set_and_cover_it(temperature, top_k):
    probs = torch.tensor([0.30, 0.22, 0.16, 0.12, 0.08, 0.05, 0.04, 0.03])
    logits = probs.log().unsqueeze(0)                                           # (1, 8)
    min_p = 0.35
    scaled = (logits[0] / temperature).softmax(-1)
    allowed = {t for t in range(8) if scaled[t] >= min_p * scaled.max()}
    if top_k:
        allowed &= set(range(top_k))  # probs are already in rank order
    assert 1 < len(allowed) < 8
    params = SamplingParams(temperature=temperature, top_k=top_k, min_p=min_p)
    gen = torch.Generator().manual_seed(0)
    seen = [sample(logits, [params], [gen])[0] for _ in range(500)]
    assert set(seen) == allowed


# ---------------------------------------------------------------- independence

@pytest.mark.parametrize("mine", [SamplingParams(), SamplingParams(min_p=0.05),
                                  SamplingParams(repetition_penalty=1.2, presence_penalty=0.5)])
def test_a_seeded_row_draws_the_same_alone_or_beside_other_filters(mine):
    logits = _logits(4, seed=7) / 2                                              # (4, V)
    others = [SamplingParams(min_p=0.1), SamplingParams(frequency_penalty=1.5, min_tokens=9),
              SamplingParams(top_k=4, min_p=0.2)]
    prompts, outputs = [_ids(6, seed=i) for i in range(4)], [_ids(4, seed=9 + i) for i in range(4)]
    g_alone, g_mixed = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    g_others = [torch.Generator().manual_seed(s) for s in (6, 7, 8)]
    alone = [sample_with_processors(logits[:1], [mine], [g_alone], prompts[:1], outputs[:1], 2)[0]
             for _ in range(40)]
    mixed = [sample_with_processors(logits, [mine] + others, [g_mixed] + g_others, prompts,
                                    outputs, 2)[0] for _ in range(40)]
    assert alone == mixed and len(set(alone)) > 3
