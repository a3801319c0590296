"""Datasets as bundles, and step-indexed global batches split over data-parallel replicas.

Why step-indexed: every strategy must consume the same global batch per step (``train.batch_size``
x world size samples, the same samples for the same seed however they are split into ranks, stages
or microbatches), and a resumed run must continue with exactly the batches it would have seen. A
global batch is therefore a pure function of (seed, step): epoch ``e`` is a seeded permutation, step
``s`` takes the next ``global_batch`` indices of it, and replica ``r`` of ``R`` takes slice ``r``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset


IGNORE_INDEX = -100
"""A target that is not scored (F.cross_entropy's default ``ignore_index``): a task's unscored positions
(:mod:`sdp.data.pointer`); the losses (:mod:`sdp.core.loss`) neither add nor count it."""


class BatchAugment(Protocol):
    """Random augmentation applied to in-memory batches; parameters drawn for the whole global batch.

    ``draw(n, generator)`` returns one row of random parameters per sample, ``apply(x, params)``
    transforms a batch with its rows. Drawing for the global batch from a (seed, step) generator and
    slicing per replica keeps every sample's augmentation independent of how the batch is split.
    """

    def draw(self, n: int, generator: torch.Generator) -> torch.Tensor: ...

    def apply(self, x: torch.Tensor, params: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class EvalGroups:
    """A task's difficulty groups of its validation targets, which the evaluation reports the loss of one by one.

    Why: a mean loss does not say where a model fails; on a task whose items need 1, 2, .. sequential steps
    (:mod:`sdp.data.automaton`'s k, :mod:`sdp.data.pointer`'s lookups) the loss per group says at which
    difficulty a deeper model gains (the LM study's depth gate, :mod:`sdp.bench.gate`). ``ids`` are indexed by
    validation sample like the validation tensors (:func:`val_group_ids` slices them as :func:`val_batches`
    slices the samples): shape ``(n,)`` puts every scored target of a sample in its sample's group, shape
    ``(n, T)`` (the targets' shape) one group per target; a scored target's id indexes ``labels``, an unscored
    target's (:data:`IGNORE_INDEX`) id is never read."""

    name: str
    """What the groups are, e.g. ``"k"`` (the report's and summary.json's name)."""
    labels: tuple[str, ...]
    """Group ``i``'s label, e.g. ``("1", "2", "3")``: the keys of ``eval_loss_by_group``."""
    ids: torch.Tensor


@dataclass
class DataBundle:
    """Train and validation sets plus what models and the trainer need to know about them.

    ``task`` is ``"classification"`` (targets are class ids, accuracy is reported) or ``"lm"``
    (targets are next tokens, accuracy is null). When both sets are :class:`TensorDataset`\\ s the
    trainer indexes the tensors directly (the airbench fast path: no DataLoader, no workers), and
    ``augment`` (if any) transforms each training batch. ``notes`` are facts the run must report
    (e.g. files loaded without their checksum check); they land in summary.json.
    """

    train: Dataset
    val: Dataset
    task: str
    num_classes: int
    input_shape: tuple[int, ...]
    notes: tuple[str, ...] = ()
    augment: BatchAugment | None = None
    eval_groups: EvalGroups | None = None
    """The validation targets' groups (``eval_loss_by_group`` in summary.json), or None: the mean loss only."""

    def __post_init__(self) -> None:
        g = self.eval_groups
        if g is None or not isinstance(self.val, TensorDataset):
            return
        y = self.val.tensors[1]
        assert tuple(g.ids.shape) == tuple(y.shape[: g.ids.dim()]), \
            f"eval_groups {g.name!r}: ids of shape {tuple(g.ids.shape)} do not index the validation targets {tuple(y.shape)}"
        ids = per_target(g.ids, y)[y != IGNORE_INDEX]
        assert ids.numel() == 0 or (0 <= int(ids.min()) and int(ids.max()) < len(g.labels)), \
            f"eval_groups {g.name!r}: scored ids span {int(ids.min())}..{int(ids.max())}, labels {g.labels}"

    @property
    def in_memory(self) -> bool:
        return isinstance(self.train, TensorDataset) and isinstance(self.val, TensorDataset)


class GlobalBatchSampler:
    """Indices of the global batch of every step; identical on every rank for a given seed."""

    def __init__(self, *, num_samples: int, global_batch: int, seed: int) -> None:
        if global_batch > num_samples:
            raise ValueError(
                f"global batch {global_batch} (train.batch_size x data-parallel replicas) exceeds the "
                f"{num_samples} training samples; lower train.batch_size or use a larger dataset"
            )
        self.num_samples, self.global_batch, self.seed = num_samples, global_batch, seed
        self.steps_per_epoch = num_samples // global_batch
        self._epoch = -1
        self._perm: torch.Tensor | None = None

    def indices(self, step: int) -> torch.Tensor:
        epoch, pos = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.num_samples, generator=g)
            self._epoch = epoch
        assert self._perm is not None
        return self._perm[pos * self.global_batch : (pos + 1) * self.global_batch]

    def shard(self, step: int, *, replica: int, replicas: int) -> torch.Tensor:
        assert self.global_batch % replicas == 0, (
            f"global batch {self.global_batch} not divisible by {replicas} data-parallel replicas"
        )
        local = self.global_batch // replicas
        return self.indices(step)[replica * local : (replica + 1) * local]


class _StepBatches(torch.utils.data.Sampler):
    """Batch sampler yielding this replica's index list for steps start, start+1, ..."""

    def __init__(self, sampler: GlobalBatchSampler, *, start: int, stop: int, replica: int, replicas: int) -> None:
        self.sampler, self.start, self.stop = sampler, start, stop
        self.replica, self.replicas = replica, replicas

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start, self.stop):
            yield self.sampler.shard(step, replica=self.replica, replicas=self.replicas).tolist()

    def __len__(self) -> int:
        return self.stop - self.start


def train_batches(
    bundle: DataBundle,
    *,
    sampler: GlobalBatchSampler,
    start: int,
    stop: int,
    replica: int,
    replicas: int,
    num_workers: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This replica's (inputs, targets) for steps ``start`` .. ``stop - 1``."""
    if bundle.in_memory:
        x_all, y_all = bundle.train.tensors  # type: ignore[attr-defined]
        for step in range(start, stop):
            idx = sampler.shard(step, replica=replica, replicas=replicas)
            x = x_all[idx]
            if bundle.augment is not None:
                g = torch.Generator().manual_seed((sampler.seed + 1) * 2_147_483_629 + step)  # not the permutation stream
                local = len(idx)
                x = bundle.augment.apply(x, bundle.augment.draw(sampler.global_batch, g)[replica * local : (replica + 1) * local])
            yield x, y_all[idx]
        return
    batches = _StepBatches(sampler, start=start, stop=stop, replica=replica, replicas=replicas)
    loader = DataLoader(bundle.train, batch_sampler=batches, num_workers=num_workers, persistent_workers=False)
    yield from loader


def val_batches(
    bundle: DataBundle, *, rank: int, world_size: int, batch_size: int, num_workers: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The validation set sharded over ranks (``rank::world_size``), every sample exactly once."""
    chunks = _val_chunks(bundle, rank=rank, world_size=world_size, batch_size=batch_size)
    if bundle.in_memory:
        x_all, y_all = bundle.val.tensors  # type: ignore[attr-defined]
        for chunk in chunks:
            idx = torch.tensor(chunk, dtype=torch.long)
            yield x_all[idx], y_all[idx]
        return
    yield from DataLoader(bundle.val, batch_sampler=chunks, num_workers=num_workers)


def per_target(ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``ids`` (:class:`EvalGroups`: the targets' shape, or a prefix of it, one group per sample) as one id per
    target: a view broadcast to ``target``'s shape."""
    return ids.reshape(ids.shape + (1,) * (target.dim() - ids.dim())).expand_as(target)


def val_group_ids(bundle: DataBundle, *, rank: int, world_size: int, batch_size: int) -> Iterator[torch.Tensor]:
    """The group ids (:class:`EvalGroups`) of each batch :func:`val_batches` yields with the same arguments, in
    its order: the same index chunks, so an id follows its sample through the sharding. Nothing without groups."""
    if bundle.eval_groups is None:
        return
    for chunk in _val_chunks(bundle, rank=rank, world_size=world_size, batch_size=batch_size):
        yield bundle.eval_groups.ids[torch.tensor(chunk, dtype=torch.long)]


def _val_chunks(bundle: DataBundle, *, rank: int, world_size: int, batch_size: int) -> list[list[int]]:
    """The validation indices of shard ``rank`` (``rank::world_size``) in batches of ``batch_size``."""
    indices = list(range(rank, len(bundle.val), world_size))  # type: ignore[arg-type]
    return [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]
