"""Seeded initialisation module by module, so a rank can materialise only what it holds.

Why per-module seeds: a model built the usual way draws every tensor from one generator stream in
construction order, so the values of block 5 depend on every tensor drawn before it and a rank that
holds block 5 would have to build blocks 0-4 too. Here the model is built on the meta device (no
storage, no RNG use) and each module that owns tensors is then materialised on its own from a seed
derived from (``seed``, the module's dotted name): the values of a module do not depend on which
other modules exist, so forward-masking SDP materialises only its held units and the shared parts
and gets exactly the values of the full build, and DDP, FSDP and SDP at C = 1 hold the same model.

A module is initialised by its own ``reset_parameters`` (PyTorch's layers, and any model module that
defines one) followed by the model's :meth:`~sdp.models.base.SDPModel.init_module` hook (the model's
own scheme: LLaMA's N(0, 0.02), ViT's truncated normal). A module with tensors that neither covers is
refused by name, never left with uninitialised memory. Tied parameters (shared embeddings) stay tied.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Iterable

import torch
from torch import nn

if TYPE_CHECKING:
    from sdp.models.base import SDPModel


def module_seed(seed: int, name: str) -> int:
    """A 63-bit seed for module ``name`` of the model seeded ``seed`` (stable across runs and ranks)."""
    digest = hashlib.sha256(f"{int(seed)}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _direct(module: nn.Module) -> list[torch.Tensor]:
    return [t for t in list(module._parameters.values()) + list(module._buffers.values()) if t is not None]


def is_meta(module: nn.Module) -> bool:
    """True when a tensor the module owns directly is still on the meta device."""
    return any(t.is_meta for t in _direct(module))


def meta_tensors(model: nn.Module) -> list[str]:
    """Dotted names of the model's parameters and buffers that are still meta."""
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    return [n for n, t in named if t.is_meta]


def ties(model: nn.Module) -> dict[str, str]:
    """name -> first name, for every parameter that is the same object as an earlier one."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def materialise_module(model: "SDPModel", name: str, *, device: torch.device | str = "cpu") -> None:
    """Give module ``name`` of ``model`` real storage on ``device`` and initialise it from its seed."""
    seed = getattr(model, "init_seed", None)
    assert seed is not None, f"{type(model).__name__} has no init_seed: build it with sdp.rank.worker.build_model"
    module = model.get_submodule(name) if name else model
    if not is_meta(module):
        return
    has_reset = callable(getattr(module, "reset_parameters", None))
    module.to_empty(device=device, recurse=False)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(module_seed(seed, name))
        if has_reset:
            module.reset_parameters()
        handled = model.init_module(module)
    assert has_reset or handled, (
        f"cannot initialise module {name!r} ({type(module).__name__}) of {type(model).__name__} from the meta "
        f"device: it owns {[n for n, t in list(module._parameters.items()) + list(module._buffers.items()) if t is not None]}, "
        f"has no reset_parameters and the model's init_module does not handle it")
    for dup, src in getattr(model, "init_ties", {}).items():  # tied parameters stay one object: the first name's
        value = model.get_parameter(src)
        if not value.is_meta:
            owner_name, _, leaf = dup.rpartition(".")
            (model.get_submodule(owner_name) if owner_name else model)._parameters[leaf] = value


def on_meta(model: "SDPModel", *, seed: int) -> "SDPModel":
    """Mark a model just built on the meta device for seeded materialisation (seed and tied names)."""
    assert not any(not t.is_meta for t in list(model.parameters()) + list(model.buffers())), \
        f"{type(model).__name__} was not built on the meta device"
    model.init_seed = int(seed)
    model.init_ties = ties(model)
    return model


def materialise(model: "SDPModel", *, names: Iterable[str] | None = None, device: torch.device | str = "cpu") -> None:
    """Materialise the modules ``names`` (None: every module that owns tensors), in module order."""
    wanted = None if names is None else set(names)
    for name, module in list(model.named_modules()):
        if (wanted is None or name in wanted) and is_meta(module):
            materialise_module(model, name, device=device)


def skeleton(model: "SDPModel") -> "SDPModel":
    """A copy of ``model`` while it is still entirely on the meta device (no storage, seed and ties kept):
    the full-size shapes :func:`materialise_sharded` initialises from once the model itself is sharded."""
    import copy

    real = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if not t.is_meta]
    assert not real, f"{type(model).__name__}: skeleton() needs a model entirely on the meta device; materialised: {real[:5]}"
    return copy.deepcopy(model)


def _fill(target: torch.Tensor, full: torch.Tensor, *, name: str) -> None:
    """Copy into ``target`` the part of ``full`` it holds: a DTensor's local shard, a plain tensor whole."""
    if hasattr(target, "to_local"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(full.shape, target.device_mesh, target.placements)
        local = target.to_local()
        assert tuple(local.shape) == tuple(shape), f"{name}: local shard {tuple(local.shape)} != DTensor layout {tuple(shape)}"
        local.copy_(full[tuple(slice(o, o + s) for o, s in zip(offset, shape))])
    else:
        assert target.shape == full.shape, f"{name}: {tuple(target.shape)} != full build {tuple(full.shape)}"
        target.copy_(full)


def materialise_sharded(model: nn.Module, *, skeleton: "SDPModel") -> None:
    """Fill ``model`` with the values of the full build where it was sharded on the meta device and then
    given storage (FSDP2: ``fully_shard`` on meta, ``to_empty``): parameters are DTensors of which this
    rank allocated only its shard. Module by module, ``skeleton`` (:func:`skeleton`, taken before
    sharding) materialises the module alone on the CPU from its seed, exactly as the full build does,
    this rank copies in the part it holds, and the module goes back to meta: at most one module's full
    tensors ever exist beyond the rank's shards, never the full model. A tied parameter is filled once,
    by its first owner (in ``model`` its later owners hold the same tensor)."""
    ties = dict(getattr(skeleton, "init_ties", {}))
    for name, module in list(skeleton.named_modules()):
        own = [(kind, key) for kind in ("_parameters", "_buffers") for key, t in getattr(module, kind).items()
               if t is not None and (f"{name}.{key}" if name else key) not in ties]
        if not own:
            continue
        materialise_module(skeleton, name)
        target = model.get_submodule(name) if name else model
        with torch.no_grad():
            for kind, key in own:
                _fill(getattr(target, kind)[key], getattr(module, kind)[key], name=f"{name}.{key}" if name else key)
        module.to_empty(device="meta", recurse=False)  # release this module's full tensors
        for dup, src in ties.items():  # and the references materialise_module gave their later owners
            if src.rpartition(".")[0] == name:
                owner, _, leaf = dup.rpartition(".")
                (skeleton.get_submodule(owner) if owner else skeleton)._parameters[leaf] = skeleton.get_parameter(src)
