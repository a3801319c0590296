"""The peak rehearsal every strategy's ``predict_peaks`` shares: set-up, train and eval peaks of a rank's module
rehearsed on the meta device (``sdp-plan`` asks each strategy: :func:`sdp.planning.planner.predict_peaks`).

Why a rehearsal rather than a formula: the peak is where parameters, gradients, optimizer state,
saved activations, output gradients and temporaries (the logits' gradient, foreach optimizer
buffers) overlap, and that point depends on the model. The rank's own module (DDP: the replica; SDP:
the masked subnetwork, made by the strategy's own plan and masking) runs two training steps and one
evaluation forward on meta tensors under the same :class:`~sdp.metrics.live.LiveTensorTracker` that
measures CPU runs (``device_type="meta"``: storages keyed the same way, nothing is computed). This module is the
generic rehearsal (:func:`rehearse`, and :func:`rehearse_partwise` for evaluation part by part); what
it cannot see is added by each strategy's own rule, next to the strategy in ``sdp/parallel/``
(:meth:`~sdp.parallel.spec.StrategySpec.predict_peaks`): the DDP family's reducer buckets
(:func:`sdp.parallel.ddp.ddp_peaks`), SDP's owner-set buckets, part-wise evaluation and re-draw
(:func:`sdp.parallel.sdp_peaks.sdp_peaks`), FSDP's shards and unsharded blocks (a rule, not a
rehearsal of FSDP2's buffers: :func:`sdp.parallel.fsdp.fsdp_peaks`).

The forward runs as the ranks' would on ``cluster.device`` under ``train.precision``
(:func:`sdp.parallel.device_forward.device_forward`: autocast emulated on meta, the device's attention kernel).

The comparison with the CPU tracker is ``tests/test_plan_peaks.py`` (within 10 %).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn

from sdp.metrics.live import LiveTensorTracker
from sdp.models.base import SDPModel
from sdp.parallel.device_forward import Attention, device_forward, device_optimizer
from sdp.subnet.assemble import frozen_part, partwise_names
from sdp.core.loss import LOSS_CHUNK_TOKENS, loss_and_correct, loss_fn, target_logprobs
from sdp.registry import build


def _targets(out: torch.Tensor) -> torch.Tensor:
    return torch.zeros(out.shape[:-1], dtype=torch.long, device=out.device)


def train_step(*, module: nn.Module, x: torch.Tensor, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
               optimizer: Any, region: Any, after_backward: Callable[[], None] | None = None) -> None:
    """One training step as the trainer runs it (:meth:`sdp.parallel.base.Strategy.train_step`): forward and loss inside
    ``region`` (the autocast the ranks enter, or its emulation), the output dropped before backward (the step's
    ``_forward_loss`` returns the loss alone), ``after_backward`` for the gradient sync, the update, gradients zeroed in
    place. Shared by :func:`rehearse` and benchmarks/gpu/peak_trace.py, which runs it on a real device beside the rehearsal."""
    with region:
        out = module(x)
        total = loss(out, _targets(out))
        del out
    total.backward()
    del total
    if after_backward is not None:
        after_backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)


def rehearse_partwise(*, model: SDPModel, flats: dict[str, int], batches: list[tuple[int, bool]],
                      example: Callable[[int], torch.Tensor], precision: str, device: str) -> int:
    """Peak live meta bytes of evaluating ``model`` part by part (:func:`sdp.rank.evaluation.partwise_totals`
    with ``eval.part_batches=1``), above whatever the rank already holds: for each part, its transient
    copy plus the largest flat broadcast that fills it (``flats``: bytes per part), then its forward on
    the previous part's output; ``batches``: (batch size, BatchNorm re-estimation pass?) per pass kind,
    the training batch for re-estimation and the evaluation batch for the validation pass; under
    ``precision`` on ``device`` (one autocast region over the whole evaluation, as the trainer's)."""
    tracker = LiveTensorTracker(device_type="meta")
    names = partwise_names(model)
    for size, reestimate in batches:
        skeletons: list[Any] = [copy.deepcopy(model.get_submodule(name)) for name in names]  # untracked, as the real
        with tracker, device_forward(precision=precision, device=device), torch.no_grad():  # run copies its skeleton; to_empty allocates
            x = example(size).to("meta")
            for i, name in enumerate(names):
                part, skeletons[i] = frozen_part(skeletons[i].to_empty(device="meta")), None  # dropped after its forward
                flat = torch.empty(flats.get(name, 0), dtype=torch.uint8, device="meta")
                del flat
                for m in part.modules():  # re-estimation: BatchNorm in training mode, as bn_pass runs it (its
                    if reestimate and isinstance(m, nn.modules.batchnorm._BatchNorm):  # cumulative momentum
                        m.train()  # reads num_batches_tracked, which meta cannot; the allocations are the same)
                y = part(x)
                del part
                x = y
            if not reestimate:
                loss_and_correct(x, _targets(x))
            del x, skeletons
    return tracker.peak


def rehearse(*, module: nn.Module, trainable: list[nn.Parameter], batch: int, eval_batch: int, optimizer: Any,
             example: Callable[[int], torch.Tensor], precision: str, device: str,
             after_backward: Callable[[], None] | None = None,
             loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = loss_fn, ensemble: bool = False) -> dict[str, int]:
    """Live meta bytes of ``module``: at set-up (module state), the peak of a training step after one
    warm-up step, and the peak of one evaluation forward; plus the persistent state after a step
    (no ``trainable``: evaluation only; ``optimizer``: the ``optim.optimizer`` node, built over ``trainable``).
    ``after_backward`` stands for the strategy's gradient sync; ``loss``: the step's loss of the module's output and
    the targets (default the cross-entropy; SDP's distillation adds its KL term). The forward and the loss run as the ranks
    run them on ``device`` (``cluster.device``) under ``precision`` (``train.precision``:
    :func:`~sdp.parallel.device_forward.device_forward`), evaluation too (the trainer evaluates under autocast);
    ``ensemble``: the evaluation also computes, chunk by chunk, what the workers' ensemble combines
    (:func:`sdp.core.loss.target_logprobs`: a chunk's float32 log-probabilities, vocabulary-sized for an LM)."""

    tracker = LiveTensorTracker(device_type="meta")
    with tracker, Attention(device=device):
        tracker.label(list(module.parameters()) + list(module.buffers()), "parameters")
        setup = tracker.total
        opt = device_optimizer(factory=build(optimizer), params=trainable, device=device) if trainable else None
        x = example(batch).to("meta")
        for step in range(2 if opt is not None else 0):
            if step == 1:
                tracker.reset_peak()
            train_step(module=module, x=x, loss=loss, optimizer=opt, after_backward=after_backward,
                       region=device_forward(precision=precision, device=device, attention=False))
        train, state = tracker.peak, tracker.total
        was = module.training
        module.eval()
        tracker.reset_peak()
        with torch.no_grad(), device_forward(precision=precision, device=device, attention=False):
            out = module(example(eval_batch).to("meta"))
            loss_and_correct(out, _targets(out))
            if ensemble:  # sdp.rank.eval_ensemble.add_batch's chunks, after the batch's loss (as own_totals runs them)
                for o in out.reshape(-1, out.shape[-1]).split(LOSS_CHUNK_TOKENS):
                    probs, mine = target_logprobs(o, _targets(o))
                    del probs, mine
            del out
        module.train(was)
        evaluation = tracker.peak
    return {"setup": setup, "train": train, "eval": evaluation, "state": state}
