"""Verification keeps greedy output token for token and sampled output distributed exactly as the
target's: checked against plain decoding of a toy model, and by chi-square tests on many draws."""

from __future__ import annotations

import pytest
import torch

from snugkv.core.sampling import SamplingParams
from snugkv.core.structured_output import TokenBitmask
from snugkv.layers.sampler import Sampler, TokenRows
from snugkv.speculative.ngram import NgramConfig, NgramProposer
from snugkv.speculative.verify import (
    _point_masses,
    greedy_verification,
    position_token_rows,
    rejection_sample,
    verify,
)

SAMPLES = 200_000
# A 6-token target at 4 positions (k = 3) and a draft that disagrees with it in places.
TARGET = torch.tensor(
    [
        [0.10, 0.25, 0.30, 0.05, 0.20, 0.10],
        [0.50, 0.10, 0.10, 0.10, 0.15, 0.05],
        [0.05, 0.05, 0.20, 0.20, 0.10, 0.40],
        [0.30, 0.30, 0.10, 0.10, 0.10, 0.10],
    ]
)
POINT_DRAFT = [2, 0, 5]  # accepted with probabilities 0.30, 0.50, 0.40
DRAFT_PROBS = torch.tensor(
    [
        [0.05, 0.05, 0.60, 0.10, 0.10, 0.10],
        [0.20, 0.40, 0.10, 0.10, 0.10, 0.10],
        [0.30, 0.00, 0.10, 0.10, 0.10, 0.40],
    ]
)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic of `counts` against `probs`, and its p-value."""
    counts, expected = counts.double(), probs.double() * counts.sum()
    assert counts[expected == 0].sum() == 0, "drawn where the target has no mass"
    cells = expected > 0
    statistic = ((counts[cells] - expected[cells]) ** 2 / expected[cells]).sum()
    dof = torch.tensor((int(cells.sum()) - 1) / 2, dtype=torch.float64)
    return float(statistic), float(torch.special.gammaincc(dof, statistic / 2))


def _run(seed: int, draft_probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`SAMPLES` independent verify rows of the fixed target: (accepted lens, emitted tokens)."""
    generator = torch.Generator().manual_seed(seed)
    k = TARGET.shape[0] - 1
    if draft_probs is None:
        drafts = torch.tensor(POINT_DRAFT).expand(SAMPLES, k)
        flat_draft_probs = None
    else:  # drafted tokens drawn from the draft's distribution, as a draft model would
        drafts = torch.stack(
            [torch.multinomial(q, SAMPLES, True, generator=generator) for q in draft_probs], 1
        )
        flat_draft_probs = draft_probs.repeat(SAMPLES, 1)
    uniforms = torch.rand(SAMPLES, k, generator=generator)
    with torch.random.fork_rng():
        # The corrections' race draws from torch's default generator; seeded alike, it would
        # replay the stream that drew the drafts and the uniforms, and correlate with them.
        torch.manual_seed(1_000_003 + seed)
        result = rejection_sample(
            TARGET.repeat(SAMPLES, 1), drafts, torch.full((SAMPLES,), k), flat_draft_probs, uniforms
        )
    return result.accepted_lens, result.token_ids


@pytest.mark.parametrize("draft", ["point mass", "draft distribution"])
def test_the_first_emitted_token_follows_the_target(draft: str):
    _, tokens = _run(seed=1, draft_probs=None if draft == "point mass" else DRAFT_PROBS)
    statistic, p_value = _chi_square(torch.bincount(tokens[:, 0], minlength=6), TARGET[0])
    print(f"first token, {draft}: chi2 = {statistic:.2f} (5 dof), p = {p_value:.3f}")
    assert p_value > 1e-3


@pytest.mark.parametrize("draft", ["point mass", "draft distribution"])
def test_the_first_two_tokens_follow_the_target_jointly(draft: str):
    """With a target that ignores its context, the step's first two tokens (the second drawn afresh
    from position 1's distribution where the step stopped after one, as the next step would) are
    independent draws of positions 0 and 1."""
    _, tokens = _run(seed=2, draft_probs=None if draft == "point mass" else DRAFT_PROBS)
    fresh = torch.multinomial(TARGET[1], SAMPLES, True, generator=torch.Generator().manual_seed(2_000_003))
    second = torch.where(tokens[:, 1] >= 0, tokens[:, 1], fresh)
    counts = torch.bincount(tokens[:, 0] * 6 + second, minlength=36)
    statistic, p_value = _chi_square(counts, torch.outer(TARGET[0], TARGET[1]).flatten())
    print(f"first two tokens, {draft}: chi2 = {statistic:.2f} (35 dof), p = {p_value:.3f}")
    assert p_value > 1e-3


