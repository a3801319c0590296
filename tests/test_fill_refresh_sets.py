"""Assembly sends a piece only to the ranks that lack it: :func:`sdp.subnet.assemble.fill` broadcasts each piece
from its lowest holder over its holder set's refresh set (that holder and the non-holders), not over the world.

Why a test of its own: broadcast over the world, every other holder received values it already held (traffic, and
a collective over the world where a subgroup is what is needed) and the assembled model came out the same, so no
equivalence test could see it. Here, on 4 gloo ranks, block-level forward-masked SDP at C = 0.5 (k = 2: several
holder sets, each with holders that are not its source), each rank's held values are first set apart from their
initial ones (the same offset on every holder, so a received value shows where it came from), then the model is
assembled whole (:func:`~sdp.subnet.assemble.assemble`) and part by part (in place,
:class:`~sdp.subnet.assemble.PartwiseAssembly`), every ``torch.distributed.broadcast`` logged on the way. Held to:
the assembled model equals the full model built on one process (with the same offsets), each rank receives exactly
the pieces it does not hold and sends those it is the lowest holder of (what ``sdp-plan``'s
:func:`~sdp.parallel.sdp_plan.fill_moves` predicts), each comm record carries the size of the group the broadcast
ran on, and the part-by-part records are those ``sdp-plan`` predicts for an evaluation
(:func:`sdp.parallel.sdp_traffic.eval_traffic`).
"""

from __future__ import annotations

import zlib
from typing import Any

import pytest
import torch

from tests.helpers import CORE, compose, config_dict, make_strategy, spawn

WORLD = 4
CONFIG = ["model=resnet18_cifar", "model.width=8", "dataset=synthetic", "dataset.image_size=8", "train.batch_size=4",
          "parallelism=sdp", "parallelism.coverage=0.5", f"cluster.world_size={WORLD}"]


