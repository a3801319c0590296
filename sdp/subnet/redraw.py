"""Plan re-draws that cost no more memory than training: only the pieces that change hands move, one
tensor at a time.

Why not assemble: a re-draw that assembles the full model on every rank and prunes it to the new
plan holds the rank's state plus the full model at once, above a training step's peak whenever the
full model outweighs the step's gradients and activations (C = 0.5: half the model more than the
rank trains). Here a rank never holds the full model, nor any piece it neither keeps, sends nor receives.

How (:func:`move`): BatchNorm statistics are first averaged over the ranks that ran them, as assembly
does (:func:`~sdp.subnet.assemble.average_statistics`); gradients are dropped, and every old tensor
this rank gives up and sends to nobody is freed with its optimizer state. Then tensor by tensor, in
one order on every rank (:func:`sdp.subnet.moves.schedule`: the transfers pair up point to point):
(1) the new subnetwork's part of the tensor (masked for the new plan on the meta device, from the
skeleton) takes this rank's old tensor as it is where its layout did not change (a shared tensor, a
unit it keeps: no copy, no traffic); (2) otherwise it is allocated and each piece copied from this
rank's old tensor or received from the piece's lowest old holder, by the new holders that lack it
only; (3) its optimizer state follows by the same rule with the trainers in place of the holders
(:mod:`sdp.subnet.carry` says what each piece's state is; under backward masking every rank stores
every value, so only state moves); (4) the old tensor and its state are freed before the next. The
peak is the rank's parameters and optimizer state, less its gradients, plus what it has received
before it has sent what it gives up: within a training step's, which holds gradients and activations.

The same code runs on the meta device for ``sdp-plan`` (:func:`sdp.parallel.sdp_redraw_plan.rehearse_redraw`: nothing
is sent, every buffer is allocated), and :func:`sdp.subnet.moves.traffic` gives every rank's bytes.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from sdp.core.distctx import DistContext, staged_through_host
from sdp.subnet import masking as M
from sdp.subnet.assemble import average_statistics
from sdp.subnet.carry import Described, descriptions, gather_descriptions, rebuild
from sdp.subnet.masking import Local, Piece, locate, view
from sdp.subnet.moves import Move, moves, schedule, traffic
from sdp.subnet.plan import Plan
from sdp.subnet.holder_groups import GroupSet


class Wire:
    """The ranks' transport: one batch of point-to-point sends and receives per tensor
    (``batch_isend_irecv`` on the default group), waited on before the next tensor, so at most one
    tensor's staging buffers exist; every transfer recorded (comm phase "resample"); on gloo, a CUDA tensor
    passes through a host copy (gloo has no CUDA send/recv: ranks sharing a GPU). Batched, because
    torch runs batched point-to-point on the group's own communicator when the group is bound to its
    device (NCCL: the worker's ``init_world``), rather than making a communicator per pair of ranks."""

    def __init__(self, *, ctx: DistContext, groups: GroupSet) -> None:
        self.ctx, self.groups, self.comm = ctx, groups, ctx.comm
        self.sent = self.received = 0

    def exchange(self, *, sends: list[tuple[tuple[int, ...], torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> None:
        ops: list[tuple[bool, int, torch.Tensor]] = []
        for dsts, v in sends:
            buf = v if v.is_contiguous() else v.contiguous()
            ops += [(True, d, buf) for d in dsts]
        later = []
        for src, t in recvs:  # a narrowed slice (neuron level) is received whole, then copied in
            buf = t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device)
            ops.append((False, src, buf))
            if buf is not t:
                later.append((t, buf))
        for send, _, buf in ops:
            nbytes = buf.numel() * buf.element_size()
            self.sent, self.received = self.sent + nbytes * send, self.received + nbytes * (not send)
            self.comm.record(kind="send" if send else "recv", payload=nbytes, group_size=2)
        self._post(ops)
        for t, buf in later:
            t.copy_(buf)

    def _post(self, ops: list[tuple[bool, int, torch.Tensor]]) -> None:
        """Send and receive ``ops`` (send?, peer, contiguous buffer) as one batch; a buffer gloo cannot move
        point to point (:func:`~sdp.core.distctx.staged_through_host`: CUDA) goes through a host copy, a
        received one copied back after the wait, so the device holds no more than without staging."""
        if not ops:
            return
        staged = [(s, p, b, staged_through_host(backend=self.ctx.backend, device=b.device)) for s, p, b in ops]
        wire = [(s, p, (b.to("cpu", copy=True) if s else torch.empty(b.shape, dtype=b.dtype)) if host else b)
                for s, p, b, host in staged]
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend if s else dist.irecv, b, p) for s, p, b in wire]):
            work.wait()
        for (send, _, buf, host), (_, _, got) in zip(staged, wire, strict=True):
            if host and not send:
                buf.copy_(got)

    def reduce(self, flat: torch.Tensor, ranks: tuple[int, ...]) -> None:
        """Sum ``flat`` over ``ranks`` in place (recorded here, so ``sdp-plan``'s dry wire records it alike)."""
        self.comm.record(kind="all_reduce", payload=flat.numel() * flat.element_size(), group_size=len(ranks))
        self._reduce(flat, ranks)

    def _reduce(self, flat: torch.Tensor, ranks: tuple[int, ...]) -> None:
        dist.all_reduce(flat, group=self.groups.get(ranks))

    def gather(self, mine: dict[int, Described]) -> list[dict[int, Described]]:
        return gather_descriptions(mine, ctx=self.ctx)


