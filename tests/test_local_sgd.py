"""Local SGD / DiLoCo (``parallelism=local_sgd``, sdp/parallel/local_sgd.py): its mechanism on spawned gloo ranks.

- H = 1, outer_lr = 1, no outer momentum, inner SGD with momentum equals DDP with that SGD (the inner update is
  linear in the gradient, so the mean of the updated replicas is the update by the mean gradient);
- at H = 4 the replicas differ between synchronisations and are identical right after one; the counted comm is
  one all-reduce of the parameter change (and float buffers) per H steps; an evaluation between two
  synchronisations sees the last synchronised global parameters and leaves each replica as it was;
- the outer step is torch's SGD with (Nesterov) momentum on the averaged change;
- a run checkpointed mid-period and resumed across the next synchronisation continues bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sdp.rank import checkpoint
from sdp.core.loss import loss_fn
from tests.helpers import CORE, batch, compose, config_dict, make_strategy, run_job, spawn

MLP = ["model=mlp", "dataset=digits", "model.hidden=32", "model.dim=16", "model.depth=2", "train.batch_size=8",
       "optim=sgd", "optim.optimizer.momentum=0.9", "optim.optimizer.weight_decay=0.0001"]


class _NoTimer:
    from contextlib import nullcontext

    def phase(self, _name: str):  # noqa: ANN201
        return self.nullcontext()


def _params(strategy: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in strategy.unwrapped().state_dict().items()}


def _trajectory(rank: int, world: int, config: dict, steps: int) -> list[dict[str, torch.Tensor]]:
    strategy, data, cfg = make_strategy(config, rank, world)
    out = []
    for step in range(steps):
        x, y = batch(data, cfg, step=step, rank=rank, world_size=world)
        strategy.train_step(inputs=x, targets=y, loss_fn=loss_fn, timer=_NoTimer(), step=step)
        out.append(_params(strategy))
    return out


@pytest.mark.dist
@CORE
@pytest.mark.timeout(120)
def test_h1_plain_local_sgd_equals_ddp_with_sgd() -> None:
    steps = 5
    common = [*MLP, "cluster.world_size=2", f"train.steps={steps}"]
    ddp = spawn(_trajectory, world=2, args=(config_dict([*common, "parallelism=ddp"]), steps))
    local = spawn(_trajectory, world=2, args=(config_dict([*common, "parallelism=local_sgd", "parallelism.inner_steps=1",
                                                           "parallelism.outer_lr=1", "parallelism.outer_momentum=0"]), steps))
    moved = max((ddp[0][-1][k] - ddp[0][0][k]).abs().max().item() for k in ddp[0][0])
    assert moved > 1e-3, f"DDP's parameters barely moved after step 1 ({moved}): nothing compared"
    for rank in range(2):
        for step in range(steps):
            for k, want in ddp[rank][step].items():
                torch.testing.assert_close(local[rank][step][k], want, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, k=k, step=step, rank=rank: f"rank {rank} step {step + 1} {k}: {m}")


def _periods(rank: int, world: int, config: dict, steps: int) -> dict[str, Any]:
    strategy, data, cfg = make_strategy(config, rank, world)
    comm = strategy.ctx.comm
    comm.measuring = True
    after, evaluated, kept, initial = [], None, None, _params(strategy)
    for step in range(steps):
        x, y = batch(data, cfg, step=step, rank=rank, world_size=world)
        strategy.train_step(inputs=x, targets=y, loss_fn=loss_fn, timer=_NoTimer(), step=step)
        comm.end_step()
        after.append(_params(strategy))
        if step == 1:  # between two synchronisations: evaluate, then the replica must be as it was
            with strategy.eval_module() as model:
                evaluated = {n: p.detach().clone() for n, p in model.named_parameters()}
            kept = _params(strategy)
    model = strategy.unwrapped()
    state = model.state_dict()  # the change of every parameter and the persistent float buffers, in float32
    flat_bytes = 4 * (sum(p.numel() for p in model.parameters()) + sum(b.numel() for n, b in model.named_buffers()
                                                                       if b.is_floating_point() and n in state))
    return {"initial": initial, "after": after, "evaluated": evaluated, "kept": kept, "flat_bytes": flat_bytes, "comm": comm.summary(),
            "syncs": strategy.syncs}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.dist
@CORE
@pytest.mark.timeout(120)
def test_replicas_differ_between_syncs_and_agree_after_and_comm_is_one_change_per_h_steps() -> None:
    every, steps = 4, 8
    config = config_dict([*MLP, "cluster.world_size=2", f"train.steps={steps}", "parallelism=diloco",
                          f"parallelism.inner_steps={every}"])
    got = spawn(_periods, world=2, args=(config, steps))
    a, b = got
    for step in range(steps):
        synced = (step + 1) % every == 0
        assert _equal(a["after"][step], b["after"][step]) == synced, \
            f"after step {step + 1}: replicas {'differ' if synced else 'agree'} (synchronised: {synced})"
    assert a["syncs"] == b["syncs"] == steps // every, (a["syncs"], b["syncs"])
    # evaluation between syncs: the global parameters of the last sync (the initial ones here), equal on both ranks
    assert _equal(a["evaluated"], b["evaluated"]), "the ranks evaluated different models between two synchronisations"
    for g in got:
        assert _equal(g["kept"], g["after"][1]), "evaluating between synchronisations changed the replica"
        assert _equal(g["evaluated"], {k: g["initial"][k] for k in g["evaluated"]}), \
            "evaluation before the first synchronisation did not see the global (initial) parameters"
        assert not _equal(g["evaluated"], {k: g["after"][1][k] for k in g["evaluated"]}), \
            "evaluation between synchronisations saw the rank's own replica, not the global parameters"
        c = g["comm"]
        assert c["measured_steps"] == steps, c
        assert c["bytes_per_step"] == g["flat_bytes"] / every, \
            f"comm bytes per step {c['bytes_per_step']}, one change of {g['flat_bytes']} B per {every} steps: {g['flat_bytes'] / every}"
        assert c["collectives_per_step"] == 1 / every and c["by_group_size"] == {"2": {"bytes": g["flat_bytes"] / every, "count": 1 / every}}, c


def test_the_outer_step_is_nesterov_sgd_on_the_change() -> None:
    """One rank (no collective): at each synchronisation the anchor moves as torch's SGD(nesterov=True) moves a
    copy of it whose gradient is (anchor - replica), twice, so the momentum's second use is checked too."""
    from sdp.parallel import STRATEGIES, DistContext, JobFacts
    from sdp.rank.worker import build_model
    from sdp.registry import build

    cfg = compose([*MLP, "cluster.world_size=1", "train.steps=4", "parallelism=diloco", "parallelism.inner_steps=2"])
    data = build(cfg.dataset)
    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    s = STRATEGIES.get("local_sgd").runtime(cfg=cfg.parallelism, job=JobFacts.of(cfg), ctx=ctx)
    s.setup(model=build_model(cfg, data), optimizer_factory=lambda p: build(cfg.optim.optimizer)(p))
    ref = [a.clone().requires_grad_(True) for a in s.anchor]
    outer = torch.optim.SGD(ref, lr=0.7, momentum=0.9, nesterov=True)
    params, synchronise, checked = list(s.unwrapped().parameters()), s.synchronise, []

    def spy() -> None:  # the outer gradient is taken from the replica the inner steps left
        for r, p in zip(ref, params):
            r.grad = r.detach() - p.detach()
        outer.step()
        synchronise()
        for r, a, p in zip(ref, s.anchor, params):
            torch.testing.assert_close(a, r.detach(), rtol=1e-6, atol=1e-7)
            assert torch.equal(p.detach(), a), "the replica did not take the global parameters"
        checked.append(True)

    s.synchronise = spy
    for step in range(4):
        x, y = batch(data, cfg, step=step, rank=0, world_size=1)
        s.train_step(inputs=x, targets=y, loss_fn=loss_fn, timer=_NoTimer(), step=step)
    assert len(checked) == s.syncs == 2 and s.phase == 0, (checked, s.syncs, s.phase)
    assert any(v.abs().max() > 0 for v in s.velocity), "no outer momentum accumulated: nothing checked"


