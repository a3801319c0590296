"""Forward and backward masking: turning the full model into what one worker really holds.

Every tensor of the full model is cut into :class:`Piece`\\ s, each with its holder set: a whole
tensor of a block unit, one hidden group of a sliced tensor at neuron level, a block's remainder
(branch tensors no group slices, held by the union of the block's group holders) or a shared
tensor (all ranks). :class:`Layout` then says where each piece this rank has lives locally.

- **Forward masking**: a non-held block is set inactive and its branch tensors are deleted, so it
  is never executed and nothing of it is allocated (the model arrives on the meta device and only
  the held modules are materialised, just before they are pruned; then what is left moves). At neuron level the held groups are gathered into
  physically narrower dense tensors (every HiddenSlice, buffers included), so FLOPs and bytes fall.
- **Backward masking**: all values stay; non-held tensors get ``requires_grad=False`` so autograd
  skips their weight gradient but still propagates activation gradients. A partly held tensor
  (neuron level) is split into a held Parameter and a frozen rest, re-joined for each call of its
  layer; autograd keeps a recipe instead of the joined full-size weight (:mod:`sdp.subnet.rejoin`).
- **Global refresh** (``refresh=global``): nothing is frozen; gradients of non-held pieces are
  zeroed and everything is all-reduced and updated (see :mod:`sdp.subnet.sync`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from sdp.models.base import SDPModel
from sdp.subnet.plan import Plan
from sdp.subnet.units import sliced_names
from sdp.subnet.rejoin import _DeviceIndex, _split_forward


@dataclass(frozen=True)
class Piece:
    """A part of one full-model tensor with its holders (``dim`` None: the whole tensor)."""

    name: str
    is_param: bool
    dim: int | None
    start: int
    length: int
    holders: tuple[int, ...]
    nbytes: int
    block: int | None = None
    group: int | None = None

    @property
    def shared(self) -> bool:
        return self.block is None


@dataclass
class Local:
    """Where one full-model tensor lives on this rank: ``whole`` (global layout) or split into a
    held part (held groups, ascending) and a rest part (the other groups, backward masking only)."""

    held: torch.Tensor | None
    rest: torch.Tensor | None = None
    dim: int | None = None
    held_groups: tuple[int, ...] = ()
    rest_groups: tuple[int, ...] = ()
    width: int = 0


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    mod, _, leaf = name.rpartition(".")
    return (model.get_submodule(mod) if mod else model), leaf


def pieces(model: SDPModel, plan: Plan) -> list[Piece]:
    """Every parameter and buffer of the full model, cut by the plan (same list on every rank)."""
    world = tuple(range(plan.world_size))
    units_of: dict[int, list[int]] = {}
    for u, unit in enumerate(plan.units):
        units_of.setdefault(unit.block, []).append(u)
    out: list[Piece] = []
    tensors = [(n, t, True) for n, t in model.named_parameters()] + [(n, t, False) for n, t in model.named_buffers()]
    for name, t, is_param in tensors:
        parts = name.split(".")
        b = int(parts[1]) if parts[0] == "blocks" and int(parts[1]) in units_of else None
        rel = ".".join(parts[2:])
        nb = t.numel() * t.element_size()
        if b is not None and not any(rel == s or rel.startswith(s + ".") for s in model.blocks[b].shared_submodules()):
            us = units_of[b]
            sl = sliced_names(model.blocks[b]) if plan.units[us[0]].group is not None else {}
            if rel in sl:
                dim, uw = sl[rel]
                w = t.shape[dim] // plan.groups
                assert w * plan.groups == t.shape[dim], f"{name} dim {dim} size {t.shape[dim]} not divisible by {plan.groups}"
                for u in us:
                    g = plan.units[u].group
                    nbytes = t.numel() // t.shape[dim] * w * t.element_size()
                    out.append(Piece(name, is_param, dim, g * w, w, plan.holders[u], nbytes, b, g))
            elif len(us) == 1:
                out.append(Piece(name, is_param, None, 0, t.numel(), plan.holders[us[0]], nb, b, plan.units[us[0]].group))
            else:
                out.append(Piece(name, is_param, None, 0, t.numel(), plan.block_holders(b), nb, b, None))
        else:
            out.append(Piece(name, is_param, None, 0, t.numel(), world, nb))
    return out


def _set(owner: nn.Module, leaf: str, value: torch.Tensor | None, *, is_param: bool) -> None:
    if is_param:
        owner._parameters[leaf] = value  # type: ignore[assignment]
    else:
        owner._buffers[leaf] = value


def _fix_sizes(owner: nn.Module, leaf: str, dim: int, size: int) -> None:
    """Keep a narrowed layer's size attributes true (repr, shape checks)."""
    if isinstance(owner, nn.modules.conv._ConvNd) and leaf == "weight":
        setattr(owner, "out_channels" if dim == 0 else "in_channels", size)
    elif isinstance(owner, nn.Linear) and leaf == "weight":
        setattr(owner, "out_features" if dim == 0 else "in_features", size)
    elif isinstance(owner, nn.modules.batchnorm._NormBase):
        owner.num_features = size