def _parts(loc: Local | None) -> list[tuple[str, torch.Tensor, tuple[int, ...]]]:
    """(attribute, tensor, groups) of this rank's storage of one tensor: held and (backward masking) rest."""
    if loc is None:
        return []
    return [(a, t, g) for a, t, g in (("held", loc.held, loc.held_groups), ("rest", loc.rest, loc.rest_groups))
            if t is not None]


def _match(y: torch.Tensor, lo: Local, x: torch.Tensor, ln: Local, groups: tuple[int, ...], y_groups: tuple[int, ...]) -> bool:
    """Whether old part ``y`` is new part ``x`` (same dim, groups, shape, dtype): kept as it is."""
    return lo.dim == ln.dim and y_groups == groups and y.shape == x.shape and y.dtype == x.dtype


def _trained(layout: dict[str, Local], pieces: list[Piece], rank: int, mode: str) -> set[int]:
    """ids of the tensors this rank trains (:meth:`SDPStrategy._trainable`'s rule), meta or real."""
    if mode == "global":
        return {id(loc.held) for loc in layout.values() if isinstance(loc.held, nn.Parameter)}
    return {id(t) for t in M.held_parameters(layout, pieces, rank)}


def _slots(model: nn.Module) -> dict[int, list[tuple[dict[str, Any], str]]]:
    """id(tensor) -> every module slot holding it (a tied tensor has several)."""
    out: dict[int, list[tuple[dict[str, Any], str]]] = {}
    for mod in model.modules():
        for table in (mod._parameters, mod._buffers):
            for key, t in table.items():
                if t is not None:
                    out.setdefault(id(t), []).append((table, key))
    return out


