"""``sdp-plan``'s prediction of assembly calibration's peak (``calibrate_peak_bytes``, the memory phase
``calibrate`` a run measures: :mod:`sdp.parallel.sdp_calibrate`), next to SDP's other peaks (:mod:`sdp.parallel.sdp_peaks`).

A rank's calibration peak is what it holds when the phase begins, its state after the last step without the
gradients (dropped: no step follows), plus the units it does not hold (received whole; the held ones, the stem and
the head are its own tensors), plus the peak of one calibration step on the assembled model: a meta rehearsal of
:func:`sdp.parallel.sdp_calibrate.fit`'s step (every parameter frozen, the gate vector and its Adam state, every
block checkpointed, the loss's backward to the gates) under the tracker that measures CPU runs, which only counts
what the step allocates (the model's tensors exist before it: labelled uncounted, or their views, e.g. a frozen linear
weight's transpose, would count the whole model a second time, as they did: about a quarter of the phase's peak).
"""

from __future__ import annotations

import copy

import torch

from sdp.core.loss import loss_fn
from sdp.metrics.live import IGNORED, LiveTensorTracker
from sdp.models import gates as G
from sdp.models.base import SDPModel
from sdp.parallel.device_forward import Attention, device_forward
from sdp.parallel.plan_entries import nbytes
from sdp.parallel.sdp_calibrate import forward
from sdp.subnet.assemble import split_blocks
from sdp.subnet.plan import Plan


def not_held_bytes(*, model: SDPModel, plan: Plan, rank: int) -> int:
    """Bytes of the unit blocks ``rank`` does not hold under ``plan`` (parameters and buffers), which calibration
    receives whole."""
    blocks = [model.blocks[b] for b in split_blocks(plan) if rank not in plan.block_holders(b)]
    return nbytes(t for m in blocks for t in [*m.parameters(), *m.buffers()])


def step_peak(*, model: SDPModel, plan: Plan, batch: int, precision: str, device: str) -> int:
    """Peak bytes one calibration step allocates on the assembled ``model`` (a meta model) at a per-rank ``batch``:
    activations (block inputs, one block recomputed in backward), the logits and their gradient, the gates and their
    Adam state (two steps, so the state exists when the second step's peak is taken)."""
    full = copy.deepcopy(model)
    for p in full.parameters():
        p.requires_grad_(False)
    blocks = sorted(split_blocks(plan))
    tracker = LiveTensorTracker(device_type="meta")
    with tracker, Attention(device=device):  # around backward too: the recomputation runs the forward's kernel
        # the model's tensors are the caller's (state, not-held blocks): known to the tracker and not counted, so that
        # a view of a frozen weight (a linear layer's transpose) is not taken for a new storage the step allocates
        tracker.label([*full.parameters(), *full.buffers()], IGNORED)
        vector, _ = G.attach(full, blocks=blocks, init=1.0, device=torch.device("meta"))
        optimizer = torch.optim.Adam([vector], lr=0.0)
        x = full.example_input(batch).to("meta")
        for step in range(2):
            if step == 1:
                tracker.reset_peak()
            with device_forward(precision=precision, device=device, attention=False):
                out = forward(full, x)
                loss = loss_fn(out, torch.zeros(out.shape[:-1], dtype=torch.long, device="meta"))
            loss.backward()
            del out, loss
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        G.remove(full, blocks=blocks)
        return tracker.peak
