"""The facts of a job a strategy may read besides its own ``parallelism`` node.

Both halves of a strategy receive them (the driver's :class:`~sdp.parallel.spec.StrategySpec` and the ranks'
:class:`~sdp.parallel.base.Strategy`), so they live in a leaf module both import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from sdp.errors import ConfigError, one_of, positive_int

AC_MODES = ("none", "full", "op")  # train.ac's values (its schema field names this tuple; sdp.parallel.ac says each)


@dataclass(frozen=True)
class JobFacts:
    """The facts of the job a strategy may read besides its own ``parallelism`` node, read from the composed
    config once by the driver (and by each rank from the config the driver wrote) with :meth:`of`.

    Why a short list rather than the config: a strategy that read any key of the job would depend on keys
    no one could see from its signature (SDP's rescale rule on ``eval.bn``, the pipeline's cut on the batch);
    here every such dependency is a field. The defaults are those of a job that sets nothing (tests build
    a ``JobFacts`` directly)."""

    world_size: int = 1  # cluster.world_size
    batch_size: int = 1  # train.batch_size: the per-rank batch
    seed: int = 0  # seed: the job's seed (a strategy's own random draws derive from it)
    precision: str = "fp32"  # train.precision
    device: str = "cpu"  # cluster.device: what the planner's meta rehearsal reproduces (sdp.parallel.device_forward)
    eval_bn: str = "reestimate"  # eval.bn: how evaluation treats BatchNorm statistics
    eval_subnetworks: bool = False  # eval.subnetworks: also evaluate each worker's own subnetwork (forward masking)
    eval_ensemble: bool = False  # eval.ensemble: also evaluate the ensemble of the workers' subnetworks (same pass)
    model_name: str = ""  # model.name, for messages and plan titles
    optimizer: Any = None  # the optim.optimizer node (sdp-plan: optimizer state bytes and rehearsal)
    ac_every: int = 0  # activation checkpointing: blocks 0, k, 2k, ... (0: none), from train.ac / train.ac_every
    ac_mode: str = "full"  # how those blocks are checkpointed: full (the input only) or op (matmul outputs too)
    steps: int = 0  # train.steps: the run's steps (on the ranks: as the budget resolved them; 0: not known)
    warmup_steps: int = 0  # train.warmup_steps: the first steps, whose traffic the run's per-step means leave out
    phase_steps: tuple[int, ...] = ()  # each training phase's steps where the budget split the run (summary.json
    #                                    budget.phases, StrategySpec.later_phase); (): one phase, or not known

    @classmethod
    def of(cls, cfg: DictConfig, *, budget: dict[str, Any] | None = None) -> JobFacts:
        """The facts of the whole job config ``cfg`` (``budget``: the driver's resolution, :mod:`sdp.driver.budget`,
        where the ranks have it: its phases' step counts). ``train.precision`` and ``eval.bn`` keep the defaults
        in a run's recorded config written before those keys existed (reports read such runs)."""
        sel = lambda key, default: OmegaConf.select(cfg, key, default=default)  # noqa: E731
        return cls(world_size=int(cfg.cluster.world_size), batch_size=int(cfg.train.batch_size),
                   seed=int(sel("seed", cls.seed)), precision=str(sel("train.precision", cls.precision)),
                   device=str(sel("cluster.device", cls.device)),
                   eval_bn=str(sel("eval.bn", cls.eval_bn)), eval_subnetworks=bool(sel("eval.subnetworks", False)),
                   eval_ensemble=bool(sel("eval.ensemble", False)), model_name=str(sel("model.name", "") or ""),
                   optimizer=sel("optim.optimizer", None), ac_every=ac_every(cfg),
                   ac_mode=ac_mode(cfg),
                   steps=int(sel("train.steps", cls.steps)), warmup_steps=int(sel("train.warmup_steps", cls.warmup_steps)),
                   phase_steps=tuple(int(p["steps"]) for p in (budget or {}).get("phases") or ()))


def ac_every(cfg: DictConfig) -> int:
    """The job's activation checkpointing as a block stride (0: none): ``train.ac=full`` (or ``op``) checkpoints
    blocks 0, ``train.ac_every``, 2 x ``train.ac_every``, ...; a preset whose ``parallelism`` node declares
    ``ac_every`` (``parallelism=ddp_ac``, and the runs recorded with it) turns full checkpointing on with its own
    stride. A recorded config from before ``train.ac`` existed reads as none. Refused, naming the key: an unknown
    mode, a stride < 1, ``train.ac=full`` with a stride other than the preset's, and a preset with ``train.ac=op``."""
    sel = lambda key, default: OmegaConf.select(cfg, key, default=default)  # noqa: E731
    mode, every, preset = sel("train.ac", "none"), sel("train.ac_every", 1), sel("parallelism.ac_every", None)
    one_of("train.ac", mode, AC_MODES)
    for name, value in (("train.ac_every", every), ("parallelism.ac_every", preset)):
        if value is not None:
            positive_int(name, value)
    if preset is not None and mode == "full" and every != preset:
        raise ConfigError(f"train.ac_every={every} disagrees with parallelism.ac_every={preset} of "
                          f"parallelism.name={sel('parallelism.name', None)!r}: set one of them")
    if preset is not None and mode == "op":
        raise ConfigError(f"train.ac=op with parallelism.name={sel('parallelism.name', None)!r}, a preset of full "
                          f"checkpointing (parallelism.ac_every={preset}): use its base strategy with train.ac=op")
    return int(preset) if preset is not None else (int(every) if mode in ("full", "op") else 0)


def ac_mode(cfg: DictConfig) -> str:
    """How :func:`ac_every`'s blocks are checkpointed: ``op`` under ``train.ac=op``, else ``full`` (the stride says
    whether any block is)."""
    return "op" if OmegaConf.select(cfg, "train.ac", default="none") == "op" else "full"