@torch.no_grad()
def move(*, model: nn.Module, old: list[Piece], new: list[Piece], old_layout: dict[str, Local], new_layout: dict[str, Local],
         state: dict[Any, dict[str, Any]], rank: int, world: int, mode: str, device: torch.device | str,
         full: dict[str, torch.Tensor], wire: Wire) -> tuple[dict[nn.Parameter, dict[str, Any]], list[dict[str, int]]]:
    """Fill ``model`` (masked for the new plan on the meta device, ``new_layout`` its layout, both updated
    in place) from this rank's old tensors (``old_layout``; freed as it goes) and the other ranks',
    and return the new trainable tensors' optimizer state (``state``: the old, emptied as it goes) and
    every rank's traffic (:func:`traffic`). ``full``: the skeleton's tensors by name (shapes, dtypes).
    Collective: every rank calls it with the same piece lists."""
    values, carried = moves(old=old, new=new, mode=mode, world=world)
    everyone = tuple(range(world))
    trainers = (lambda p: everyone) if mode == "global" else (lambda p: p.holders)  # noqa: E731
    shapes = {k: t.shape for k, t in full.items()}
    average_statistics(pieces=[p for p in old if not p.is_param and full[p.name].is_floating_point()],
                       target=lambda p: view(*locate(p, old_layout)),  # type: ignore[misc]
                       masking=mode, rank=rank, world_size=world, reduce=wire.reduce)
    descs = descriptions(state=state, old=old, old_layout=old_layout, trainers=trainers, moving=sorted(carried),
                         rank=rank, gather=wire.gather)
    old_trained, new_trained = _trained(old_layout, old, rank, mode), _trained(new_layout, new, rank, mode)
    slots = _slots(model)
    by_name: dict[str, list[int]] = {}
    for i, p in enumerate(new):
        by_name.setdefault(p.name, []).append(i)
    out: dict[nn.Parameter, dict[str, Any]] = {}
    for name, idx in by_name.items():  # (0) what this rank gives up and sends nowhere: freed before anything arrives
        lo, ln = old_layout.get(name), new_layout.get(name)
        for _, y, yg in _parts(lo):
            if any(_match(y, lo, x, ln, g, yg) for _, x, g in _parts(ln)):
                continue
            mine = [i for i in idx if (s := locate(old[i], old_layout)) is not None and s[0] is y]
            if mode == "forward" and not any(rank in new[i].holders or (i in values and values[i].src == rank) for i in mine):
                y.data = torch.empty(0, dtype=y.dtype, device=y.device)
            if not any(rank in trainers(new[i]) or (i in carried and carried[i].src == rank) for i in mine):
                state.pop(y, None)
    for name in schedule(by_name=by_name, old=old, new=new, values=values, world=world, mode=mode):
        idx = by_name[name]
        lo, ln = old_layout.get(name), new_layout.get(name)
        made: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []  # (id of the meta part, real part, old part it is)
        for attr, x, groups in _parts(ln):  # (1) keep, or (2) allocate, the new parts
            same = [y for _, y, g in _parts(lo) if _match(y, lo, x, ln, groups, g)]
            if same:
                r = same[0].requires_grad_(x.requires_grad) if isinstance(same[0], nn.Parameter) else same[0]
            else:
                r = torch.empty(x.shape, dtype=x.dtype, device=device)
                r = nn.Parameter(r, requires_grad=x.requires_grad) if isinstance(x, nn.Parameter) else r
            for table, key in slots.get(id(x), []):
                table[key] = r
            setattr(ln, attr, r)
            made.append((id(x), r, same[0] if same else None))
        fresh = {id(r) for _, r, y in made if y is None}
        recvs: list[tuple[int, torch.Tensor]] = []
        for i in idx:
            spec = locate(new[i], new_layout)
            if spec is not None and id(spec[0]) in fresh:
                have = locate(old[i], old_layout)
                if have is not None:
                    view(*spec).copy_(view(*have))
                else:
                    recvs.append((values[i].src, view(*spec)))
        wire.exchange(sends=[(values[i].dsts, view(*locate(old[i], old_layout))) for i in idx  # type: ignore[arg-type, misc]
                             if i in values and values[i].src == rank], recvs=recvs)
        kept = {id(y) for _, _, y in made if y is not None}
        for _, y, _ in _parts(lo):
            if id(y) not in kept:
                y.data = torch.empty(0, dtype=y.dtype, device=y.device)  # frees it wherever it is still referenced
        if old[idx[0]].is_param:
            _carry(idx=idx, made=made, old_layout=old_layout, new_layout=new_layout, old=old, new=new, state=state,
                   descs=descs, carried=carried, trainers=trainers, old_trained=old_trained, new_trained=new_trained, rank=rank, wire=wire, out=out)
        for _, y, _ in _parts(lo):
            state.pop(y, None)
    table = traffic(values=values, state=carried, pieces=new, descs=descs, shapes=shapes, world=world)
    assert (wire.sent, wire.received) == (table[rank]["sent_bytes"], table[rank]["received_bytes"]), \
        f"rank {rank} moved {wire.sent} B out, {wire.received} B in; the plans give {table[rank]}"
    return out, table


def _carry(*, idx: list[int], made: list[tuple[int, torch.Tensor, torch.Tensor | None]], old_layout: dict[str, Local],
           new_layout: dict[str, Local], old: list[Piece], new: list[Piece], state: dict[Any, dict[str, Any]],
           descs: dict[int, Described], carried: dict[int, Move], trainers: Callable[[Piece], tuple[int, ...]],
           old_trained: set[int], new_trained: set[int], rank: int, wire: Wire, out: dict[Any, dict[str, Any]]) -> None:
    """(3) One tensor's optimizer state: kept with a kept trained part, else copied or received piece by piece."""
    recvs: list[tuple[tuple[int, int], int, torch.Tensor]] = []
    for xid, r, y in made:
        if xid not in new_trained:
            continue
        if y is not None and id(y) in old_trained:  # the same trained part: its state as it is
            if y in state:
                out[r] = state.pop(y)
            continue
        its = [i for i in idx if (s := locate(new[i], new_layout)) is not None and s[0] is r]  # type: ignore[arg-type]
        ds = [descs[i] for i in its]
        assert all(d == ds[0] for d in ds), \
            f"rank {rank}: the pieces of one new tensor ({new[its[0]].name}) carry different optimizer state: " \
            f"{[(new[i].name, new[i].start, descs[i]) for i in its]}"
        if not ds[0]:
            continue
        out[r] = {key: rebuild(d, like=r) for key, d in ds[0].items()}
        keys = sorted(k for k, d in ds[0].items() if d[0] == "tensor")
        for i in its:
            _, dim, start, length = locate(new[i], new_layout)  # type: ignore[arg-type, misc]
            if rank in trainers(old[i]):
                t, odim, ostart, olength = locate(old[i], old_layout)  # type: ignore[arg-type, misc]
                had = state[t] if t in state else out[t]
                for key in keys:
                    view(out[r][key], dim, start, length).copy_(view(had[key], odim, ostart, olength))
            else:
                recvs += [((i, n), carried[i].src, view(out[r][key], dim, start, length)) for n, key in enumerate(keys)]
    sends = []
    for i in idx:  # in piece order, keys sorted: the order the receivers expect from each source
        keys = sorted(k for k, d in descs.get(i, {}).items() if d[0] == "tensor")
        if i in carried and carried[i].src == rank and keys:
            t, dim, start, length = locate(old[i], old_layout)  # type: ignore[arg-type, misc]
            had = state[t] if t in state else out[t]  # a kept part's state has moved to ``out`` already
            sends += [(carried[i].dsts, view(had[key], dim, start, length)) for key in keys]
    wire.exchange(sends=sends, recvs=[(src, t) for _, src, t in sorted(recvs, key=lambda e: e[0])])


