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

That meta model is the driver's only build of it: :func:`build_once` returns it, and
:func:`sdp.driver.config.validate` hands it on in a :class:`Preflight` with the job's facts
(:class:`sdp.parallel.job.JobFacts`) and what the strategy builds once from it for the ranks (SDP's plan, whose
unit costs take one meta forward per block). The budget's FLOP count, ``sdp-plan`` and the launch take that
object as an argument, rather than each building the model again from the same config node (or finding it in
a module-level cache, which a test or a second job in one process would share). Its readers only read it
(forwards on meta under a flop counter or a saved-bytes meter leave no state); a caller that changes a model
(``sdp-plan``'s activation checkpointing) builds its own.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from omegaconf import DictConfig

from sdp.errors import ConfigError
from sdp.parallel.job import JobFacts
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


@dataclass(frozen=True)
class Preflight:
    """What the driver built once for one job config, passed on by argument: :func:`sdp.driver.config.validate`
    returns it; the budget (:func:`sdp.driver.budget.apply`), ``sdp-plan`` and the launch read it."""

    job: JobFacts  # the facts of the job a strategy reads besides its own node
    model: Any  # the model on the meta device (read it, do not change it)
    prepared: Any  # what the strategy built for its ranks (StrategySpec.prepare: SDP's plan), None for most
    val_samples: int | None = None  # len() of the validation set the dataset built (what evaluation shards over the
    #   ranks; sdp-plan's evaluation batch); None: the data was not built (validate_strategy alone)


def meta_model(cfg: DictConfig) -> Any:
    """``cfg.model`` built on the meta device: for a caller outside the driver's validation (a test, a budget
    asked of a config never validated); the driver itself reads :attr:`Preflight.model`."""
    with torch.device("meta"):
        return build(cfg.model)


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


def build_once(cfg: DictConfig) -> tuple[Any, int]:
    """Build data index, meta-device model, optimizer and sampler as a rank would; returns the meta-device
    model (the driver's one build of it, :class:`Preflight`) and the validation set's size, read here from the
    data the ranks will shard (``len(data.val)``: the real size whatever the config says or leaves unset, e.g.
    digits' ``val_fraction`` of 1797 images, FineWeb's windows under ``val_tokens``)."""
    from sdp.data.base import GlobalBatchSampler
    from sdp.rank.trainer import global_batch_size

    with building("dataset", cfg.dataset.get("_target_")):
        data = build(cfg.dataset)
        num_samples, val_samples = len(data.train), len(data.val)
    with building("model", cfg.model.get("_target_")):
        model = meta_model(cfg)  # the driver's one meta build, handed on for the strategy and the budget
        params = list(model.parameters())
        check_forward(model=copy.deepcopy(model), data=data)  # on a copy: a forward may leave caches (rotary)
    with building("optim.optimizer", cfg.optim.optimizer.get("_target_")):
        build(cfg.optim.optimizer)(params)
    with building("train", "the global-batch sampler over the data index"):
        GlobalBatchSampler(num_samples=num_samples, global_batch=global_batch_size(cfg), seed=int(cfg.seed))
    return model, val_samples
