"""Build, once in the driver, what every rank builds first: the data index, the model (on the meta
device), the optimizer over the model's parameters and the global-batch sampler.

Why: :func:`sdp.driver.config.validate` checks keys one by one, but a model or optimizer argument that is the
right type and still cannot work (a negative width, ``momentum=-1``, a global batch larger than the
dataset) used to pass it and fail inside every spawned rank, as a bare ``IndexError`` or ``ValueError``
from deep in torch under a page of elastic-launcher traceback. Built here first, the same exception
becomes one :class:`~sdp.errors.ConfigError` line naming the config node (``dataset``, ``model``,
``optim.optimizer``, ``train``) and the original message, and no rank is started.

The model is built on the meta device (no memory, no init compute), so this costs about what
composing the config does; the dataset is built for real (its length is the data index the sampler
needs), which for the bundled and in-memory datasets takes about a second.

That meta model is the driver's only build of it (:func:`meta_model`): the strategy's checks and what it
builds once for the ranks (:func:`prepared`: SDP's plan, whose unit costs take one meta forward per
block), the budget's FLOP count and the run's launch all read it, rather than each building the model
again from the same config node. Why kept here rather than passed along: :func:`sdp.driver.config.validate`,
the budget and the launch are separate calls of the driver (and of tests) on one config, so the build
is kept from one validation (:func:`build_once` starts it afresh) to the next; a config with another
model node builds its own. Its readers
only read it (forwards on meta under a flop counter or a saved-bytes meter leave no state); a caller
that changes a model (``sdp-plan``'s activation checkpointing) builds its own.
"""

from __future__ import annotations

import copy
import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from omegaconf import DictConfig, OmegaConf

from sdp.errors import ConfigError
from sdp.registry import build


@contextmanager
def building(node: str, target: Any = None) -> Iterator[None]:
    """Re-raise any error of building config node ``node`` as one ConfigError line naming it."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - every build failure is a config problem to report
        from hydra.errors import InstantiationException

        if isinstance(exc, InstantiationException) and exc.__cause__ is not None:
            exc = exc.__cause__  # the target's own error, not Hydra's "Error in call to target" wrapper
        if isinstance(exc, ConfigError):
            raise exc from None
        first = (str(exc).strip().splitlines() or [""])[0]
        what = f"{node} ({target})" if target else node
        raise ConfigError(f"{what} cannot be built from this config: {type(exc).__name__}: {first}") from None


@dataclass
class DriverBuild:
    """The model built once on the meta device for one model node (``key``), and what each strategy
    prepared from it, keyed by the config that decides it."""

    key: str
    model: Any
    prepared: dict[str, Any] = field(default_factory=dict)


_LAST: list[DriverBuild] = []  # at most one: the last model node built


def _key(cfg: DictConfig, *paths: str) -> str:
    """The resolved values of ``paths`` in ``cfg``, as one comparable string."""
    values = [OmegaConf.select(cfg, p) for p in paths]
    return json.dumps([OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v for v in values],
                      sort_keys=True, default=str)


def meta_model(cfg: DictConfig) -> Any:
    """The job's model on the meta device: the driver's one build of ``cfg.model`` (built now if the last
    build was of another model node). Read it, do not change it."""
    key = _key(cfg, "model")
    if not _LAST or _LAST[0].key != key:
        with torch.device("meta"):
            model = build(cfg.model)
        _LAST[:] = [DriverBuild(key=key, model=model)]
    return _LAST[0].model


def prepared(cfg: DictConfig, *, build_now: bool = True) -> Any:
    """What the strategy builds once in the driver for its ranks (:meth:`sdp.parallel.spec.StrategySpec.prepare`:
    SDP's plan, checked), from :func:`meta_model`; computed once per model, ``parallelism`` node, world
    size and per-rank batch, so validation, the budget, ``sdp-plan`` and the launch share one.
    ``build_now=False``: only what is already built (None otherwise), for a reader that can do without it
    (the budget of a config never validated, in tests: a balanced neuron-level plan takes seconds)."""
    from sdp.parallel import STRATEGIES

    key = _key(cfg, "parallelism", "cluster.world_size", "train.batch_size")
    if not build_now:
        return _LAST[0].prepared.get(key) if _LAST and _LAST[0].key == _key(cfg, "model") else None
    model = meta_model(cfg)
    store = _LAST[0].prepared
    if key not in store:
        store[key] = STRATEGIES.get(str(cfg.parallelism.name)).prepare(cfg=cfg, model=model)
    return store[key]


def check_forward(*, model: torch.nn.Module, data: Any) -> None:
    """One meta-device forward of a real training sample's shape and dtype: a model whose input shape
    does not fit the data fails here, and so does an output narrower than the targets' range (the
    ``IndexError: Target 3 is out of bounds`` of a cross-entropy inside every rank)."""
    sample = torch.as_tensor(data.train[0][0])
    x = torch.stack([sample, sample]).to("meta")  # two samples: BatchNorm needs more than one value per channel
    with torch.no_grad():
        out = model(x)
    width = int(out.shape[-1])
    if width < int(data.num_classes):
        raise ValueError(f"its output has {width} logits per target but the dataset's targets take "
                         f"{data.num_classes} values (dataset.num_classes / vocab_size); allowed: >= {data.num_classes}")


def build_once(cfg: DictConfig) -> dict[str, Any]:
    """Build data index, meta-device model, optimizer and sampler as a rank would; returns what was
    built (the number of training samples and parameters) for the driver's log."""
    from sdp.data.base import GlobalBatchSampler
    from sdp.rank.trainer import global_batch_size

    with building("dataset", cfg.dataset.get("_target_")):
        data = build(cfg.dataset)
        num_samples = len(data.train)
    with building("model", cfg.model.get("_target_")):
        _LAST.clear()  # every validation builds afresh (and its strategy prepares, and warns, afresh)
        model = meta_model(cfg)  # the driver's one meta build, kept for the strategy and the budget
        params = list(model.parameters())
        check_forward(model=copy.deepcopy(model), data=data)  # on a copy: a forward may leave caches (rotary)
    with building("optim.optimizer", cfg.optim.optimizer.get("_target_")):
        build(cfg.optim.optimizer)(params)
    with building("train", "the global-batch sampler over the data index"):
        GlobalBatchSampler(num_samples=num_samples, global_batch=global_batch_size(cfg), seed=int(cfg.seed))
    return {"train_samples": num_samples, "params": sum(p.numel() for p in params)}
