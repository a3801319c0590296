"""A causal cellular automaton run for k steps: a sequence task whose depth need grows with k (issue 38's gate).

Why: on byte-level text a shallower model given more steps at equal FLOPs is as good as a deeper one; in-context
retrieval tasks (:mod:`sdp.data.pointer`) do need depth but are not learnt at all in a CPU budget. Here every
position is scored and the rule is local, so one step is learnt fast; what a shallow model cannot do is run it
many times in sequence.

A row ``x`` of ``cells`` symbols in ``[0, symbols)`` is updated by a fixed, permutive, causal rule that reads the
``n = neighbours`` cells left of each cell: ``x'_t = (x_t + h[x_{t-n}, .., x_{t-1}]) mod symbols`` (``h``: a random
table of ``symbols^n`` entries drawn from ``rule_seed``; cells left of the row read 0). ``density`` decides how
often a step changes a cell: ``None`` draws every entry of ``h`` uniformly (a cell keeps its value only by chance),
a ``q`` in (0, 1] makes an entry a nonzero shift with probability ``q`` and 0 otherwise. Why sparse: a model that
runs fewer steps than k still earns partial credit (a cell often keeps its value), so gradient descent can learn
step after step instead of needing the exact k-fold composition at once.

Each sequence is ``[k-token, x_1 .. x_T]`` with ``k`` drawn uniformly from ``1..max_steps``; the target at cell
``t`` is the row after ``k`` steps (the k-token's own target is unscored, :data:`sdp.data.base.IGNORE_INDEX`). One
step is one local lookup (attention to the n left neighbours, the MLP applies ``h``), so a model of L blocks runs
about L steps (or, having memorised the ``symbols^(n j + 1)``-entry table of j steps, j per block); a cell after k
steps depends on ``n k + 1`` cells and, the rule being permutive in ``x_t`` (at any density), every target is
uniform over the symbols: chance is ``log(symbols)`` nats for every k.

Deterministic: the training and validation sets follow from ``seed`` (two disjoint generator streams) and the
rule from ``rule_seed`` (``density=None`` is the draw of the 2-neighbour rule before ``density`` existed, so runs
recorded then rebuild the same table). Token ids: symbols ``[0, symbols)``, then the k-tokens ``symbols + k - 1``.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from sdp.data.base import IGNORE_INDEX, DataBundle, EvalGroups
from sdp.errors import require

MAX_NEIGHBOURS = 4
MAX_TABLE = 2**20  # entries of h: a table this size is already far beyond what a model memorises


def rule(*, symbols: int, rule_seed: int, neighbours: int = 2, density: float | None = None) -> torch.Tensor:
    """``h``: the table (``neighbours`` dims of size ``symbols``) added to a cell from its left neighbours; dense
    (``density=None``) or a nonzero shift with probability ``density``, from one generator seeded ``rule_seed``."""
    require(isinstance(neighbours, int) and not isinstance(neighbours, bool) and 1 <= neighbours <= MAX_NEIGHBOURS,
            "dataset.neighbours", neighbours, f"must be an integer in [1, {MAX_NEIGHBOURS}]")
    require(symbols**neighbours <= MAX_TABLE, "dataset.neighbours", neighbours,
            f"the rule's table of dataset.symbols^neighbours = {symbols}^{neighbours} = {symbols**neighbours} "
            f"entries must be <= 2^20 = {MAX_TABLE}")
    require(density is None or (isinstance(density, (int, float)) and not isinstance(density, bool)
                                and 0 < density <= 1), "dataset.density", density, "must be null or a number in (0, 1]")
    shape = (symbols,) * neighbours
    g = torch.Generator().manual_seed(rule_seed)
    if density is None:
        return torch.randint(symbols, shape, generator=g)
    return torch.randint(1, symbols, shape, generator=g) * (torch.rand(shape, generator=g) < density)


def run(x: torch.Tensor, *, h: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The rows ``x`` (n, T) after 0, 1, .., ``steps`` steps of the rule ``h`` (it reads ``h.dim()`` neighbours)."""
    n, cells = h.dim(), x.shape[1]
    rows = [x]
    zeros = torch.zeros(x.shape[0], n, dtype=x.dtype)
    for _ in range(steps):
        padded = torch.cat([zeros, rows[-1]], dim=1)  # cell t's neighbour t - n + i sits at padded column t + i
        rows.append((rows[-1] + h[tuple(padded[:, i:i + cells] for i in range(n))]) % h.shape[0])
    return rows


def sequences(*, n: int, seed: int, seq_len: int, symbols: int, max_steps: int,
              h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(inputs, targets, steps)`` of ``n`` sequences drawn from ``seed``; ``steps``: each sequence's k."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(symbols, (n, seq_len - 1), generator=g)
    k = torch.randint(1, max_steps + 1, (n,), generator=g)
    after = torch.stack(run(x, h=h, steps=max_steps), dim=1)[torch.arange(n), k]
    inputs = torch.cat([(symbols + k - 1)[:, None], x], dim=1)
    targets = torch.cat([torch.full((n, 1), IGNORE_INDEX), after], dim=1)
    return inputs, targets, k


def build(*, seq_len: int, vocab_size: int, symbols: int, max_steps: int, rule_seed: int, num_samples: int,
          num_val: int, seed: int, neighbours: int = 2, density: float | None = None) -> DataBundle:
    """The task's bundle (``dataset=automaton``); the rule of several keys (the vocabulary, the table's size)
    checked here and in :func:`rule`."""
    require(vocab_size >= symbols + max_steps, "dataset.vocab_size", vocab_size,
            f">= dataset.symbols + dataset.max_steps = {symbols + max_steps} (the symbols and one token per k)")
    h = rule(symbols=symbols, rule_seed=rule_seed, neighbours=neighbours, density=density)
    shape = dict(seq_len=seq_len, symbols=symbols, max_steps=max_steps, h=h)
    x, y, _ = sequences(n=num_samples, seed=seed, **shape)
    xv, yv, kv = sequences(n=num_val, seed=seed + 1_000_003, **shape)  # a disjoint stream
    # every scored cell of a sequence in its k's group: the loss by k says how many steps a depth runs
    groups = EvalGroups(name="k", labels=tuple(str(k) for k in range(1, max_steps + 1)), ids=kv - 1)
    sparsity = "dense" if density is None else f"density {density:g}"
    return DataBundle(train=TensorDataset(x, y), val=TensorDataset(xv, yv), task="lm", num_classes=vocab_size,
                      input_shape=(seq_len,), eval_groups=groups,
                      notes=(f"automaton: {symbols} symbols, {neighbours} neighbours, {sparsity}, k = 1..{max_steps} "
                             f"steps of rule {rule_seed}, seed {seed}",))