def _resume(rank: int, world: int, config: dict, run_dir: str, save_at: int, steps: int) -> dict[str, Any]:
    def run(s: Any, sched: Any, data: Any, cfg: Any, first: int, last: int) -> None:
        for step in range(first, last):
            x, y = batch(data, cfg, step=step, rank=rank, world_size=world)
            s.train_step(inputs=x, targets=y, loss_fn=loss_fn, timer=_NoTimer(), step=step)
            sched.step()

    key = {"seed": 0, "global_batch": 16, "num_samples": 1}
    a, data, cfg = make_strategy(config, rank, world)
    sa = torch.optim.lr_scheduler.LambdaLR(a.optimizer, lambda k: 1.0 / (k + 1))
    run(a, sa, data, cfg, 0, save_at)
    phase = a.phase
    checkpoint.save(run_dir=Path(run_dir), step=save_at, strategy=a, scheduler=sa, train_state={"step": save_at},
                    data_key=key, keep=0)
    run(a, sa, data, cfg, save_at, steps)
    b, _, _ = make_strategy(config, rank, world)
    with torch.no_grad():  # another replica and outer state: everything must come from the checkpoint
        for p in [*b.unwrapped().parameters(), *b.anchor, *b.velocity]:
            p.add_(1.0)
    sb = torch.optim.lr_scheduler.LambdaLR(b.optimizer, lambda k: 1.0 / (k + 1))
    checkpoint.load(path=checkpoint.step_dir(Path(run_dir), save_at), strategy=b, scheduler=sb, data_key=key)
    assert b.phase == phase, (b.phase, phase)
    run(b, sb, data, cfg, save_at, steps)
    outer = lambda s: [t.clone() for t in [*s.anchor, *s.velocity]]  # noqa: E731
    return {"uninterrupted": _params(a), "resumed": _params(b), "outer": (outer(a), outer(b)), "phase": phase,
            "syncs": (a.syncs, b.syncs)}


