"""Pointer chasing: a language task where depth pays by construction (the CPU LM study's depth gate, issue 38).

Why: on byte-level text a shallower model given more steps at equal FLOPs is as good as a deeper one, so a
comparison of methods that compute fewer blocks per step (SDP, the drop baselines) with DDP on all of them says
nothing about depth there. Here each sequence is a small program of variable bindings, and a query's answer is
reached only by following bindings one after another:

    a b  c 7  b c  ...  |  a 7  c 7  ...
    `-- program: chunks "name rhs" in shuffled order --' sep `-- queries "name answer" --'

``chains`` chains of ``hops`` names each (``n1 -> n2 -> ... -> n_hops -> digit``, names drawn without
replacement per sequence, so nothing can be memorised across sequences) are written as chunks of two tokens
(a name and its right-hand side: the next name, or the chain's digit for the last) in a random order; after a
separator come ``queries`` pairs (a name of the program, its chain's digit). Only the query names' positions are
scored (their target: the digit; every other target is :data:`sdp.data.base.IGNORE_INDEX`): a query ``k``
bindings from its chain's end needs ``k`` lookups in sequence, each one attention step (find the chunk whose
name is the current right-hand side), so a model of ``L`` blocks follows about ``L - 1`` of them one per block
or ``2^(L-2)`` by pointer doubling (Sanford, Hsu & Telgarsky 2024, "Transformers, parallel computation, and
logarithmic depth"); more steps cannot buy a lookup the depth cannot make. Every sequence scores the same
number of positions (``queries``), so a mean of shards' means is the batch's mean.

Deterministic: the training and validation sets follow from ``seed`` alone (two disjoint generator streams),
so every method and every seed of a study reads the same sequences; a run's ``seed`` orders them.
Token ids: names ``[0, names)``, digits ``[names, names + values)``, the separator, then padding.
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from sdp.data.base import IGNORE_INDEX, DataBundle, EvalGroups
from sdp.errors import require


def tokens_needed(*, names: int, values: int) -> int:
    """The vocabulary the task uses: names, digits, the separator and padding."""
    return names + values + 2


def programs(*, n: int, seed: int, seq_len: int, names: int, values: int, chains: int, hops: int,
             queries: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(inputs, targets, lookups)`` of ``n`` sequences of ``seq_len`` tokens drawn from ``seed``: ``lookups``
    is, at each scored position, how many bindings its answer is away (1..``hops``), 0 elsewhere."""
    g = torch.Generator().manual_seed(seed)
    sep, pad = names + values, names + values + 1
    chain_names = torch.rand(n, names, generator=g).argsort(dim=1)[:, : chains * hops].view(n, chains, hops)
    digits = names + torch.randint(values, (n, chains), generator=g)
    rhs = torch.cat([chain_names[:, :, 1:], digits[:, :, None]], dim=2)
    chunks = torch.stack([chain_names, rhs], dim=3).view(n, chains * hops, 2)
    order = torch.rand(n, chains * hops, generator=g).argsort(dim=1)
    program = chunks.gather(1, order[:, :, None].expand(-1, -1, 2)).reshape(n, -1)
    q_chain = torch.randint(chains, (n, queries), generator=g)
    q_index = torch.randint(hops, (n, queries), generator=g)
    q_name = chain_names.view(n, -1).gather(1, q_chain * hops + q_index)
    q_digit = digits.gather(1, q_chain)
    body = torch.cat([program, torch.full((n, 1), sep), torch.stack([q_name, q_digit], dim=2).view(n, -1)], dim=1)
    seq = torch.full((n, seq_len + 1), pad, dtype=torch.long)
    seq[:, : body.shape[1]] = body
    at = program.shape[1] + 1 + 2 * torch.arange(queries)  # the query names' positions
    targets = torch.full((n, seq_len), IGNORE_INDEX, dtype=torch.long)
    targets[:, at] = q_digit
    lookups = torch.zeros((n, seq_len), dtype=torch.long)
    lookups[:, at] = hops - q_index
    return seq[:, :-1].contiguous(), targets, lookups


def build(*, seq_len: int, vocab_size: int, names: int, values: int, chains: int, hops: int, queries: int,
          num_samples: int, num_val: int, seed: int) -> DataBundle:
    """The task's bundle (``dataset=pointer``); every rule of several keys is checked here, naming the keys."""
    need = 2 * chains * hops + 1 + 2 * queries  # program, separator, queries (their last digit is never an input)
    require(need - 1 <= seq_len, "dataset.seq_len", seq_len,
            f">= {need - 1} tokens for dataset.chains={chains} x dataset.hops={hops} bindings and "
            f"dataset.queries={queries} queries (2 tokens each, plus the separator)")
    require(chains * hops <= names, "dataset.names", names,
            f">= dataset.chains x dataset.hops = {chains * hops} (a sequence's names are distinct)")
    require(vocab_size >= tokens_needed(names=names, values=values), "dataset.vocab_size", vocab_size,
            f">= dataset.names + dataset.values + 2 = {tokens_needed(names=names, values=values)}")
    shape = dict(seq_len=seq_len, names=names, values=values, chains=chains, hops=hops, queries=queries)
    x, y, _ = programs(n=num_samples, seed=seed, **shape)
    xv, yv, lookups = programs(n=num_val, seed=seed + 1_000_003, **shape)  # a disjoint stream: no shared draw
    # each scored query in the group of the lookups it needs (unscored positions: 0 lookups, never read)
    groups = EvalGroups(name="lookups", labels=tuple(str(k) for k in range(1, hops + 1)), ids=(lookups - 1).clamp(min=0))
    return DataBundle(train=TensorDataset(x, y), val=TensorDataset(xv, yv), task="lm", num_classes=vocab_size,
                      input_shape=(seq_len,), eval_groups=groups,
                      notes=(f"pointer chasing: {chains} chains of {hops} bindings, {queries} scored queries per "
                             f"sequence ({names} names, {values} digits), seed {seed}",))
