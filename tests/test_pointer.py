"""The pointer-chasing task (``dataset=pointer``, sdp/data/pointer.py) and the unscored targets it relies on
(``IGNORE_INDEX``, sdp/data/base.py): every scored target is the digit reached by following the sequence's own
bindings, in exactly the number of lookups recorded; both sets follow from the seed alone; bad shapes are one-line
errors naming the key; and the training loss, the evaluation's totals and the ensemble's all skip unscored
targets (a mean over scored positions, not over every position)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from sdp.core.loss import loss_and_correct, loss_fn, scored
from sdp.data.base import IGNORE_INDEX
from sdp.data.pointer import build, programs, tokens_needed
from sdp.errors import ConfigError

SHAPE = dict(seq_len=64, names=32, values=10, chains=3, hops=4, queries=13)


def _follow(x: list[int], *, name: int, names: int, sep: int) -> tuple[int, int]:
    """The digit reached from ``name`` through the program before ``sep`` (chunks "name rhs"), and the lookups."""
    program = x[: x.index(sep)]
    binding = {program[i]: program[i + 1] for i in range(0, len(program), 2)}
    assert len(binding) == len(program) // 2, f"a name is bound twice: {program}"
    steps, at = 0, name
    while at < names:
        at, steps = binding[at], steps + 1
    return at, steps


def test_every_scored_target_is_reached_by_following_the_bindings_in_the_recorded_lookups() -> None:
    x, y, lookups = programs(n=64, seed=3, **SHAPE)
    sep = SHAPE["names"] + SHAPE["values"]
    n_scored = 0
    for row in range(len(x)):
        xs = x[row].tolist()
        for pos in (y[row] != IGNORE_INDEX).nonzero().flatten().tolist():
            digit, steps = _follow(xs, name=xs[pos], names=SHAPE["names"], sep=sep)
            assert (digit, steps) == (int(y[row, pos]), int(lookups[row, pos])), (row, pos, digit, steps)
            n_scored += 1
        assert int((y[row] != IGNORE_INDEX).sum()) == SHAPE["queries"], (row, y[row])
    assert n_scored == 64 * SHAPE["queries"]
    seen = set(lookups[lookups > 0].tolist())
    assert seen == set(range(1, SHAPE["hops"] + 1)), f"every lookup count 1..hops is asked: {seen}"
    assert int(x.max()) < tokens_needed(names=SHAPE["names"], values=SHAPE["values"]), int(x.max())


def test_both_sets_follow_from_the_seed_alone_and_differ() -> None:
    a = build(vocab_size=64, num_samples=32, num_val=16, seed=5, **SHAPE)
    b = build(vocab_size=64, num_samples=32, num_val=16, seed=5, **SHAPE)
    c = build(vocab_size=64, num_samples=32, num_val=16, seed=6, **SHAPE)
    assert torch.equal(a.train.tensors[0], b.train.tensors[0]) and torch.equal(a.val.tensors[1], b.val.tensors[1])
    assert not torch.equal(a.train.tensors[0], c.train.tensors[0])
    assert not torch.equal(a.train.tensors[0][:16], a.val.tensors[0]), "validation is its own stream"
    assert a.task == "lm" and a.input_shape == (64,) and a.num_classes == 64


@pytest.mark.parametrize(("change", "key"), [({"seq_len": 40}, "dataset.seq_len"), ({"names": 8}, "dataset.names"),
                                             ({"vocab_size": 40}, "dataset.vocab_size")])
def test_a_shape_that_cannot_hold_the_task_is_one_line_naming_the_key(change: dict, key: str) -> None:
    kwargs = {**SHAPE, "vocab_size": 64, "num_samples": 4, "num_val": 4, "seed": 0, **change}
    with pytest.raises(ConfigError) as err:
        build(**kwargs)
    message = str(err.value)
    assert message.startswith(key) and "\n" not in message, message


def test_losses_and_evaluation_totals_skip_unscored_targets() -> None:
    torch.manual_seed(0)
    out, target = torch.randn(4, 6, 9), torch.randint(0, 9, (4, 6))
    target[:, ::2] = IGNORE_INDEX  # half the positions unscored
    keep = target != IGNORE_INDEX
    reference = F.cross_entropy(out[keep], target[keep])
    assert torch.allclose(loss_fn(out, target), reference), (loss_fn(out, target), reference)
    total, correct = loss_and_correct(out, target, chunk=5)
    assert int(scored(target)) == 12 and torch.allclose(total / scored(target), reference.double()), total
    assert int(correct) == int((out[keep].argmax(-1) == target[keep]).sum()), correct


def test_the_ensembles_totals_skip_unscored_targets() -> None:
    from sdp.parallel import DistContext
    from sdp.rank.eval_ensemble import add_batch

    torch.manual_seed(1)
    out, target = torch.randn(3, 5, 7), torch.randint(0, 7, (3, 5))
    target[:, 1::2] = IGNORE_INDEX
    keep = target != IGNORE_INDEX
    totals = torch.zeros(3, dtype=torch.float64)
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    add_batch(totals, out, target, ctx=ctx, argmax=True, chunk=4)
    ce = F.cross_entropy(out[keep].double(), target[keep], reduction="sum")
    assert torch.allclose(totals[0], ce) and int(totals[2]) == int(keep.sum()), (totals, ce)