def _group_index(groups: tuple[int, ...], width: int, device: torch.device) -> torch.Tensor:
    return torch.cat([torch.arange(g * width, (g + 1) * width, device=device) for g in groups])


def apply(
    model: SDPModel, plan: Plan, *, rank: int, masking: str, all_pieces: list[Piece],
    materialise: Callable[[str], None] | None = None,
) -> dict[str, Local]:
    """Mask ``model`` in place for ``rank``; returns name -> :class:`Local` for every tensor held
    or stored here. ``masking``: forward | backward | global (backward masking, global refresh).
    A model built on the meta device (forward masking) gets each module this rank holds a piece of
    materialised by ``materialise(module name)`` just before its tensors are pruned or narrowed, so
    at most one module's full tensors exist beyond what the rank keeps. The layout holds tensor objects:
    after moving the model (``.to(device)``), re-point it with :func:`rebind`."""
    by_name: dict[str, list[Piece]] = {}
    for p in all_pieces:
        by_name.setdefault(p.name, []).append(p)
    layout: dict[str, Local] = {}
    splits: dict[nn.Module, list[tuple[str, int, _DeviceIndex]]] = {}
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, ps in by_name.items():
        t = state[name]
        owner, leaf = _owner(model, name)
        is_param = ps[0].is_param
        mine = [p for p in ps if rank in p.holders]
        if t.is_meta and mine and materialise is not None:  # None: a meta-device plan (sdp-plan)
            assert masking == "forward", f"{name} is on the meta device under masking={masking}"
            materialise(name.rpartition(".")[0])
            t = (owner._parameters if is_param else owner._buffers)[leaf]  # type: ignore[assignment]
        if masking == "global" or len(mine) == len(ps):
            layout[name] = Local(held=t)
            continue
        if masking == "backward":
            if not is_param:
                layout[name] = Local(held=t)  # buffers stay whole: the full forward updates them all
            elif not mine:
                t.requires_grad_(False)
                layout[name] = Local(held=None, rest=t)
            else:  # partly held (neuron level): held groups trainable, the rest frozen
                dim, w = ps[0].dim, ps[0].length
                assert dim is not None
                hg = tuple(p.group for p in mine)  # type: ignore[misc]
                rg = tuple(p.group for p in ps if rank not in p.holders)  # type: ignore[misc]
                held = nn.Parameter(t.detach().index_select(dim, _group_index(hg, w, t.device)))
                rest = nn.Parameter(t.detach().index_select(dim, _group_index(rg, w, t.device)), requires_grad=False)
                # on the CPU for a meta model (a re-draw builds its new subnetwork on meta): a meta index has no values
                inverse = _DeviceIndex(torch.argsort(_group_index(hg + rg, w, torch.device("cpu") if t.is_meta else t.device)))
                del owner._parameters[leaf]
                owner.register_parameter(leaf + "_held", held)
                owner.register_parameter(leaf + "_rest", rest)
                splits.setdefault(owner, []).append((leaf, dim, inverse))
                layout[name] = Local(held=held, rest=rest, dim=dim, held_groups=hg, rest_groups=rg, width=w)
            continue
        # forward masking: drop what is not held, narrow what is partly held
        if not mine:
            _set(owner, leaf, None, is_param=is_param)
            continue
        dim, w = ps[0].dim, ps[0].length
        assert dim is not None, f"{name}: a whole tensor is either held or not"
        hg = tuple(p.group for p in mine)  # type: ignore[misc]
        narrow = t.detach().index_select(dim, _group_index(hg, w, t.device))
        new = nn.Parameter(narrow, requires_grad=t.requires_grad) if is_param else narrow
        _set(owner, leaf, new, is_param=is_param)
        _fix_sizes(owner, leaf, dim, narrow.shape[dim])
        layout[name] = Local(held=new, dim=dim, held_groups=hg, width=w)
    for owner, specs in splits.items():
        owner.forward = _split_forward(owner, specs)  # instance attribute: shadows the class's forward
    if masking == "forward":
        for b in {p.block for p in all_pieces if p.block is not None}:
            model.blocks[b].active = rank in plan.block_holders(b)
    return layout


