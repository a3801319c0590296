"""One validation pass over the resolved config, run in the driver before any rank starts.

Why up front: a typo must cost seconds, not a cluster allocation. Every error names the key, the
value and what is allowed (torchtitan's ``ParallelDims`` validation is the model). Unknown group
options (``model=nope``) are refused by Hydra itself, listing the options; everything else is here:
the types, choices and ranges of every key (the typed schema, :mod:`sdp.driver.typed`: a config
composed from ``conf/`` is typed by Hydra itself), then what involves more than one key or the
world outside the config: names and importable ``_target_``\ s, dataset paths, the cluster, the
reliability keys (``train.resume`` must resolve, ``train.debug`` must name a rank and step of the
job), the memory budget's tracker, then one build
of the data index, the model (meta device) and the optimizer (:mod:`sdp.driver.preflight`), the model's
operations under ``train.deterministic`` on CUDA (:mod:`sdp.driver.determinism`), and last each
strategy's own ``validate``. ``tests/test_validation.py`` holds the catalogue of bad inputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from omegaconf import DictConfig, OmegaConf

from sdp.errors import ConfigError, fail, one_of, require

if TYPE_CHECKING:
    from sdp.driver.preflight import Preflight


# Keys that moved: a config or command line that still sets one fails naming the new key (Hydra's own
# "not in struct" message for a plain override would not say where the setting went).
RENAMED = {
    "parallelism.bn": "eval.bn (one evaluation protocol for every strategy)",
    "parallelism.bn_batches": "eval.bn_batches (one evaluation protocol for every strategy)",
    "parallelism.mixed_precision": "train.precision (fp32 | bf16, one key for every strategy: "
                                   "train.precision=bf16 where it was true, fp32 where it was false)",
}


def renamed_overrides(overrides: Iterable[str]) -> str | None:
    """The error for the first command-line override (``key=value``, ``+key=``, ``~key``) of a moved key."""
    for item in overrides:
        key = item.lstrip("+~").split("=", 1)[0]
        if key in RENAMED:
            return f"{key} is no longer a key: it moved to {RENAMED[key]}; override that instead ({item!r} given)"
    return None


def check_renamed(cfg: DictConfig) -> None:
    """A composed config (an experiment or preset YAML) that still sets a moved key."""
    for old, new in RENAMED.items():
        node, _, leaf = old.rpartition(".")
        parent = OmegaConf.select(cfg, node) if node else cfg
        if isinstance(parent, DictConfig) and leaf in parent:
            raise ConfigError(f"{old}={parent[leaf]!r} is invalid: the key moved to {new}")


def importable(key: str, value: Any, *, base: type | None = None) -> None:
    """A ``_target_`` must name an importable object (and a subclass of ``base`` when it is a class)."""
    from hydra.utils import get_object

    require(isinstance(value, str) and bool(value), key, value, "must be a dotted path such as pkg.module.Name")
    try:
        obj = get_object(value)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's typo to report
        fail(key, value, f"cannot be imported ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
             "allowed: a dotted path to an importable class or function")
    if base is not None and isinstance(obj, type):
        require(issubclass(obj, base), key, value, f"{obj.__name__} is not a subclass of {base.__module__}.{base.__name__}")


def validate_train(cfg: DictConfig) -> None:
    """The ``train:`` node's rules beyond its schema: ``train.resume`` must resolve, ``train.debug`` must name a
    rank and step of the job (types, choices and ranges: :func:`sdp.driver.typed.parse`, run first)."""
    from sdp.driver import checkpoint_resume

    tc = cfg.train
    if tc.resume is not None and str(tc.resume) != "auto":
        # raises ConfigError naming the path; its files are verified once, when sdp.driver.train.run resolves it again
        checkpoint_resume.resolve(resume=tc.resume, run_dir=None, verify=False)
    dbg = tc.debug
    if dbg.fault is not None:
        require(dbg.fault_rank < cfg.cluster.world_size, "train.debug.fault_rank", dbg.fault_rank,
                f"must be a rank of the job, < cluster.world_size={cfg.cluster.world_size}")
        if str(tc.budget) == "iterations":  # other budgets set train.steps later: checked again once resolved
            check_resolved(cfg)


def check_resolved(cfg: DictConfig) -> None:
    """What depends on the resolved ``train.steps`` (:func:`sdp.driver.budget.resolve_steps` may change it under
    ``train.budget=flops|tokens``): called by the driver once the budget is resolved, before any rank."""
    dbg, steps = cfg.train.debug, cfg.train.steps
    if dbg.fault is not None:
        require(dbg.fault_step <= steps, "train.debug.fault_step", dbg.fault_step,
                f"must be a step of the run, <= train.steps={steps}")


def validate_determinism(cfg: DictConfig) -> None:
    """``train.deterministic=true`` on CUDA: refuse a model that runs an operation PyTorch has no deterministic
    CUDA implementation of (it would raise in every rank at the first step), naming the operations."""
    if not cfg.train.deterministic or str(cfg.cluster.device) != "cuda":
        return
    from sdp.driver.determinism import nondeterministic_cuda_ops

    found = nondeterministic_cuda_ops(cfg.model)
    require(not found, "train.deterministic", True,
            f"model {cfg.model.get('name', cfg.model.get('_target_'))!r} runs {', '.join(f'{op} ({what})' for op, what in found.items())}, "
            "which has no deterministic CUDA implementation (torch.use_deterministic_algorithms would raise at the first "
            "step); allowed: train.deterministic=false on cluster.device=cuda for this model, or cluster.device=cpu")


def validate_strategy(cfg: DictConfig, *, model: Any, val_samples: int | None = None) -> Preflight:
    """The strategy's own checks, given its ``parallelism`` node and the job's facts (:class:`JobFacts`, read here
    once), after the node is held to the strategy's schema (:attr:`StrategySpec.schema`, :func:`sdp.core.fields.conform`:
    also a plugin's own untyped YAML under a package strategy, so its shared keys obey the same fields), then what it
    builds once from ``model`` (the driver's meta build) for the ranks (SDP's plan,
    checked): the :class:`Preflight` the budget, ``sdp-plan`` and the launch read (``val_samples``: the built
    validation set's size, None where the data was not built)."""
    from sdp.core.fields import conform
    from sdp.driver.preflight import Preflight
    from sdp.parallel import STRATEGIES, JobFacts, Strategy

    job, spec = JobFacts.of(cfg), STRATEGIES.get(str(cfg.parallelism.name))
    if spec.schema is not None:
        conform(cfg.parallelism, schema=spec.schema, prefix="parallelism")
    spec.validate(cfg=cfg.parallelism, job=job)
    save_final = str(cfg.train.get("save_final", "none"))  # a recorded config from before the key: none
    require(save_final == "none" or spec.runtime.final_state is not Strategy.final_state, "train.save_final", save_final,
            f"allowed: none for parallelism.name={cfg.parallelism.name}, whose strategy keeps no final weights "
            "(Strategy.final_state); the SDP strategies keep them")
    return Preflight(job=job, model=model, prepared=spec.prepare(cfg=cfg.parallelism, job=job, model=model),
                     val_samples=val_samples)


def validate(cfg: DictConfig, *, launching: bool = True) -> Preflight:
    """Check everything that can be checked without starting a rank; returns what was built for it once
    (the meta model, the job's facts, the strategy's plan), for the budget and the launch. ``launching=False``
    (``sdp-plan``: nothing runs here) skips what only a launch on this machine needs: visible CUDA devices."""
    from sdp.rank.rankenv import external_launcher
    from sdp.driver.typed import check_built, parse
    from sdp.models.base import SDPModel
    from sdp.parallel import STRATEGIES
    from sdp.registry import import_plugins
    from sdp.results.loggers import wandb_mode

    import_plugins(cfg)  # strategies defined outside sdp/ register themselves on import
    one_of("parallelism.name", cfg.parallelism.name, STRATEGIES.names())
    check_renamed(cfg)  # before parse: a moved key is named with its new place, not as unknown to the schema
    parse(cfg)  # types (a recorded config.yaml; a composed one was typed by Hydra), choices and ranges of every key
    check_built(cfg)  # the same for the arguments of the dataset, the model and the optimizer
    importable("model._target_", cfg.model.get("_target_"), base=SDPModel)
    importable("dataset._target_", cfg.dataset.get("_target_"))
    from sdp.data.common import preflight

    preflight(cfg.dataset)  # dataset files: a missing root or a bad shard fails here, named, before any rank
    importable("optim.optimizer._target_", cfg.optim.optimizer.get("_target_"))
    cl = cfg.cluster
    if external_launcher():
        import os

        env_world = int(os.environ["WORLD_SIZE"])
        from sdp.rank.rankenv import seen_env

        require(env_world == cl.world_size, "cluster.world_size", cl.world_size,
                f"the external launcher started a world of WORLD_SIZE={env_world} ranks (variables seen: {seen_env()}); "
                f"set cluster.world_size={env_world}, or fix the launch (every node must join one rendezvous)")
    if cl.device == "cuda" and launching:
        import torch

        n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
        require(n_gpu > 0, "cluster.device", cl.device, "no CUDA device is visible on this machine; use cluster.device=cpu")
        name, no_gloo = cfg.parallelism.name, STRATEGIES.get(str(cfg.parallelism.name)).gloo_cuda_refusal
        require(cl.backend != "gloo" or not no_gloo, "cluster.backend", cl.backend,
                f"parallelism={name} cannot run on cluster.device=cuda over gloo: {no_gloo}; "
                "allowed: cluster.backend=nccl (one GPU per rank), or cluster.device=cpu")
        if not external_launcher():
            share = (f"parallelism={name} cannot share a GPU over gloo ({no_gloo}): use at most {n_gpu} ranks, "
                     "or cluster.device=cpu") if no_gloo else "use cluster.backend=gloo to share a GPU"
            require(cl.backend != "nccl" or cl.world_size <= n_gpu, "cluster.world_size", cl.world_size,
                    f"NCCL needs one GPU per rank and {n_gpu} are visible; {share}")
    if cl.device == "cpu":
        require(cl.backend != "nccl", "cluster.backend", cl.backend, "NCCL needs cluster.device=cuda; use gloo or auto on CPU")
    validate_train(cfg)
    wandb_mode(cfg.logger.wandb.get("mode"))  # null reads WANDB_MODE: a value W&B would refuse is named here, not in rank 0
    if cfg.memory.budget_mb is not None:
        require(bool(cfg.memory.tracker) or cl.device == "cuda", "memory.budget_mb", cfg.memory.budget_mb,
                "on CPU the budget is enforced by the live-tensor tracker: set memory.tracker=true")
    from sdp.driver.preflight import build_once

    model, val_samples = build_once(cfg)  # data index, meta-device model, optimizer, sampler: what a rank would fail on
    validate_determinism(cfg)
    return validate_strategy(cfg, model=model, val_samples=val_samples)
