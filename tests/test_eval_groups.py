"""The validation loss by a task's difficulty group (``eval_loss_by_group``, :class:`sdp.data.base.EvalGroups`):
automaton's k and pointer's lookups. The groups' losses weighted by their counts are the mean loss; each group's
loss is that of exactly its samples (a model whose loss differs by group by construction, the reference grouped
from the inputs, not from the ids), whole and part by part, one process and sharded over ranks; 2 gloo ranks
through the trainer equal one process's evaluation of the same weights; summary.json keeps the field."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from sdp.data import automaton, pointer
from sdp.data.base import IGNORE_INDEX, DataBundle
from sdp.rank.eval_ops import ordered_sum, val_totals
from sdp.rank.evaluation import result

AUTOMATON = dict(seq_len=12, vocab_size=10, symbols=4, max_steps=5, rule_seed=0, num_samples=32, num_val=23, seed=0,
                 neighbours=2, density=None)
POINTER = dict(seq_len=24, vocab_size=24, names=12, values=6, chains=2, hops=3, queries=4, num_samples=32,
               num_val=23, seed=0)


class ByToken(nn.Module):
    """Logits that are a fixed function of each position's token (and of the sequence's first token, automaton's
    k-token): each group's loss then differs by construction, so ids that do not follow their samples show."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.table = nn.Parameter(torch.randn(vocab, vocab, generator=g))
        self.first = nn.Parameter(3.0 * torch.randn(vocab, vocab, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table[x] + self.first[x[:, :1]]


class Parts:
    """:class:`sdp.rank.eval_parts.Partwise` of ``ByToken`` in two parts (the logits, then the identity)."""

    has_batch_norm = False

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __len__(self) -> int:
        return 2

    def part(self, i: int) -> nn.Module:
        return self.model if i == 0 else nn.Identity()


def reference(model: nn.Module, data: DataBundle, groups: torch.Tensor) -> dict[str, float]:
    """Each group's mean loss over the whole validation set in one forward, grouped by ``groups`` (per target)."""
    x, y = data.val.tensors  # type: ignore[attr-defined]
    with torch.no_grad():
        per = F.cross_entropy(model(x).reshape(-1, model.table.shape[0]), y.reshape(-1), reduction="none").double()
    keep, g = y.reshape(-1) != IGNORE_INDEX, groups.reshape(-1)
    labels = data.eval_groups.labels  # type: ignore[union-attr]
    return {lab: float(per[keep & (g == i)].mean()) for i, lab in enumerate(labels) if bool((keep & (g == i)).any())}


def bundle_and_groups(task: str) -> tuple[DataBundle, torch.Tensor]:
    """The task's bundle and each validation target's group, from the inputs or the generator, not from ``ids``."""
    if task == "automaton":
        data = automaton.build(**AUTOMATON)
        x = data.val.tensors[0]  # type: ignore[attr-defined]
        k = x[:, 0] - AUTOMATON["symbols"]  # the k-token: symbols + k - 1
        return data, k[:, None].expand(-1, AUTOMATON["seq_len"])
    data = pointer.build(**POINTER)
    shape = {k: v for k, v in POINTER.items() if k not in ("vocab_size", "num_samples", "num_val", "seed")}
    _, _, lookups = pointer.programs(n=POINTER["num_val"], seed=POINTER["seed"] + 1_000_003, **shape)
    return data, lookups - 1


@pytest.mark.parametrize("task", ["automaton", "pointer"])
def test_each_groups_loss_is_its_samples_and_the_counts_weight_them_back_to_the_mean(task: str) -> None:
    """Sharded over 3 ranks in batches of 4 (shards and batches uneven), whole and part by part: each group's
    loss equals the one-forward reference grouped from the inputs; count-weighted, the groups give eval_loss."""
    from sdp.core.distctx import DistContext
    from sdp.rank.eval_parts import partwise_totals

    data, groups = bundle_and_groups(task)
    model = ByToken(int(data.num_classes))
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    ref = reference(model, data, groups)
    assert len(set(round(v, 3) for v in ref.values())) == len(ref) > 1, f"groups must differ by construction: {ref}"
    whole = ordered_sum([val_totals(model, data=data, rank=r, world_size=3, batch_size=4, num_workers=0,
                                    device=ctx.device) for r in range(3)])
    parts = ordered_sum([partwise_totals(Parts(model), bn="average", bn_batches=lambda: iter(()), ctx=ctx, data=data,
                                         rank=r, world_size=3, batch_size=4, num_workers=0, part_batches=2)
                         for r in range(3)])
    assert torch.equal(whole, parts), (whole, parts)
    res = result(values={"full": whole.tolist()}, classify=False, groups=data.eval_groups)
    by = res.eval_loss_by_group
    print(task, by, res.eval_loss)
    assert by is not None and by["name"] == ("k" if task == "automaton" else "lookups"), by
    got = {k: v for k, v in by["loss"].items() if v is not None}
    assert got.keys() == ref.keys() and all(got[k] == pytest.approx(ref[k], rel=1e-6) for k in ref), (got, ref)
    assert sum(by["count"].values()) == int(whole[2]), (by["count"], whole)
    weighted = sum(by["loss"][k] * c for k, c in by["count"].items() if c) / sum(by["count"].values())
    # eval_loss adds float32 chunk sums (loss_and_correct), the groups float64 per-target losses: float32's rounding
    assert weighted == pytest.approx(res.eval_loss, rel=1e-6), (weighted, res.eval_loss)


def test_a_dataset_without_groups_keeps_three_totals_and_reports_none() -> None:
    data = automaton.build(**AUTOMATON)
    plain = DataBundle(train=data.train, val=data.val, task="lm", num_classes=data.num_classes,
                       input_shape=data.input_shape)
    t = val_totals(ByToken(int(data.num_classes)), data=plain, rank=0, world_size=1, batch_size=8, num_workers=0,
                   device=torch.device("cpu"))
    assert t.shape == (3,), t
    assert result(values={"full": t.tolist()}, classify=False).eval_loss_by_group is None


def test_ids_that_do_not_index_the_validation_targets_are_refused() -> None:
    from sdp.data.base import EvalGroups

    data = automaton.build(**AUTOMATON)
    with pytest.raises(AssertionError, match="do not index the validation targets"):
        DataBundle(train=data.train, val=data.val, task="lm", num_classes=10, input_shape=(12,),
                   eval_groups=EvalGroups(name="k", labels=("1",), ids=torch.zeros(5, dtype=torch.long)))
    with pytest.raises(AssertionError, match="scored ids span"):
        DataBundle(train=data.train, val=data.val, task="lm", num_classes=10, input_shape=(12,),
                   eval_groups=EvalGroups(name="k", labels=("1",), ids=torch.ones(23, dtype=torch.long)))


def test_summary_final_keeps_the_groups_as_written() -> None:
    """The metrics row's breakdown reaches summary.json's ``final`` and reads back unchanged."""
    from sdp.results.evalresult import EvalResult
    from sdp.results.summary import Final, Summary

    by = {"name": "k", "loss": {"1": 0.5, "2": None}, "count": {"1": 10, "2": 0}}
    row = EvalResult(eval_loss=0.5, eval_loss_by_group=by).row()
    assert row["eval_loss_by_group"] == by, row
    final = Final.of({**row, "train_loss": 1.0})
    again = Summary.from_json(Summary(final=final).to_json())
    assert again.final.eval_loss_by_group == by and "eval_loss_by_group" not in again.final.extra, again.final


LLAMA = ["model=llama_tiny", "model.dim=32", "model.hidden=64", "model.n_layers=2", "dataset=automaton",
         *(f"dataset.{k}={'null' if v is None else v}" for k, v in AUTOMATON.items()), "optim=adamw",
         "train.batch_size=4", "train.steps=2", "train.warmup_steps=0", "train.eval_every=0", "train.eval_batch_size=5",
         "cluster.world_size=2"]


def _rows(rank: int, world: int, configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per config: the trainer's last evaluation on this rank, and one process's evaluation of the same final
    weights (DDP's; an SDP worker holds a subnetwork only)."""
    from sdp.metrics.timing import PhaseTimer
    from sdp.rank.trainer import Trainer
    from sdp.results.loggers import NullLogger
    from tests.helpers import make_strategy

    out: dict[str, Any] = {}
    for name, config in configs.items():
        strategy, data, cfg = make_strategy(config, rank, world)
        out[name] = Trainer(cfg=cfg, strategy=strategy, data=data, logger=NullLogger(),
                            timer=PhaseTimer(device=strategy.ctx.device)).fit().last_eval
        if name == "ddp":
            one = val_totals(strategy.unwrapped(), data=data, rank=0, world_size=1, batch_size=7, num_workers=0,
                             device=torch.device("cpu"))
            out["one"] = result(values={"full": one.tolist()}, classify=False, groups=data.eval_groups)
    return out


@pytest.mark.dist
@pytest.mark.core
@pytest.mark.timeout(300)
def test_two_ranks_give_one_process_groups() -> None:
    """DDP on 2 gloo ranks, 23 validation sequences (shards of 12 and 11) in batches of 5: the trainer's per-k
    losses and counts equal one process's evaluation of the same weights in batches of 7. Forward-masked SDP
    (C = 0.5, its workers' own subnetworks evaluated): the assembled model's groups and the workers' weight back
    to eval_loss and eval_loss_workers."""
    from tests.helpers import config_dict, spawn

    configs = {"ddp": config_dict([*LLAMA, "parallelism=ddp"]),
               "sdp": config_dict([*LLAMA, "parallelism=sdp", "parallelism.coverage=0.5", "eval.subnetworks=true"])}
    got = spawn(_rows, world=2, args=(configs,))
    for r, out in enumerate(got):
        ddp, one = out["ddp"], out["one"]
        by = ddp["eval_loss_by_group"]
        print(f"rank {r}: trainer {by}\n        one process {one.eval_loss_by_group}")
        assert by["count"] == one.eval_loss_by_group["count"], (by, one)
        assert sum(by["count"].values()) == 23 * (AUTOMATON["seq_len"] - 1), by  # every cell but the k-token
        assert all(by["loss"][k] == pytest.approx(v, rel=1e-5) for k, v in one.eval_loss_by_group["loss"].items()), \
            (by, one)
        assert ddp["eval_loss"] == pytest.approx(one.eval_loss, rel=1e-5), (ddp, one)
        assert by == got[0]["ddp"]["eval_loss_by_group"], "every rank reports the same groups"
        sdp = out["sdp"]["eval_loss_by_group"]
        print(f"rank {r}: SDP {sdp}")
        n = sum(sdp["count"].values())
        for key, mean in (("loss", out["sdp"]["eval_loss"]), ("workers", out["sdp"]["eval_loss_workers"])):
            weighted = sum(sdp[key][k] * c for k, c in sdp["count"].items() if c) / n
            assert weighted == pytest.approx(mean, rel=1e-6), (key, weighted, mean, sdp)  # float32 chunk sums
