"""The automaton task (``dataset=automaton``, sdp/data/automaton.py): each target is the cell after the sequence's
own k steps of the rule, recomputed here cell by cell; the k-token's target is unscored; both sets follow from the
seed and the rule from its seed; a vocabulary that cannot hold the tokens is a one-line error naming the key."""

from __future__ import annotations

import pytest
import torch

from sdp.data.automaton import build, rule, sequences
from sdp.data.base import IGNORE_INDEX
from sdp.errors import ConfigError


def _step(row: list[int], *, h: torch.Tensor) -> list[int]:
    """One step of the rule on a Python list, cell by cell (cells left of the row read 0)."""
    padded = [0, 0, *row]
    return [(padded[t + 2] + int(h[padded[t], padded[t + 1]])) % h.shape[0] for t in range(len(row))]


def test_every_target_is_the_row_after_its_k_steps() -> None:
    h = rule(symbols=4, rule_seed=3)
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