@pytest.mark.dist
@CORE
@pytest.mark.timeout(120)
def test_resume_mid_period_across_a_sync_is_bit_identical(tmp_path: Path) -> None:
    save_at, steps = 3, 7  # H = 4: saved after step 3 (mid-period), the resumed run synchronises after step 4
    config = config_dict([*MLP, "cluster.world_size=2", f"train.steps={steps}", "parallelism=diloco",
                          "parallelism.inner_steps=4"])
    got = spawn(_resume, world=2, args=(config, str(tmp_path), save_at, steps))
    for r, g in enumerate(got):
        assert g["phase"] == 3, f"rank {r} saved at phase {g['phase']}, not mid-period"
        bad = [k for k in g["uninterrupted"] if not torch.equal(g["uninterrupted"][k], g["resumed"][k])]
        assert not bad, f"rank {r}: the resumed run left the uninterrupted one at {bad}"
        assert all(torch.equal(x, y) for x, y in zip(*g["outer"])), f"rank {r}: outer state differs after resuming"
        assert g["syncs"] == (2, 2), f"rank {r}: syncs {g['syncs']} (after step 4 and the last step 7)"
    assert _equal(got[0]["resumed"], got[1]["resumed"]), "the last step synchronised, yet the replicas differ"
    files = sorted(p.name for p in checkpoint.step_dir(tmp_path, save_at).iterdir())
    assert files == ["meta.json", "rank00000.pt", "rank00001.pt", "shared.pt"], files


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_a_run_ends_synchronised_and_its_summary_counts_each_sync(tmp_path: Path) -> None:
    """Through the launcher: 6 steps at H = 4 synchronise after steps 4 and 6 (the last), so the replicas end
    equal and summary.json's comm per step is 2 changes / 6 steps."""
    summary, _ = run_job([*MLP, "parallelism=local_sgd", "parallelism.inner_steps=4", "train.steps=6",
                          "train.warmup_steps=0", "train.eval_every=0"], world=2, run_dir=tmp_path)
    per_rank = summary["memory"]["per_rank"]
    assert len({m["param_digest"] for m in per_rank}) == 1, f"replicas differ at the end: {[m['param_digest'] for m in per_rank]}"
    assert summary["strategy_info"]["syncs"] == 2, summary["strategy_info"]
    for m, c in zip(per_rank, summary["comm"]["per_rank"]):
        assert c["bytes_per_step"] == 2 * m["param_bytes"] / 6, (c["bytes_per_step"], m["param_bytes"])
        assert m["optim_bytes"] == 2 * m["param_bytes"], f"SGD momentum + the float32 anchor: {m}"


def test_sdp_plan_predicts_the_outer_state_and_one_change_per_h_steps() -> None:
    """sdp-plan: DDP's replica plus the float32 outer state (global parameters, and the outer momentum when
    outer_momentum > 0) as optimizer state; one all-reduce of the change per H steps, as the run counts it."""
    from sdp.planning.planner import predict

    base = [*MLP, "cluster.world_size=2", "parallelism.inner_steps=4"]
    ddp = predict(compose([*MLP, "cluster.world_size=2", "parallelism=ddp"]))
    for preset, copies in (("local_sgd", 1), ("diloco", 2)):
        plan = predict(compose([*base, f"parallelism={preset}"]))
        for d, m, c in zip(ddp["memory"]["per_rank"], plan["memory"]["per_rank"], plan["comm"]["per_rank"]):
            assert m["optim_bytes"] == d["optim_bytes"] + copies * m["param_bytes"], (preset, d["optim_bytes"], m)
            assert c["bytes_per_step"] == m["param_bytes"] / 4 and c["collectives_per_step"] == 0.25, (preset, c)
            for key in ("setup_peak_bytes", "train_peak_bytes"):
                assert m[key] > copies * m["param_bytes"], (preset, key, m)
