"""The typed schema of the job config (torchtitan's ``job_config.py`` is the model): one dataclass per node.

Why: a wrong type (``train.steps=abc``, ``parallelism.coverage=high``) is refused by OmegaConf while
Hydra composes the config, naming the key, before anything runs; a wrong choice or range is refused
by :func:`sdp.core.fields.check`, one pass over every field's metadata. Each YAML of ``conf/``
extends its schema through its defaults list (``- /schema/...@_here_``, Hydra 1.3's documented way to
validate a config file against a structured config), so the YAML keeps the values and their comments
and the dataclass says what each key is: type, meaning, allowed values. Fields are declared in the
YAML's key order (a typed node keeps its schema's order: ``config.yaml`` and ``--cfg job`` unchanged).
Each ``parallelism`` schema is its strategy's own, declared in its module (:attr:`sdp.parallel.spec.StrategySpec.schema`);
:mod:`sdp.driver.typed` registers all and parses a composed (or recorded) config once. Adding a key: docs/configs.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from sdp.core.fields import Number, flag, key
from sdp.metrics.hardware import gpus, links
from sdp.parallel.job import AC_MODES
from sdp.parallel.device_forward import DEVICES
from sdp.rank.final_weights import SAVE_FINAL
from sdp.rank.guards import POLICIES
from sdp.core.precision import PRECISIONS
from sdp.rank.schedule import SCHEDULES
from sdp.results.loggers import WANDB_MODES

# A choice's values are written once. Where the code acting on them sits below the driver (the rank's guards, the
# precision, the schedule, the loggers, the planner's devices) it declares the tuple and its field names it here;
# code at or above the driver reads a field's values with sdp.core.fields.choices_of.
BACKENDS = ("auto", "gloo", "nccl")  # cluster.backend, of both cluster schemas


@dataclass
class Debug:
    """``train.debug``: fault injection for the reliability tests (sdp/rank/faults.py)."""

    fault: Optional[str] = key(choices=("kill", "hang", "nan_loss"))  # not "nan": Hydra reads that as a float
    """null: no fault | kill (SIGKILL itself) | hang (sleep forever) | nan_loss (that step's loss times NaN)."""
    fault_rank: int = key(at_least=0)
    """The rank the fault happens on (< cluster.world_size)."""
    fault_step: int = key(at_least=1)
    """The step it happens at, 1-based (<= the resolved train.steps)."""


@dataclass
class Train:
    """``train``: steps, batches, evaluation points, budget, checkpoints and the reliability keys."""

    steps: int = key(at_least=1)
    """Optimizer steps (under train.budget=flops: DDP's step count)."""
    batch_size: int = key(at_least=1)
    """Samples per rank and step."""
    eval_every: int = key(at_least=0)
    """Evaluate every N steps (0: only at the end)."""
    eval_points: Optional[int] = key(at_least=1)
    """null, or evaluate N times evenly over the resolved steps instead of eval_every."""
    eval_batch_size: int = key(at_least=1)
    """Per-rank batch during evaluation."""
    log_every: int = key(at_least=1)
    """A metrics.jsonl row every N steps."""
    warmup_steps: int = key(at_least=0)
    """First steps excluded from the time and comm medians."""
    precision: str = key(choices=PRECISIONS)
    """fp32 | bf16 (forward and loss under torch.autocast(bf16); fp32 master weights)."""
    ac: str = key(choices=AC_MODES)
    """Activation checkpointing, every strategy: none | full (blocks 0, ac_every, 2 ac_every, ... keep only their input)
    | op (those blocks keep their matmul and attention outputs too: torchtitan's selective op AC, sdp/parallel/ac_op.py)."""
    ac_every: int = key(at_least=1)
    """train.ac=full or op: checkpoint every k-th block (1: every block)."""
    num_workers: int = key(at_least=0)
    """DataLoader worker processes."""
    budget: str = key(choices=("iterations", "flops", "tokens"))
    """What train.steps means: iterations | flops (DDP's steps, scaled by 1/r) | tokens (from train.tokens)."""
    flops_ratio: str = key(choices=("coverage", "measured"))
    """budget=flops: r from the coverage rule or from the model's measured FLOP count."""
    flops_reference: Any = key()
    """budget=flops: null (train.steps is DDP's steps on the run's own model) | model keys changed to give the
    reference model train.steps is DDP's steps on, e.g. {n_layers: 8}: r x (own FLOPs / the reference's)."""
    tokens: Optional[int] = key(at_least=1)
    """budget=tokens: tokens to train on."""
    checkpoint_every: int = key(at_least=0)
    """Checkpoint every N steps and at the last step (0: never)."""
    checkpoint_keep: int = key(at_least=0)
    """Complete checkpoints kept (0: all)."""
    checkpoint_timeout_s: Number = key(above=0)
    """Seconds a rank waits for the others while a checkpoint is written."""
    save_final: str = key(choices=SAVE_FINAL)
    """none | fp32 | bf16 | fp16: keep the final weights in <run_dir>/final/ in that dtype (sdp/rank/final_weights.py)."""
    resume: Optional[str] = key()
    """null: fresh | auto: this run dir's latest checkpoint | a checkpoint or run directory."""
    extend_steps: bool = flag()
    """A resume may raise train.steps above the checkpoint's."""
    skip_done: bool = flag()
    """Re-running a sweep skips complete jobs of the same config and resumes the others."""
    nan_policy: str = key(choices=POLICIES)
    """Non-finite loss or gradient norm: stop the run | skip that step's update."""
    deterministic: bool = flag()
    """torch.use_deterministic_algorithms(True)."""
    tf32: bool = flag()
    """CUDA only: fp32 matmuls and convolutions on TF32 tensor cores."""
    debug: Debug = field(default_factory=Debug)
    """Fault injection (leave fault null)."""


@dataclass
class Eval:
    """``eval``: the evaluation protocol, one rule for every strategy (sdp/rank/evaluation.py)."""

    bn: str = key(choices=("reestimate", "average"))
    """BatchNorm statistics of the evaluated model: re-estimated on it | the ranks' momentum statistics averaged."""
    bn_batches: int = key(at_least=1)
    """Training batches (steps) in the calibration set of bn=reestimate."""
    subnetworks: bool = flag()
    """Forward-masked SDP: also evaluate each worker's own subnetwork (and the assembly gap)."""
    ensemble: bool = flag()
    """Forward-masked SDP: also evaluate the ensemble of the workers' subnetworks."""
    part_batches: int = key(at_least=1)
    """Batches a part-by-part evaluation runs per fetched part (memory vs traffic)."""


@dataclass
class Memory:
    """``memory``: per-rank memory measurement."""

    tracker: bool = flag()
    """CPU: count live tensor bytes (false: RSS only); CUDA always uses the allocator."""
    budget_mb: Optional[Number] = key(above=0)
    """null, or a per-rank limit in MiB (on CPU enforced by the tracker)."""


@dataclass
class Plan:
    """``plan``: sdp-plan only (predicted memory and comm, nothing launched)."""

    output: Optional[str] = key()
    """null (print only) or a JSON file to write the prediction to."""
    frontier: bool = flag()
    """parallelism=sdp, block level: also print the floor and Pareto frontier of assignments."""
    mfu: Number = key(above=0, at_most=1)
    """The model FLOPs utilisation assumed for the predicted step time (measured: docs/gpu.md)."""


@dataclass
class Wandb:
    """``logger.wandb``: the Weights & Biases run of a job."""

    mode: Optional[str] = key(choices=WANDB_MODES)
    """null (WANDB_MODE from the environment, else offline) | online | offline (writes to <run_dir>/wandb) | disabled."""
    project: str = key()
    """W&B project."""
    entity: Optional[str] = key()
    """W&B entity (null: your default)."""
    group: Optional[str] = key()
    """W&B group (null: the sweep or run directory name)."""
    tags: List[str] = key()
    """Extra W&B tags."""
    init_timeout_s: Number = key(above=0)
    """Give up starting W&B after this many seconds."""


@dataclass
class Logger:
    """``logger``: metrics sinks beside metrics.jsonl."""

    wandb: Wandb = field(default_factory=Wandb)
    """Weights & Biases."""
    progress: bool = flag()
    """Progress bar on rank 0."""


@dataclass
class LocalCluster:
    """``cluster=local``: ranks as local processes under torch elastic."""

    name: str = key()
    """The cluster preset's name."""
    world_size: int = key(at_least=1)
    """Number of ranks."""
    nodes: Optional[int] = key(at_least=1)
    """null (not checked) or the number of nodes the ranks must span."""
    device: str = key(choices=DEVICES)
    """cpu | cuda (one GPU per rank)."""
    backend: str = key(choices=BACKENDS)
    """auto (nccl on cuda, gloo on cpu) | gloo | nccl."""
    timeout_s: Number = key(above=0)
    """Process-group timeout in seconds."""
    comm_bytes_per_group: int = key(at_least=0)
    """sdp-plan only: device memory assumed per process group (bytes)."""
    gpu: Optional[str] = key(choices=tuple(gpus()))
    """sdp-plan only: the device planned for (conf/hardware.yaml; null: no step time)."""
    link: Optional[str] = key(choices=tuple(links()))
    """sdp-plan only: the link the collectives cross (conf/hardware.yaml; null: no comm time)."""
    threads_per_rank: Optional[int] = key(at_least=1)
    """Torch intra-op threads per rank (null: CPU cores / ranks on the node)."""


@dataclass
class SlurmCluster:
    """``cluster=slurm`` (and slurm_gpu): ranks as Slurm tasks (keys as in :class:`LocalCluster`, plus the task layout)."""

    name: str = key()
    """The cluster preset's name."""
    nodes: Optional[int] = key(at_least=1)
    """Slurm nodes per job."""
    tasks_per_node: int = key(at_least=1)
    """Ranks (Slurm tasks) per node."""
    cpus_per_task: int = key(at_least=1)
    """CPU cores per rank."""
    world_size: int = key(at_least=1)
    """Number of ranks (nodes x tasks_per_node)."""
    device: str = key(choices=DEVICES)
    """cpu | cuda (one GPU per task)."""
    backend: str = key(choices=BACKENDS)
    """auto (nccl on cuda, gloo on cpu) | gloo | nccl."""
    timeout_s: Number = key(above=0)
    """Process-group timeout in seconds."""
    comm_bytes_per_group: int = key(at_least=0)
    """sdp-plan only: device memory assumed per process group (bytes)."""
    gpu: Optional[str] = key(choices=tuple(gpus()))
    """sdp-plan only: the device planned for (conf/hardware.yaml; null: no step time)."""
    link: Optional[str] = key(choices=tuple(links()))
    """sdp-plan only: the link the collectives cross (conf/hardware.yaml; null: no comm time)."""
    threads_per_rank: Optional[int] = key(at_least=1)
    """Torch intra-op threads per rank."""


@dataclass
class Optim:
    """``optim``: the optimizer (a partial ``_target_``, its own keyword arguments) and the LR schedule."""

    name: str = key()
    """The optimizer preset's name."""
    optimizer: Dict[str, Any] = key()
    """Called as optimizer(params) by the strategy: _target_, _partial_: true, and its arguments (lr, ...)."""
    schedule: str = key(choices=SCHEDULES)
    """constant | cosine | linear decay after warm-up."""
    warmup_steps: int = key(at_least=0)
    """Linear LR warm-up steps."""
    min_lr_ratio: Number = key(at_least=0, at_most=1)
    """Final LR as a fraction of the peak."""


@dataclass
class RootConfig:
    """The root: the keys ``conf/config.yaml`` sets itself. Stored as an open node holding these typed
    nodes (:func:`sdp.driver.typed.open_node`), so the groups it composes (model, dataset, parallelism,
    cluster, optim, ...) and an experiment's own keys may join it."""

    seed: int = key(at_least=0)
    """Model init, data order, per-rank RNG streams."""
    plugins: List[str] = key()
    """Python modules imported before validation (a strategy, model or dataset outside sdp/)."""
    train: Train = field(default_factory=Train)
    """Steps, batches, evaluation points, budget, checkpoints, reliability."""
    eval: Eval = field(default_factory=Eval)
    """The evaluation protocol."""
    memory: Memory = field(default_factory=Memory)
    """Per-rank memory measurement."""
    plan: Plan = field(default_factory=Plan)
    """sdp-plan's options."""
    logger: Logger = field(default_factory=Logger)
    """W&B and the progress bar."""


CLUSTERS = {"local": LocalCluster, "slurm": SlurmCluster}  # cluster.name -> schema (a recorded config's node)
