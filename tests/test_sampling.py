"""The sampler: greedy, seeded reproducibility, the kept token sets of each filter and sampled frequencies."""

import math

import pytest
import torch

from moetier.engine.sampling import (
    PenaltyState,
    SamplingParams,
    apply_penalties,
    filtered_probabilities,
    make_generator,
    sample_tokens,
    token_logprobs,
)
from moetier.errors import ConfigError

# A crafted distribution with distinct probabilities and no filter boundary near a threshold used
# below, scattered over the vocabulary so that "most likely" is not "lowest index".
PROBS = [0.30, 0.20, 0.15, 0.12, 0.08, 0.06, 0.04, 0.03, 0.015, 0.005]
PERMUTATION = [7, 2, 9, 0, 4, 1, 8, 5, 3, 6]


def crafted_logits() -> torch.Tensor:
    """Logits whose softmax is PROBS placed at PERMUTATION (shifted, so the softmax is what counts)."""
    logits = torch.empty(len(PROBS))
    for p, index in zip(PROBS, PERMUTATION, strict=True):
        logits[index] = math.log(p) + 3.0
    return logits


def reference_filter(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    """Plain-Python float64 statement of the filters: temperature, then top_k, top_p, min_p."""
    scaled = [x / temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = order[:top_k] if top_k > 0 else order
    top = max(scaled)
    weights = {i: math.exp(scaled[i] - top) for i in keep}
    total = sum(weights.values())
    kept, mass = [], 0.0
    for i in keep:  # smallest prefix whose mass reaches top_p
        if top_p < 1 and mass >= top_p:
            break
        kept.append(i)
        mass += weights[i] / total
    best = max(weights[i] for i in kept)
    kept = [i for i in kept if weights[i] >= min_p * best]
    total = sum(weights[i] for i in kept)
    return [weights[i] / total if i in kept else 0.0 for i in range(len(logits))]


def expected_support(ranks: int) -> set[int]:
    return set(PERMUTATION[:ranks])


def draw(logits: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """``n`` draws with the request's own generator (one row per draw)."""
    return sample_tokens(logits.expand(n, -1), params, make_generator(params, "cpu"))


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic over the tokens of positive probability."""
    n = counts.sum().item()
    support = probs > 0
    expected = probs[support].double() * n
    return float(((counts[support].double() - expected) ** 2 / expected).sum())


def test_greedy_is_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams(temperature=0.0, top_k=3, top_p=0.5)  # filters are ignored when greedy
    assert torch.equal(sample_tokens(logits, greedy), logits.argmax(dim=-1))
    assert sample_tokens(logits[2], greedy).item() == logits[2].argmax().item()
    assert make_generator(greedy, "cpu") is None
    probs = filtered_probabilities(logits, greedy)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 50).float())


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    logits = torch.randn(64, generator=torch.Generator().manual_seed(1))
    runs = {seed: draw(logits, SamplingParams(seed=seed), 200).tolist() for seed in (7, 8)}
    assert draw(logits, SamplingParams(seed=7), 200).tolist() == runs[7]
    assert runs[7] != runs[8]
    assert len(set(runs[7])) > 10  # really random, not a constant


def test_requests_draw_only_from_their_own_generator():
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    alone = SamplingParams(seed=11)
    gen = make_generator(alone, "cpu")
    solo = [sample_tokens(logits[0], alone, gen).item() for _ in range(50)]
    params = [alone, SamplingParams(seed=3), SamplingParams(temperature=0.7)]
    gens = [make_generator(p, "cpu") for p in params]
    batched = [sample_tokens(logits, params, gens)[0].item() for _ in range(50)]
    assert batched == solo


@pytest.mark.parametrize(
    ("kwargs", "ranks"),
    [
        ({"top_k": 3}, 3),
        ({"top_k": 1}, 1),
        ({"top_p": 0.6}, 3),  # 0.30 + 0.20 = 0.50 < 0.6, so the third token is needed
        ({"top_p": 0.9}, 6),  # mass before the 6th is 0.85, before the 7th 0.91
        ({"min_p": 0.3}, 4),  # threshold 0.09: 0.12 stays, 0.08 goes
        ({"min_p": 0.12}, 7),  # threshold 0.036: 0.04 stays, 0.03 goes
        ({"top_k": 5, "top_p": 0.6}, 3),
        ({"top_k": 2, "min_p": 0.05}, 2),
    ],
)
def test_filters_keep_exactly_the_right_tokens_and_sample_renormalised(kwargs, ranks):
    logits = crafted_logits()
    params = SamplingParams(seed=1234, **kwargs)
    probs = filtered_probabilities(logits, params)
    assert {i for i in range(len(PROBS)) if probs[i] > 0} == expected_support(ranks)
    kept = sum(PROBS[:ranks])
    expected = torch.zeros(len(PROBS))
    for p, index in zip(PROBS[:ranks], PERMUTATION, strict=False):
        expected[index] = p / kept
    torch.testing.assert_close(probs, expected, rtol=1e-5, atol=1e-7)

    tokens = draw(logits, params, 10000)
    assert set(tokens.tolist()) == expected_support(ranks)
    counts = torch.bincount(tokens, minlength=len(PROBS))
    # 99.99th percentile of chi-square with <= 6 degrees of freedom is ~27.9; the seed is fixed.
    assert chi_square(counts, expected) < 28.0


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(2.0, 0, 1.0, 0.0), (0.5, 0, 0.8, 0.0), (1.5, 6, 0.7, 0.2), (0.8, 0, 0.95, 0.05), (3.0, -1, 0.5, 0.5)],
)
def test_filtered_distribution_matches_plain_reference(temperature, top_k, top_p, min_p):
    logits = torch.randn(40, generator=torch.Generator().manual_seed(5)) * 2
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=99)
    expected = torch.tensor(reference_filter(logits.tolist(), temperature, top_k, top_p, min_p))
    probs = filtered_probabilities(logits, params)
    torch.testing.assert_close(probs, expected, rtol=1e-4, atol=1e-6)
    counts = torch.bincount(draw(logits, params, 10000), minlength=40)
    assert counts[expected == 0].sum() == 0
    df = int((expected > 0).sum()) - 1
    assert chi_square(counts, expected) < df + 8 * math.sqrt(2 * df) + 10  # mean df, sd sqrt(2 df)


def test_temperature_flattens_and_sharpens():
    logits = crafted_logits()
    hot = filtered_probabilities(logits, SamplingParams(temperature=4.0))
    cold = filtered_probabilities(logits, SamplingParams(temperature=0.25))
    plain = filtered_probabilities(logits, SamplingParams())
    top = PERMUTATION[0]
    assert hot[top] < plain[top] < cold[top]
    torch.testing.assert_close(plain, torch.softmax(logits, -1))


def test_batched_rows_use_their_own_params():
    logits = crafted_logits().expand(3, -1)
    params = [SamplingParams(top_k=1), SamplingParams(top_p=0.6), SamplingParams(temperature=0)]
    probs = filtered_probabilities(logits, params)
    assert [int((row > 0).sum()) for row in probs] == [1, 3, 1]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"top_k": 2.5},
        {"min_p": 1.2},
        {"min_p": -0.1},
        {"max_tokens": 0},
        {"max_tokens": True},
        {"seed": "1"},
        {"stop": ""},
        {"stop": ["ok", 3]},
        {"stop_token_ids": [-1]},
        {"stop_token_ids": "12"},
        {"n": 0},
        {"n": 17},
        {"presence_penalty": 2.5},
        {"frequency_penalty": -2.1},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": float("inf")},
        {"logprobs": 21},
        {"logprobs": -1},
        {"prompt_logprobs": 1.0},
    ],
)
def test_bad_values_raise_one_line_config_error(kwargs):
    with pytest.raises(ConfigError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert "\n" not in message and next(iter(kwargs)) in message


def test_stop_is_normalised_to_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams().stop == [] and SamplingParams().stop_token_ids == []


# --- penalties and logprobs ---------------------------------------------------------------------------


def test_penalties_follow_the_openai_and_vllm_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 4.0]])
    prompt, output = [0, 1], [2, 2, 3]  # token 4 and 5 never seen
    state = PenaltyState(prompt, output, 6, "cpu")
    assert state.seen.tolist() == [True, True, True, True, False, False]
    assert state.counts.tolist() == [0, 0, 2, 1, 0, 0]
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    got = apply_penalties(logits, params, state.seen[None], state.counts[None])
    # repetition: positive / 2, negative * 2 on every seen token (prompt or output);
    # frequency 0.5 per generated occurrence and presence 0.25 once, on generated tokens only.
    expected = [2.0 / 2, -1.0 * 2, 0.5 / 2 - 0.5 * 2 - 0.25, -3.0 * 2 - 0.5 - 0.25, 1.0, 4.0]
    torch.testing.assert_close(got, torch.tensor([expected]))


def test_penalties_move_greedy_choice_and_neutral_values_change_nothing():
    logits = crafted_logits()[None]
    best = int(logits.argmax())
    state = PenaltyState([], [best], logits.shape[-1], "cpu")
    for params in (
        SamplingParams(temperature=0, presence_penalty=2.0),
        SamplingParams(temperature=0, frequency_penalty=2.0),
    ):
        penalised = apply_penalties(logits, params, state.seen[None], state.counts[None])
        assert int(sample_tokens(penalised, params)) == PERMUTATION[1]  # the runner-up now wins
    neutral = apply_penalties(logits, SamplingParams(), state.seen[None], state.counts[None])
    assert torch.equal(neutral, logits)
    # Negative penalties encourage repetition.
    boosted = apply_penalties(logits, SamplingParams(presence_penalty=-1.0), state.seen[None], state.counts[None])
    assert boosted[0, best] == logits[0, best] + 1.0


def test_rows_get_their_own_penalties():
    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(3))
    states = [PenaltyState([1, 2], [3, 3], 12, "cpu") for _ in range(3)]
    seen, counts = torch.stack([s.seen for s in states]), torch.stack([s.counts for s in states])
    params = [SamplingParams(), SamplingParams(frequency_penalty=1.0), SamplingParams(repetition_penalty=1.3)]
    got = apply_penalties(logits, params, seen, counts)
    assert torch.equal(got[0], logits[0])
    assert got[1, 3] == logits[1, 3] - 2.0 and torch.equal(got[1, :3], logits[1, :3])
    assert not torch.equal(got[2, [1, 2, 3]], logits[2, [1, 2, 3]]) and torch.equal(got[2, 4:], logits[2, 4:])


def test_token_logprobs_are_log_softmax_of_the_logits_with_sorted_alternatives():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(4)) * 3
    chosen = torch.tensor([5, 0, 39])
    rows = token_logprobs(logits, chosen, [0, 3, 5])
    reference = torch.log_softmax(logits.double(), dim=-1)
    for row, token, ref, k in zip(rows, chosen.tolist(), reference, [0, 3, 5], strict=True):
        assert row.token_id == token and math.isclose(row.logprob, ref[token].item(), abs_tol=1e-5)
        assert [t for t, _ in row.top] == (ref.topk(k).indices.tolist() if k else [])
        assert all(math.isclose(lp, ref[t].item(), abs_tol=1e-5) for t, lp in row.top)
    assert math.isclose(sum(math.exp(lp) for lp in reference[0].tolist()), 1.0)


def test_child_params_for_parallel_sampling():
    params = SamplingParams(n=4, seed=10, temperature=0.5, logprobs=2)
    children = [params.child(i) for i in range(4)]
    assert [c.seed for c in children] == [10, 11, 12, 13] and all(c.n == 1 for c in children)
    assert all(c.temperature == 0.5 and c.logprobs == 2 for c in children)
    assert SamplingParams(n=2).child(1).seed is None
    assert params.n == 4  # the parent is untouched


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_greedy_tokens_are_the_argmax_in_two_reductions_with_its_first_index(device):
    from moetier.engine.sampling import ARGMAX_CHUNKS, greedy_tokens

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator().manual_seed(0)
    vocab = 129_280  # V4's: 128 chunks of 1010
    logits = torch.randn(5, vocab, generator=g)
    logits[1, [7, 500, 90_000]] = 50.0  # equal maxima in one chunk and in two others: the first index wins
    logits[2, [1010 * 3 + 4, 1010 * 3]] = 60.0  # two in one chunk, the later one written first
    logits[3] = 1.0  # every logit equal
    logits[4, 128_000] = float("inf")
    logits = logits.to(device)
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    assert greedy_tokens(logits).tolist()[1:4] == [7, 3030, 0]
    small = torch.randn(3, 500 * ARGMAX_CHUNKS, generator=g).to(device)  # too short to split: torch's argmax itself
    assert torch.equal(greedy_tokens(small), small.argmax(dim=-1))
    bf16 = logits.bfloat16()  # many equal logits after rounding
    assert torch.equal(greedy_tokens(bf16), bf16.argmax(dim=-1))