def rebind(model: nn.Module, layout: dict[str, Local]) -> dict[str, Local]:
    """``layout`` re-pointed at ``model``'s live tensors, to be taken after every move of the masked model.

    Why: :func:`apply` runs where the model is pruned (the CPU), and ``Module.to(cuda)`` (``_apply``)
    keeps the Parameter objects but puts a new tensor in every buffer slot (and in every parameter slot
    under torch's overwrite-on-conversion flag); a layout holding the old objects would have assembly
    read stale BatchNorm statistics (the initial ones) and re-draws reset them. Same groups and widths,
    only the tensors change; a shape change means the move was not one."""
    out: dict[str, Local] = {}
    for name, loc in layout.items():
        owner, leaf = _owner(model, name)

        def live(key: str) -> torch.Tensor:
            return owner._parameters[key] if key in owner._parameters else owner._buffers[key]  # type: ignore[return-value]

        if loc.held is not None and loc.rest is not None:  # split (backward masking, neuron level)
            held, rest = live(leaf + "_held"), live(leaf + "_rest")
        elif loc.held is None:  # not held (backward masking): kept frozen
            held, rest = None, live(leaf)
        else:
            held, rest = live(leaf), None
        for old, new in ((loc.held, held), (loc.rest, rest)):
            assert old is None or old.shape == new.shape, f"{name}: {tuple(old.shape)} became {tuple(new.shape)}"
        out[name] = Local(held=held, rest=rest, dim=loc.dim, held_groups=loc.held_groups, rest_groups=loc.rest_groups,
                          width=loc.width)
    return out


def locate(piece: Piece, layout: dict[str, Local]) -> tuple[torch.Tensor, int | None, int, int] | None:
    """(local tensor, dim, start, length) holding ``piece`` on this rank; None when it lacks it.
    The same spec addresses the tensor's ``.grad``."""
    loc = layout.get(piece.name)
    if loc is None:
        return None
    if piece.dim is None or loc.dim is None:
        t = loc.held if loc.held is not None else loc.rest
        return None if t is None else (t, piece.dim, piece.start, piece.length)
    for part, groups in ((loc.held, loc.held_groups), (loc.rest, loc.rest_groups)):
        if part is not None and piece.group in groups:
            return part, loc.dim, groups.index(piece.group) * loc.width, loc.width
    return None


def view(t: torch.Tensor, dim: int | None, start: int, length: int) -> torch.Tensor:
    return t if dim is None else t.narrow(dim, start, length)


def held_parameters(layout: dict[str, Local], pieces_: list[Piece], rank: int) -> Iterator[nn.Parameter]:
    """The parameters this rank trains (optimizer and gradient state exist only for these)."""
    seen: set[int] = set()
    for p in pieces_:
        if p.is_param and rank in p.holders:
            loc = layout[p.name]
            t = loc.held
            if isinstance(t, nn.Parameter) and t.requires_grad and id(t) not in seen:
                seen.add(id(t))
                yield t


def masking_mode(*, masking: str, refresh: str) -> str:
    """The mode :func:`apply` takes: forward | backward | global (backward masking, global refresh)."""
    return "forward" if masking == "forward" else ("backward" if refresh == "holders" else "global")


def rank_subnetworks(model: SDPModel, plan: Plan, *, mode: str, all_pieces: list[Piece]
                     ) -> Iterator[tuple[int, SDPModel, dict[str, Local], list[nn.Parameter]]]:
    """For every rank of ``plan``: (rank, a masked copy of ``model``, its layout, the parameters it
    trains), the per-rank view the planner and the peak predictor both rehearse on the meta device."""
    for r in range(plan.world_size):
        mine = copy.deepcopy(model)
        layout = apply(mine, plan, rank=r, masking=mode, all_pieces=all_pieces)
        trained = list(mine.parameters()) if mode == "global" else list(held_parameters(layout, all_pieces, r))
        yield r, mine, layout, trained

