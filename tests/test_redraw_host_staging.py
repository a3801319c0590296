"""SDP's re-draw on ranks that share a GPU over gloo (issue 35, item 11): gloo runs collectives on CUDA
tensors but not send/recv, which read the tensor's pointer as host memory ("Bad address" or a crash at the
first re-draw). The re-draw's one point-to-point place (:class:`sdp.subnet.redraw.Wire`) now stages such
tensors through host copies (:func:`sdp.core.distctx.staged_through_host`).

No GPU here: the ranks are CPU gloo ranks and the device check is replaced by one that stages every tensor.
What is checked is what a CUDA rank relies on: gloo is handed host copies only, never the tensors
themselves, and what arrives is copied back into them, so a whole run of re-draws ends bit-identical to one
without staging. (The pipeline's point-to-point lives inside ``torch.distributed.pipelining``; that
combination is refused before any rank starts: tests/test_validation.py.)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from sdp.core.distctx import DistContext
from sdp.core.loss import loss_fn
from sdp.subnet import redraw as R
from tests.helpers import CORE, batch, config_dict, make_strategy, spawn

MLP = ["model=mlp", "dataset=digits", "model.hidden=64", "model.depth=4", "train.batch_size=8"]


class _NoTimer:
    from contextlib import nullcontext

    def phase(self, _name: str):  # noqa: ANN201
        return self.nullcontext()


def _stage_everything() -> list[torch.Tensor]:
    """Inside a rank: every tensor counts as one gloo cannot send (as CUDA would), and every tensor handed to
    ``batch_isend_irecv`` is recorded."""
    handed: list[torch.Tensor] = []
    R.staged_through_host = lambda *, backend, device: backend == "gloo"  # type: ignore[attr-defined]
    real = dist.batch_isend_irecv

    def recording(ops: list[Any]) -> Any:
        handed.extend(op.tensor for op in ops)
        return real(ops)

    dist.batch_isend_irecv = recording
    return handed


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _exchange(rank: int, world: int) -> dict[str, Any]:
    handed = _stage_everything()
    ctx = DistContext(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), backend="gloo")
    wire = R.Wire(ctx=ctx, groups=None)
    whole = torch.arange(12.0).reshape(3, 4) + 100 * rank
    into = torch.zeros(3, 4)
    narrowed = torch.zeros(3, 4)
    peer = 1 - rank
    # each rank sends a whole tensor and a non-contiguous column pair; receives into a tensor and a narrowed slice
    wire.exchange(sends=[((peer,), whole), ((peer,), whole[:, 1:3])], recvs=[(peer, into), (peer, narrowed[:, 1:3])])
    ours = {_storage(t) for t in (whole, into, narrowed)}
    return {"into": into, "narrowed": narrowed, "handed_ours": [t for t in handed if _storage(t) in ours],
            "handed": len(handed), "sent": wire.sent, "received": wire.received}


@pytest.mark.dist
@CORE
@pytest.mark.timeout(120)
def test_wire_hands_gloo_host_copies_and_copies_back() -> None:
    got = spawn(_exchange, world=2, timeout_s=100)
    for rank, g in enumerate(got):
        other = torch.arange(12.0).reshape(3, 4) + 100 * (1 - rank)
        assert torch.equal(g["into"], other), (rank, g["into"])
        assert torch.equal(g["narrowed"][:, 1:3], other[:, 1:3]) and not g["narrowed"][:, [0, 3]].any(), (rank, g["narrowed"])
        assert g["handed"] == 4 and not g["handed_ours"], \
            f"rank {rank}: gloo was handed {len(g['handed_ours'])} of the tensors themselves instead of host copies"
        assert (g["sent"], g["received"]) == (4 * 12 + 4 * 6, 4 * 12 + 4 * 6), (rank, g["sent"], g["received"])


def _train(rank: int, world: int, config: dict, staged: bool) -> tuple[dict, int]:
    handed = _stage_everything() if staged else []
    strategy, data, cfg = make_strategy(config, rank, world)
    for step in range(5):  # re-draws before steps 2 and 4
        x, y = batch(data, cfg, step=step, rank=rank, world_size=world)
        strategy.train_step(inputs=x, targets=y, loss_fn=loss_fn, timer=_NoTimer(), step=step)
    assert strategy.redraws == 2, f"rank {rank}: {strategy.redraws} re-draws"
    assert not staged or handed, f"rank {rank}: nothing was sent point to point: nothing tested"
    return strategy.checkpoint_state()["local"], len(handed)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_redraws_staged_through_host_equal_the_unstaged_run() -> None:
    config = config_dict(MLP + ["parallelism=sdp_neuron_bwd", "optim=adamw", "parallelism.resample_every=2",
                                "cluster.world_size=4"])
    plain = spawn(_train, world=4, args=(config, False))
    staged = spawn(_train, world=4, args=(config, True))
    for rank, ((a, _), (b, handed)) in enumerate(zip(plain, staged)):
        assert a["extra"] == b["extra"], (rank, a["extra"], b["extra"])
        for key, t in a["model"].items():
            assert torch.equal(t, b["model"][key]), f"rank {rank}: {key} differs after staged re-draws"
        for i, st in a["optimizer"]["state"].items():
            for k, v in st.items():
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["optimizer"]["state"][i][k])), (rank, i, k)
