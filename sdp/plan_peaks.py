"""``sdp-plan``'s predicted peaks (set-up, train, eval) per rank, by rehearsing steps on the meta device.

Why a rehearsal rather than a formula: the peak is where parameters, gradients, optimizer state,
saved activations, output gradients and temporaries (the logits' gradient, foreach optimizer
buffers) overlap, and that point depends on the model. The rank's own module (DDP: the replica; SDP:
the masked subnetwork, made by the strategy's own plan and masking) runs two training steps and one
evaluation forward on meta tensors under the same :class:`~sdp.metrics.live.LiveTensorTracker` that
measures CPU runs (``device_type="meta"``: storages keyed the same way, nothing is computed). What
the rehearsal cannot see is added from the strategy's rule:

- DDP: the reducer's gradient buckets exist from construction (``gradient_as_bucket_view``: they
  are the gradients later), so they count in the set-up peak.
- SDP: one owner-set bucket is flattened after backward, or (backward masking) one refresh bucket
  after the update (``sdp.subnet.sync``, the largest that this rank takes part in); evaluation builds
  the model part by part next to the rank's own state (:func:`rehearse_partwise`: one part, its
  broadcast buffer and one batch's activations at a time); with ``resample_every``, the first re-draw
  is rehearsed too (``redraw_peak_bytes``: :func:`sdp.parallel.sdp_plan.rehearse_redraw`).
- FSDP: the rank's shards of the state, the full replica's activation transient, the root and the
  largest block unsharded (see :func:`_fsdp_peaks`): a rule, not a rehearsal of FSDP2's buffers.

The comparison with the CPU tracker is ``tests/test_plan_peaks.py`` (within 10 %).
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

import torch
from omegaconf import DictConfig
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from sdp.metrics.live import LiveTensorTracker
from sdp.models.base import SDPModel
from sdp.evaluation import batch_norms, loss_and_correct
from sdp.subnet.assemble import partwise_names
from sdp.loss import loss_fn
from sdp.registry import build


class FusedAttention(TorchFunctionMode):
    """On meta, ``F.scaled_dot_product_attention`` takes the math path and saves the T x T scores;
    real runs (CPU and CUDA) use a fused kernel that saves the output and its log-sum-exp. This
    routes the call to the CPU fused kernel's op (which has meta and autograd support), so the
    rehearsal allocates what a real run does. Masks, dropout and grouped-query calls pass through."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and len(args) == 3 and not kwargs.get("enable_gqa") \
                and kwargs.get("attn_mask") is None and not kwargs.get("dropout_p") and kwargs.get("scale") is None:
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*args, 0.0, bool(kwargs.get("is_causal")))[0]
        return func(*args, **kwargs)


def _targets(out: torch.Tensor) -> torch.Tensor:
    return torch.zeros(out.shape[:-1], dtype=torch.long, device="meta")


def rehearse_partwise(*, model: SDPModel, flats: dict[str, int], batches: list[tuple[int, bool]],
                      example: Callable[[int], torch.Tensor]) -> int:
    """Peak live meta bytes of evaluating ``model`` part by part (:func:`sdp.evaluation.partwise_totals`
    with ``eval.part_batches=1``), above whatever the rank already holds: for each part, its transient
    copy plus the largest flat broadcast that fills it (``flats``: bytes per part), then its forward on
    the previous part's output; ``batches``: (batch size, BatchNorm re-estimation pass?) per pass kind,
    the training batch for re-estimation and the evaluation batch for the validation pass."""
    tracker = LiveTensorTracker(device_type="meta")
    names = partwise_names(model)
    for size, reestimate in batches:
        skeletons: list[Any] = [copy.deepcopy(model.get_submodule(name)) for name in names]  # untracked, as the real
        with tracker, FusedAttention(), torch.no_grad():  # run copies its skeleton; to_empty allocates
            x = example(size).to("meta")
            for i, name in enumerate(names):
                part, skeletons[i] = skeletons[i].to_empty(device="meta").eval(), None  # dropped after its forward
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


def rehearse(*, module: nn.Module, trainable: list[nn.Parameter], batch: int, eval_batch: int, cfg: DictConfig,
             example: Callable[[int], torch.Tensor], after_backward: Callable[[], None] | None = None) -> dict[str, int]:
    """Live meta bytes of ``module``: at set-up (module state), the peak of a training step after one
    warm-up step, and the peak of one evaluation forward; plus the persistent state after a step
    (no ``trainable``: evaluation only). ``after_backward`` stands for the strategy's gradient sync."""

    tracker = LiveTensorTracker(device_type="meta")
    with tracker, FusedAttention():
        tracker.label(list(module.parameters()) + list(module.buffers()), "parameters")
        setup = tracker.total
        opt = build(cfg.optim.optimizer)(trainable) if trainable else None
        x = example(batch).to("meta")
        for step in range(2 if opt is not None else 0):
            if step == 1:
                tracker.reset_peak()
            out = module(x)
            loss_fn(out, _targets(out)).backward()
            del out
            if after_backward is not None:
                after_backward()
            opt.step()  # type: ignore[union-attr]
            opt.zero_grad(set_to_none=False)
        train, state = tracker.peak, tracker.total
        was = module.training
        module.eval()
        tracker.reset_peak()
        with torch.no_grad():
            out = module(example(eval_batch).to("meta"))
            loss_and_correct(out, _targets(out))
            del out
        module.train(was)
        evaluation = tracker.peak
    return {"setup": setup, "train": train, "eval": evaluation, "state": state}