def offset(name: str, like: torch.Tensor) -> torch.Tensor:
    """A value set by the tensor's name alone (the same on every rank and in the reference), added to floating
    tensors: quarters from 1/4 to 2, so BatchNorm statistics (initially 0 and 1) stay exact through the holders'
    sum and mean, and the assembled model can be held to the reference bit for bit."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return (torch.randint(1, 9, like.shape, generator=g) / 4).to(like.dtype)


def _assemble_logged(rank: int, world: int, config: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from sdp.rank.worker import build_model
    from sdp.subnet.assemble import PartwiseAssembly, tensor_map
    from sdp.subnet.masking import locate, view

    strategy, data, cfg = make_strategy(config, rank, world)
    with torch.no_grad():
        for p in strategy.pieces:  # every holder of a piece moves it alike: the assembled model must carry the offsets
            spec = locate(p, strategy.layout)
            if spec is not None and spec[0].is_floating_point():
                mine = view(*spec)
                mine.add_(offset(p.name, mine))
    log: list[tuple[int, int, int, int]] = []  # (source, bytes, elements, size of the group it ran on)
    real = dist.broadcast

    def logged(tensor: torch.Tensor, src: int, group: Any = None, **kw: Any) -> Any:
        log.append((int(src), tensor.numel() * tensor.element_size(), tensor.numel(), dist.get_world_size(group)))
        return real(tensor, src, group=group, **kw)

    comm, parts = strategy.ctx.comm, {}
    dist.broadcast = logged
    try:
        with comm.phase_as("whole"):
            whole = {k: t.detach().clone() for k, t in tensor_map(strategy._assemble()).items()}
        logs = {"whole": list(log)}
        log.clear()
        with comm.phase_as("parts"):
            assembly = PartwiseAssembly(skeleton=strategy.skeleton, pieces=strategy.pieces, layout=strategy.layout,
                                        plan=strategy.plan, masking=strategy.mode, groups=strategy.groups,
                                        ctx=strategy.ctx, scale=1.0)
            for i, name in enumerate(assembly.names):
                parts |= {f"{name}.{k}": t.detach().clone() for k, t in tensor_map(assembly.part(i)).items()}
        logs["parts"] = list(log)
    finally:
        dist.broadcast = real
    reference = tensor_map(build_model(cfg, data, meta=False))
    with torch.no_grad():
        for name, t in reference.items():
            if t.is_floating_point():
                t.add_(offset(name, t))
    return {"logs": logs, "records": {ph: comm.phase_records(ph) for ph in logs}, "whole": whole, "parts": parts,
            "reference": {k: t.detach().clone() for k, t in reference.items()}}


@pytest.mark.dist
@CORE  # comm accounting and the no-world-collective rule: one 4-rank spawn, no training
@pytest.mark.timeout(300)
def test_fill_sends_each_piece_only_to_the_ranks_that_lack_it() -> None:
    from sdp.parallel.job import JobFacts
    from sdp.parallel.sdp_plan import fill_moves, plan_for
    from sdp.parallel.sdp_traffic import _fill, eval_traffic
    from sdp.registry import build
    from sdp.subnet import masking as M
    from sdp.subnet.assemble import tensor_map

    cfg = compose(CONFIG)
    with torch.device("meta"):
        model = build(cfg.model)
    plan = plan_for(model=model, cfg=cfg.parallelism, world_size=WORLD)  # every rank derives this plan (check_same_plan)
    pieces, full = M.pieces(model, plan), tensor_map(model)
    dtypes = {t.dtype for name, t in full.items() if any(p.name == name and len(p.holders) < WORLD for p in pieces)}
    assert torch.int64 in dtypes and torch.float32 in dtypes, f"no holder set mixes dtypes to send: {dtypes}"
    wasted = [(r, p.name) for p in pieces for r in p.holders if len(p.holders) < WORLD and r != min(p.holders)]
    assert wasted, f"no rank holds a piece it is not the lowest holder of: nothing to test (holders {plan.holders})"
    predicted = eval_traffic(None, cfg=cfg.parallelism, job=JobFacts.of(cfg), model=model, prepared=plan, step=1)
    assert predicted.partwise, predicted

    got = spawn(_assemble_logged, world=WORLD, args=(config_dict(CONFIG),))
    for r, res in enumerate(got):
        ref = res["reference"]
        for built in ("whole", "parts"):
            assert set(res[built]) == set(ref), f"rank {r} {built}: names differ {set(res[built]) ^ set(ref)}"
            bad = [k for k in ref if not torch.equal(res[built][k], ref[k])]
            assert not bad, f"rank {r} {built}: assembled != the full model in {bad[:5]} ({len(bad)} tensors)"
        moves = fill_moves(pieces=pieces, rank=r, world=WORLD)
        lacks = {"received": moves["lacked_bytes"], "sent": moves["sent_bytes"]}
        assert lacks["received"] > 0, f"rank {r} lacks nothing: {moves}"
        # whole: one flat buffer per holder set and dtype (a BatchNorm count, int64, travels as int64: one cat of
        # mixed pieces would send it as float32); part by part every piece travels in its own tensor: both in bytes
        for built in ("parts", "whole"):
            log = res["logs"][built]
            measured = {"received": sum(e[1] for e in log if e[0] != r), "sent": sum(e[1] for e in log if e[0] == r)}
            assert measured == lacks, (f"rank {r} {built}: received/sent {measured} bytes, but it lacks / is the "
                                       f"lowest holder of {lacks} (a holder was sent values it holds, or a dtype changed)")
        assert (moves["received_bytes"], moves["sent_bytes"]) == (lacks["received"], lacks["sent"]), \
            f"rank {r}: sdp-plan's fill_moves {moves}, measured (bytes) {lacks}"
    for r, res in enumerate(got):  # then the records: each broadcast's real group, and sdp-plan's prediction of them
        for built, log in res["logs"].items():
            sizes = [k for kind, _, k in res["records"][built] if kind == "broadcast"]
            assert sizes == [e[3] for e in log], f"rank {r} {built}: recorded group sizes {sizes}, broadcast on {log}"
            assert all(k < WORLD for k in sizes), f"rank {r} {built}: a broadcast over the world {log}"
        whole = _fill(pieces=pieces, full=full, masking="forward", rank=r, world=WORLD, in_place=False)
        assert res["records"]["whole"] == whole, f"rank {r}: whole-model records {res['records']['whole']}, sdp-plan predicts {whole}"
        assert res["records"]["parts"] == predicted.build[r], \
            f"rank {r}: part-by-part records {res['records']['parts']}, sdp-plan predicts {predicted.build[r]}"
