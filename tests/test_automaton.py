"""The automaton task (``dataset=automaton``, sdp/data/automaton.py): each target is the cell after the sequence's
own k steps of the rule, recomputed here cell by cell for 1, 2 and 3 neighbours, dense and sparse; the k-token's
target is unscored; both sets follow from the seed and the rule from its seed (``density=None``: the draw of before
the key); a sparse table's zeros match its density and its targets stay uniform; a vocabulary that cannot hold the
tokens, a neighbourhood or density out of range are one-line errors naming the key."""

from __future__ import annotations

import pytest
import torch

from sdp.data.automaton import build, rule, sequences
from sdp.data.base import IGNORE_INDEX
from sdp.errors import ConfigError


def _step(row: list[int], *, h: torch.Tensor) -> list[int]:
    """One step of the rule on a Python list, cell by cell: cell t reads its h.dim() left neighbours (cells left of
    the row read 0)."""
    n = h.dim()
    padded = [0] * n + row
    return [(row[t] + int(h[tuple(padded[t:t + n])])) % h.shape[0] for t in range(len(row))]


@pytest.mark.parametrize(("neighbours", "density"), [(2, None), (1, None), (3, None), (2, 0.3), (3, 0.5)])
def test_every_target_is_the_row_after_its_k_steps(neighbours: int, density: float | None) -> None:
    h = rule(symbols=4, rule_seed=3, neighbours=neighbours, density=density)
    assert h.shape == (4,) * neighbours, h.shape
    x, y, k = sequences(n=40, seed=1, seq_len=20, symbols=4, max_steps=6, h=h)
    assert set(k.tolist()) == set(range(1, 7)), k  # every k of 1..max_steps is drawn
    for i in range(len(x)):
        assert int(x[i, 0]) == 4 + int(k[i]) - 1 and int(y[i, 0]) == IGNORE_INDEX, (x[i], y[i])
        row = x[i, 1:].tolist()
        for _ in range(int(k[i])):
            row = _step(row, h=h)
        assert y[i, 1:].tolist() == row, (i, int(k[i]))


def test_the_rule_is_permutive_so_every_symbol_stays_equally_likely() -> None:
    """x'_t = x_t + h(..) mod symbols: for fixed neighbours the step is a bijection of x_t, so uniform rows stay
    uniform after any k (chance is log(symbols) nats at every k)."""
    h = rule(symbols=4, rule_seed=0)
    x, y, _ = sequences(n=4000, seed=0, seq_len=32, symbols=4, max_steps=8, h=h)
    counts = torch.bincount(y[:, 1:].flatten(), minlength=4).double()
    assert (counts / counts.sum() - 0.25).abs().max() < 0.01, counts


def test_both_sets_follow_from_the_seeds() -> None:
    kw = dict(seq_len=16, vocab_size=12, symbols=4, max_steps=8, num_samples=32, num_val=16)
    a, b = build(rule_seed=0, seed=2, **kw), build(rule_seed=0, seed=2, **kw)
    other_rule, other_data = build(rule_seed=1, seed=2, **kw), build(rule_seed=0, seed=3, **kw)
    assert torch.equal(a.train.tensors[1], b.train.tensors[1]) and torch.equal(a.val.tensors[0], b.val.tensors[0])
    assert torch.equal(a.train.tensors[0], other_rule.train.tensors[0])  # same rows and k ...
    assert not torch.equal(a.train.tensors[1], other_rule.train.tensors[1])  # ... another rule's targets
    assert not torch.equal(a.train.tensors[0], other_data.train.tensors[0])
    assert not torch.equal(a.train.tensors[0][:16], a.val.tensors[0]), "validation is its own stream"


def test_a_vocabulary_that_cannot_hold_the_tokens_is_one_line_naming_the_key() -> None:
    with pytest.raises(ConfigError) as err:
        build(seq_len=16, vocab_size=11, symbols=4, max_steps=8, rule_seed=0, num_samples=4, num_val=4, seed=0)
    assert str(err.value).startswith("dataset.vocab_size") and "\n" not in str(err.value), err.value


def test_no_density_is_the_draw_of_before_the_key_bit_for_bit() -> None:
    """Runs recorded before ``neighbours``/``density`` existed rebuild the same table (the literal old draw)."""
    for symbols, seed in ((4, 0), (4, 3), (7, 11)):
        old = torch.randint(symbols, (symbols, symbols), generator=torch.Generator().manual_seed(seed))
        assert torch.equal(rule(symbols=symbols, rule_seed=seed), old), (symbols, seed)
        assert torch.equal(rule(symbols=symbols, rule_seed=seed, neighbours=2, density=None), old), (symbols, seed)


def test_density_one_changes_every_cell() -> None:
    h = rule(symbols=5, rule_seed=2, neighbours=3, density=1.0)
    assert h.shape == (5, 5, 5) and bool((h > 0).all()) and bool((h < 5).all()), h


def test_a_sparse_table_keeps_a_cell_with_probability_one_minus_density_and_targets_stay_uniform() -> None:
    q, symbols = 0.3, 16
    h = rule(symbols=symbols, rule_seed=1, neighbours=3, density=q)
    n = h.numel()
    assert n == 4096 and bool((h >= 0).all()) and bool((h < symbols).all()), (n, h.min(), h.max())
    zeros = float((h == 0).double().mean())
    sigma = ((1 - q) * q / n) ** 0.5  # binomial fraction's standard deviation
    assert abs(zeros - (1 - q)) < 5 * sigma, (zeros, 1 - q, sigma)
    nonzero = torch.bincount(h[h > 0].flatten(), minlength=symbols)
    assert nonzero[0] == 0 and bool((nonzero[1:] > 0).all()), nonzero  # every nonzero shift is drawn
    _, y, _ = sequences(n=2000, seed=0, seq_len=32, symbols=symbols, max_steps=8, h=h)
    counts = torch.bincount(y[:, 1:].flatten(), minlength=symbols).double()
    p = 1 / symbols  # a step is a bijection of the row (solve x_t left to right), so after k the cells are iid uniform
    assert (counts / counts.sum() - p).abs().max() < 5 * (p * (1 - p) / counts.sum()) ** 0.5, counts


def test_the_largest_table_allowed_is_two_to_the_twenty() -> None:
    assert rule(symbols=32, rule_seed=0, neighbours=4, density=0.5).numel() == 2**20


@pytest.mark.parametrize(("kw", "key"), [
    (dict(neighbours=0), "dataset.neighbours"), (dict(neighbours=5), "dataset.neighbours"),
    (dict(neighbours=2.0), "dataset.neighbours"), (dict(symbols=64, neighbours=4), "dataset.neighbours"),
    (dict(density=0.0), "dataset.density"), (dict(density=1.5), "dataset.density"),
    (dict(density=-0.1), "dataset.density"), (dict(density=True), "dataset.density")])
def test_a_neighbourhood_or_density_out_of_range_is_one_line_naming_the_key(kw: dict, key: str) -> None:
    args = dict(seq_len=16, vocab_size=72, symbols=4, max_steps=8, rule_seed=0, num_samples=4, num_val=4, seed=0)
    with pytest.raises(ConfigError) as err:
        build(**{**args, **kw})
    msg = str(err.value)
    assert msg.startswith(key) and "\n" not in msg and repr(kw.get(key.split(".")[1])) in msg, msg