def _eval_batch(cfg: DictConfig, world: int) -> int:
    """Per-rank evaluation batch: ``train.eval_batch_size``, or the rank's share of the val set if smaller."""
    n_val = cfg.dataset.get("num_val")
    per_rank = math.ceil(int(n_val) / world) if n_val else int(cfg.train.eval_batch_size)
    return min(int(cfg.train.eval_batch_size), per_rank)


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def predict_peaks(*, cfg: DictConfig, model: SDPModel, world: int, state: list[dict[str, Any]],
                  strategy: Any) -> list[dict[str, int]] | None:
    """Per rank ``setup_peak_bytes``, ``train_peak_bytes``, ``eval_peak_bytes`` from ``strategy``'s
    :meth:`~sdp.parallel.base.Strategy.predict_peaks` (None: a strategy without a peak rehearsal:
    pipeline). ``state``: the planner's per-rank memory entries (the held parameter, gradient and
    optimizer bytes that FSDP's rule starts from)."""
    return strategy.predict_peaks(cfg=cfg, model=model, world=world, batch=int(cfg.train.batch_size),
                                  eval_batch=_eval_batch(cfg, world), state=state)


def _ddp_peaks(*, cfg: DictConfig, model: SDPModel, world: int, batch: int, eval_batch: int,
               prepare: Callable[[SDPModel], Any]) -> list[dict[str, int]]:
    """The DDP family: the replica's rehearsal (``prepare``: what the strategy's ``setup`` does to the
    model before wrapping it, e.g. activation checkpointing); the reducer's buckets from the start."""
    example = model.example_input
    mine = copy.deepcopy(model)
    prepare(mine)
    r = rehearse(module=mine, trainable=list(mine.parameters()), batch=batch, eval_batch=eval_batch, cfg=cfg, example=example)
    buckets = _nbytes(mine.parameters())
    one = {"setup_peak_bytes": r["setup"] + buckets, "train_peak_bytes": r["train"], "eval_peak_bytes": r["eval"]}
    return [dict(one) for _ in range(world)]


def _sdp_peaks(*, cfg: DictConfig, model: SDPModel, world: int, batch: int, eval_batch: int) -> list[dict[str, int]]:
    from sdp.parallel.sdp_plan import plan_for, redraw_peaks
    from sdp.subnet import masking as M
    from sdp.metrics.comm import CommCounter
    from sdp.subnet.holder_groups import GroupSet
    from sdp.subnet.sync import OwnerSetSync

    pc = cfg.parallelism
    mode = M.masking_mode(masking=str(pc.masking), refresh=str(pc.refresh))
    plan = plan_for(model=model, cfg=pc, world_size=world)
    pieces = M.pieces(model, plan)
    partwise = bool(partwise_names(model))
    if partwise:  # evaluation part by part (SDPStrategy.eval_module)
        norms = batch_norms(model)
        reestimate = str(cfg.eval.bn) == "reestimate" and bool(norms)
        eval_extra = rehearse_partwise(model=model, flats=_part_flats(pieces, n=world, forward=mode == "forward"),
                                       batches=[(eval_batch, False)] + ([(batch, True)] if reestimate else []),
                                       example=model.example_input)
        eval_extra += _nbytes(b for m in norms for b in m.buffers()) if reestimate else 0  # re-estimated statistics kept per part
    else:  # a whole assembled copy next to the rank's state
        full_eval = rehearse(module=copy.deepcopy(model), trainable=[], batch=1, eval_batch=eval_batch, cfg=cfg,
                             example=model.example_input)
        eval_extra = _nbytes(list(model.parameters()) + list(model.buffers())) + full_eval["eval"] - full_eval["setup"]
    groups = GroupSet(world_size=world, holder_sets=(), refresh=False)  # no process group is created
    out = []
    for r, mine, layout, trained in M.rank_subnetworks(model, plan, mode=mode, all_pieces=pieces):
        overlap = bool(pc.get("overlap", True))
        sync = OwnerSetSync(rank=r, pieces=pieces, layout=layout, groups=groups, comm=CommCounter(), mode=mode,
                            bucket_cap_mb=float(pc.bucket_cap_mb), overlap=overlap)
        sync.close()  # its hooks would launch collectives; the stand-in below allocates what they do
        res = rehearse(module=mine, trainable=trained, batch=batch, eval_batch=eval_batch, cfg=cfg, example=mine.example_input,
                       after_backward=_overlap_stand_in(sync) if overlap else None)
        flats = [sum(p.nbytes for p in items) for _, items in sync.grad_buckets + sync.refresh_buckets]
        out.append({"setup_peak_bytes": res["setup"], "train_peak_bytes": max(res["train"], res["state"] + max(flats, default=0)),
                    "eval_peak_bytes": res["state"] + eval_extra})
    if pc.get("resample_every"):  # the first re-draw (draw 0 -> 1), rehearsed as it runs (sdp.subnet.redraw)
        for entry, peak in zip(out, redraw_peaks(cfg=cfg, model=model, world=world)):
            entry["redraw_peak_bytes"] = peak
    return out