def masked_on_meta(*, skeleton: nn.Module, plan: Plan, rank: int, mode: str) -> tuple[nn.Module, list[Piece], dict[str, Local]]:
    """``plan``'s subnetwork of this rank, masked on the meta device (no storage yet), its pieces and layout."""
    model = copy.deepcopy(skeleton)
    pieces = M.pieces(model, plan)
    return model, pieces, M.apply(model, plan, rank=rank, masking=mode, all_pieces=pieces)


def built_empty(*, skeleton: nn.Module, plan: Plan, rank: int, mode: str, device: torch.device | str,
                replacing: nn.Module) -> tuple[nn.Module, list[Piece], dict[str, Local]]:
    """:func:`masked_on_meta` with uninitialised storage on ``device``: a resume's subnetwork, whose values and
    optimizer state the checkpoint holds, so no piece moves (the layout still points at the meta tensors:
    :func:`sdp.subnet.masking.rebind` re-points it). The tensors of ``replacing`` (the set-up draw's module) are
    freed first, wherever they are still referenced (the worker keeps the module it handed to set-up)."""
    for t in [*replacing.parameters(), *replacing.buffers()]:
        t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    model, pieces, layout = masked_on_meta(skeleton=skeleton, plan=plan, rank=rank, mode=mode)
    return model.to_empty(device=device), pieces, layout


def redraw(*, module: nn.Module, optimizer: torch.optim.Optimizer, old: list[Piece], old_layout: dict[str, Local],
           new_model: nn.Module, new: list[Piece], new_layout: dict[str, Local], rank: int, world: int, mode: str,
           device: torch.device | str, full: dict[str, torch.Tensor], wire: Wire) -> list[dict[str, int]]:
    """Re-draw this rank from ``module`` (its optimizer's state taken along) to ``new_model`` (from :func:`masked_on_meta`,
    filled in place): gradients dropped first, then :func:`move`. The optimizer is left holding the new state and no
    parameters (the caller lists its new trainable tensors). Returns every rank's traffic."""
    for t in module.parameters():
        t.grad = None
    state = dict(optimizer.state)
    optimizer.state.clear()
    optimizer.param_groups[0]["params"] = []
    carried, table = move(model=new_model, old=old, new=new, old_layout=old_layout, new_layout=new_layout, state=state,
                          rank=rank, world=world, mode=mode, device=device, full=full, wire=wire)
    assert not state, f"rank {rank}: optimizer state of {len(state)} old tensors left behind"
    optimizer.state.update(carried)
    return table


DRAWS_LISTED = 100  # re-draws whose bytes summary.json lists one by one; the totals and maxima cover every one


def summary(*, count: int, log: list[dict[str, Any]], world: int) -> dict[str, Any]:
    """``strategy_info.redraw``: the re-draw count; the bytes each rank sent and received (point to point, values and
    optimizer state) per re-draw (a resumed run's from its checkpoint, then its own), the first :data:`DRAWS_LISTED`
    only (a run re-drawing every step would write a summary as long as the run), and their totals and maxima over
    every re-draw. Each rank's measured peak of each re-draw: ``memory.per_rank[r].redraw_peaks_bytes``."""
    per = {k: [[d[f"{k}_bytes"][r] for d in log] for r in range(world)] for k in ("sent", "received")}  # per rank
    return {"count": count, "draws": [{k: d[k] for k in ("draw", "sent_bytes", "received_bytes")} for d in log[:DRAWS_LISTED]],
            "draws_listed": min(len(log), DRAWS_LISTED), "bytes_moved": {k: [sum(v) for v in per[k]] for k in per},
            "largest_draw_bytes": {k: [max(v, default=0) for v in per[k]] for k in per}}