@pytest.mark.parametrize("draft", ["point mass", "draft distribution"])
def test_the_mean_accepted_length_is_the_closed_form(draft: str):
    """Position j accepts with probability beta_j = sum(min(p_j, q_j)) (p_j(x_j) for a point mass),
    so E[accepted] = beta_0 + beta_0 beta_1 + beta_0 beta_1 beta_2."""
    draft_probs = None if draft == "point mass" else DRAFT_PROBS
    accepted, _ = _run(seed=4, draft_probs=draft_probs)
    if draft_probs is None:
        betas = [float(TARGET[j, token]) for j, token in enumerate(POINT_DRAFT)]
    else:
        betas = [float(torch.minimum(TARGET[j], draft_probs[j]).sum()) for j in range(3)]
    expected = betas[0] + betas[0] * betas[1] + betas[0] * betas[1] * betas[2]
    mean = float(accepted.double().mean())
    standard_error = float(accepted.double().std()) / SAMPLES**0.5
    print(f"mean accepted, {draft}: {mean:.4f} against {expected:.4f} (standard error {standard_error:.4f})")
    assert abs(mean - expected) < 4 * standard_error


def test_sampled_rows_follow_the_samplers_temperature_and_top_k():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -1.0])
    params = SamplingParams(temperature=0.8, top_k=4)
    expected = torch.softmax(logits / 0.8, dim=-1)
    expected[4:] = 0.0
    expected /= expected.sum()
    rows = 100_000
    with torch.random.fork_rng():
        torch.manual_seed(5)
        result = verify(
            logits.repeat(rows * 3, 1), [[1, 4]] * rows, [params] * rows, sampler=Sampler()
        )  # token 4 lies outside the top 4: never accepted
    first = result.token_ids[:, 0]
    statistic, p_value = _chi_square(torch.bincount(first, minlength=6), expected)
    print(f"first token through verify (temperature 0.8, top-k 4): chi2 = {statistic:.2f}, p = {p_value:.3f}")
    assert p_value > 1e-3
    assert int(result.accepted_lens.max()) == 1