def _overlap_stand_in(sync: Any) -> Callable[[], None]:
    """Meta stand-in for OwnerSetSync's overlapped all-reduces (``parallelism.overlap``): a gradient
    hook on every synced tensor counts its buckets down, and each ready bucket of the launch order
    allocates its flat buffer, which stays live until the sync finishes after backward (the returned
    callable: it allocates the buckets not launched yet, then frees them all), as the real one does."""
    live: list[torch.Tensor] = []
    need: list[int] = []
    state = {"next": 0, "left": []}
    tensors: dict[int, tuple[torch.Tensor, list[int]]] = {}
    for b, (_, items) in enumerate(sync.grad_buckets):
        mine = {id(t): t for t in (sync._tensor(p) for p in items)}
        need.append(len(mine))
        for key, t in mine.items():
            tensors.setdefault(key, (t, []))[1].append(b)

    def launch(*, every: bool) -> None:
        while state["next"] < len(sync.launch_order):
            b = sync.launch_order[state["next"]]
            if state["left"][b] and not every:
                return
            live.append(torch.empty(sum(p.nbytes for p in sync.grad_buckets[b][1]), dtype=torch.uint8, device="meta"))
            state["next"] += 1

    def hook_for(bs: list[int]) -> Callable[[torch.Tensor], None]:
        def hook(_t: torch.Tensor) -> None:
            for b in bs:
                state["left"][b] -= 1
            launch(every=False)
        return hook

    for t, bs in tensors.values():
        if t.requires_grad:
            t.register_post_accumulate_grad_hook(hook_for(bs))

    def finish() -> None:
        launch(every=True)
        live.clear()
        state["next"], state["left"] = 0, list(need)

    state["left"] = list(need)
    return finish


def _part_flats(pieces: list[Any], *, n: int, forward: bool) -> dict[str, int]:
    """Per top-level part, the largest temporary that filling it allocates (sdp.subnet.assemble.fill
    with ``in_place``: a piece lacked by some rank is broadcast straight into its tensor, except a
    slice narrowed along a dimension other than the first, which goes through a contiguous copy;
    only under forward masking)."""
    out: dict[str, int] = {}
    for p in pieces:
        if forward and len(p.holders) < n and p.dim not in (None, 0):
            parts = p.name.split(".")
            name = ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]
            out[name] = max(out.get(name, 0), p.nbytes)
    return out


def _fsdp_peaks(*, cfg: DictConfig, model: SDPModel, world: int, batch: int, eval_batch: int,
                state: list[dict[str, Any]]) -> list[dict[str, int]]:
    """FSDP2 on top of the full replica's rehearsal: the model is sharded on the meta device and each rank
    materialises its shards only (set-up: the shards, the unsharded buffers and one module's full
    tensors in flight, :func:`sdp.models.init.materialise_sharded`); a training step holds the sharded
    state, the replica's activation transient, the root unsharded, and for the largest block its
    unsharded parameters twice (running + prefetched) and its unsharded gradients and reduce-scatter
    input; evaluation unshards every unit (the full parameters) with one all-gather buffer in flight."""
    full = rehearse(module=copy.deepcopy(model), trainable=list(model.parameters()), batch=batch, eval_batch=eval_batch,
                    cfg=cfg, example=model.example_input)
    block_ids = {id(p) for b in model.blocks for p in b.parameters()}
    root = _nbytes(p for p in model.parameters() if id(p) not in block_ids)
    largest = max((_nbytes(b.parameters()) for b in model.blocks), default=0)
    params_full = _nbytes(model.parameters())
    one_module = max((_nbytes(t for t in [*m._parameters.values(), *m._buffers.values()] if t is not None)
                      for m in model.modules()), default=0)
    buffers = _nbytes(model.buffers())
    out = []
    for mem in state:
        state = mem["param_bytes"] + mem["grad_bytes"] + mem["optim_bytes"]
        out.append({"setup_peak_bytes": mem["param_bytes"] + buffers + one_module,
                    "train_peak_bytes": state + (full["train"] - full["state"]) + root + 4 * largest,
                    "eval_peak_bytes": state + params_full + (full["eval"] - full["state"]) + largest})
    return out