class _Bigram:
    """A toy target whose next-token logits depend on the last token only."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)) * 2

    def logits(self, last_tokens: list[int]) -> torch.Tensor:
        return self.table[last_tokens]


def _token_rows(prompts: list[list[int]], outputs: list[list[int]], vocab: int) -> TokenRows:
    return TokenRows(
        output_counts=torch.stack(
            [torch.bincount(torch.tensor(o, dtype=torch.int64), minlength=vocab) for o in outputs]
        ).int(),
        prompt_mask=torch.stack([torch.bincount(torch.tensor(p), minlength=vocab) > 0 for p in prompts]),
        output_lens=torch.tensor([len(o) for o in outputs]),
    )


GREEDY_CASES = {
    "plain": SamplingParams(),
    "penalties, bias, min_tokens": SamplingParams(
        repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2, logit_bias={3: 1.5}, min_tokens=6
    ),
}


@pytest.mark.parametrize("case", sorted(GREEDY_CASES))
def test_greedy_speculation_emits_what_plain_decoding_emits(case: str):
    params, vocab, steps = GREEDY_CASES[case], 12, 60
    model, sampler = _Bigram(vocab, seed=0), Sampler(eos_token_ids=[0])
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(vocab, (length,), generator=generator).tolist() for length in (3, 10, 25, 40)]
    plain: list[list[int]] = [[] for _ in prompts]
    for _ in range(steps):
        logits = model.logits([(p + o)[-1] for p, o in zip(prompts, plain)])
        tokens = sampler(logits, [params] * len(prompts), token_rows=_token_rows(prompts, plain, vocab))
        for output, token in zip(plain, tokens.tolist()):
            output.append(token)

    proposers = [NgramProposer(NgramConfig(min_n=1, max_n=3), prompt) for prompt in prompts]
    speculative: list[list[int]] = [[] for _ in prompts]
    accepted = 0
    for step in range(steps):
        drafts = [proposer.propose((step + row) % 5) for row, proposer in enumerate(proposers)]  # k: 0-4
        last = [(p + o)[-1] for p, o in zip(prompts, speculative)]
        logits = model.logits([token for row, draft in zip(last, drafts) for token in (row, *draft)])
        result = verify(
            logits,
            drafts,
            [params] * len(prompts),
            sampler=sampler,
            token_rows=_token_rows(prompts, speculative, vocab),
        )
        accepted += int(result.accepted_lens.sum())
        for output, proposer, emitted in zip(speculative, proposers, result.token_lists()):
            output.extend(emitted)
            proposer.extend(emitted)
    assert accepted > steps  # drafts were kept, not only rejected
    assert [output[:steps] for output in speculative] == plain


def test_a_greedy_row_keeps_the_drafted_tokens_that_are_the_argmax_then_emits_the_argmax():
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(0))
    best = logits.argmax(dim=-1).tolist()
    wrong = (best[2] + 1) % 10
    result = verify(logits, [[best[0], best[1], wrong]], [SamplingParams()], sampler=Sampler())
    assert result.token_lists() == [[best[0], best[1], best[2]]]
    # a draft distribution changes nothing for a greedy row
    draft_probs = torch.softmax(torch.randn(3, 10), dim=-1)
    with_q = verify(
        logits, [[best[0], best[1], wrong]], [SamplingParams()], sampler=Sampler(), draft_probs=draft_probs
    )
    assert with_q.token_lists() == result.token_lists()
    everything = verify(logits, [best[:3]], [SamplingParams()], sampler=Sampler())
    assert everything.token_lists() == [best] and int(everything.accepted_lens[0]) == 3


def test_the_greedy_shortcut_gives_what_the_rule_gives_with_point_masses():
    # random batches of greedy rows with drafts of 0 to 5 tokens, some copying the argmax for a while
    generator = torch.Generator().manual_seed(11)
    for _ in range(200):
        lens = torch.randint(
            0, 6, (int(torch.randint(1, 6, (1,), generator=generator)),), generator=generator
        )
        logits = torch.randn(int(lens.sum()) + len(lens), 7, generator=generator)
        targets = logits.argmax(dim=-1)
        width = int(lens.max())
        drafts = torch.randint(0, 7, (len(lens), width), generator=generator)
        start = 0
        for row, k in enumerate(lens.tolist()):
            copied = int(torch.randint(0, k + 1, (1,), generator=generator))
            drafts[row, :copied] = targets[start : start + copied]
            start += k + 1
        fast = greedy_verification(targets, drafts, lens)
        rule = rejection_sample(_point_masses(logits), drafts, lens, None, torch.rand(len(lens), width))
        assert torch.equal(fast.accepted_lens, rule.accepted_lens)
        assert fast.token_lists() == rule.token_lists()


def test_a_greedy_row_beside_sampled_rows_is_still_exact():
    logits = torch.randn(9, 10, generator=torch.Generator().manual_seed(4))
    best = logits[3:6].argmax(dim=-1).tolist()
    for seed in range(20):
        torch.manual_seed(seed)
        result = verify(
            logits,
            [[1, 2], [best[0], (best[1] + 1) % 10], [3, 4]],
            [SamplingParams(temperature=1.0), SamplingParams(), SamplingParams(temperature=0.5, top_p=0.9)],
            sampler=Sampler(),
        )
        assert result.token_lists()[1] == best[:2]


def test_a_bitmask_over_positions_holds_the_greedy_choice_to_the_grammar():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    best = logits.argmax(dim=-1).tolist()
    bits = torch.full((1, 2), -1, dtype=torch.int32)
    bits[0, best[1] // 32] &= ~(1 << (best[1] % 32))  # position 1 refuses its argmax
    mask = TokenBitmask(rows=torch.tensor([1]), bits=bits)
    result = verify(logits, [[best[0], best[1]]], [SamplingParams()], sampler=Sampler(), token_bitmask=mask)
    refused = logits[1].clone()
    refused[best[1]] = float("-inf")
    assert result.token_lists() == [[best[0], int(refused.argmax())]]


def test_a_seeded_row_verifies_alike_whatever_else_is_in_the_batch():
    logits = torch.randn(7, 30, generator=torch.Generator().manual_seed(3))
    seeded = SamplingParams(temperature=1.0, seed=9)
    alone = verify(
        logits[3:7],
        [[5, 6, 7]],
        [seeded],
        sampler=Sampler(),
        generators=[seeded.make_generator(torch.device("cpu"))],
    )
    batched = verify(
        logits,
        [[1, 2], [5, 6, 7]],
        [SamplingParams(temperature=0.7), seeded],
        sampler=Sampler(),
        generators=[None, seeded.make_generator(torch.device("cpu"))],
    )
    assert batched.token_lists()[1] == alone.token_lists()[0]


def test_each_position_counts_the_drafted_tokens_before_it_as_output():
    rows = TokenRows(
        output_counts=torch.tensor([[0, 1, 0, 0, 0], [2, 0, 0, 0, 0]], dtype=torch.int32),
        prompt_mask=torch.tensor([[True, False, False, False, False], [False, False, False, False, True]]),
        output_lens=torch.tensor([1, 2]),
    )
    positions = position_token_rows(rows, [[4, 4, 2], []])
    assert positions.output_counts.tolist() == [
        [0, 1, 0, 0, 0],
        [0, 1, 0, 0, 1],
        [0, 1, 0, 0, 2],
        [0, 1, 1, 0, 2],
        [2, 0, 0, 0, 0],
    ]
    assert positions.output_lens.tolist() == [1, 2, 3, 4, 2]
    assert positions.prompt_mask[:, 0].tolist() == [True, True, True, True, False]


@pytest.mark.parametrize(
    ("logit_rows", "drafts", "draft_probs", "message"),
    [
        (3, [[1], [2]], None, "4 in all"),
        (4, [[1], [9]], None, "outside the vocabulary"),
        (4, [[1], [2]], torch.zeros(3, 6), "one row per drafted token"),
    ],
)
def test_inputs_that_do_not_fit_the_layout_are_refused(
    logit_rows: int, drafts: list[list[int]], draft_probs: torch.Tensor | None, message: str
):
    with pytest.raises(ValueError, match=message):
        verify(
            torch.zeros(logit_rows, 6),
            drafts,
            [SamplingParams()] * 2,
            sampler=Sampler(),
            draft_probs=draft_probs,
        )
