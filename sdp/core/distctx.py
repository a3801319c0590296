"""What a rank knows about the job (:class:`DistContext`), the averages every strategy and the
evaluation share, the options every process group is made with (:func:`subgroup_kwargs`: the job's
timeout, NCCL's shared resources) and where the rank is (:data:`WHERE`, for failure reports). It imports
nothing of ``sdp`` but the comm counter (:mod:`sdp.metrics.comm`), so it sits in :mod:`sdp.core`, below the
subnetwork code, the strategies and the rank's evaluation, which all use it."""

from __future__ import annotations

import faulthandler
import json
import os
import time
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sdp.metrics.comm import CommCounter


@dataclass
class DistContext:
    """What a rank knows about the job: its place, its device and the shared comm counter."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    comm: CommCounter = field(default_factory=CommCounter)


def staged_through_host(*, backend: str, device: torch.device) -> bool:
    """Whether a point-to-point send or receive of a tensor on ``device`` must go through a host copy: gloo
    runs its collectives (all-reduce, broadcast, all-gather) on CUDA tensors, but its send and receive hand
    the tensor's pointer to the socket as host memory (an I/O error, "Bad address", or a crash). That is the
    case of several ranks sharing one GPU (``cluster.device=cuda cluster.backend=gloo``)."""
    return backend == "gloo" and device.type != "cpu"


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` as one new 1-D tensor: one collective (or one summation) for all of them."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflatten(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy ``flat`` (:func:`flatten`'s layout) back into ``tensors``, in place."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()


def comm_options(*, backend: str, timeout: timedelta) -> Any:
    """The backend options of every process group of the job: on NCCL, ``config.split_share = 1``;
    None for every other backend (gloo takes none). ``timeout`` goes into the options too, where torch
    would otherwise warn that the ``timeout`` argument overrides the options' default.

    Why on every group, the default one first: a group made by ``ncclCommSplit`` shares its parent's
    buffers, channels and proxy only if the *parent* communicator was created with ``splitShare`` set
    (NCCL ``src/init.cc``: ``if (comm->config.splitShare)``, ``comm`` being the parent), and torch leaves
    it unset (NCCL's default 0 unless ``NCCL_COMM_SPLIT_SHARE_RESOURCES`` is set), so each holder-set group
    got buffers of its own. The worker passes these options to ``init_process_group``; sub-groups get them
    too (:func:`subgroup_kwargs`), which matters only for a group split again. The price: collectives on
    communicators that share resources may not overlap one another (why pytorch#130857 made sharing
    optional); SDP issues its collectives in one global order anyway (sdp/subnet/sync.py). A new
    object per group: torch writes the group's name, ranks and split source into the options it gets."""
    if backend != "nccl":
        return None
    from torch.distributed import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options.config.split_share = 1
    options._timeout = timeout
    return options


_JOB_TIMEOUT: list[timedelta] = []  # set once by init_world: the value given to init_process_group


def init_world(*, backend: str, timeout: timedelta, device_id: torch.device | None) -> None:
    """``init_process_group`` with the job's options, remembering ``timeout`` so that every later group
    takes the same one from here (:func:`world_timeout`) instead of reading it back out of torch."""
    _JOB_TIMEOUT[:] = [timeout]
    dist.init_process_group(backend, timeout=timeout, pg_options=comm_options(backend=backend, timeout=timeout),
                            device_id=device_id)


def world_timeout() -> timedelta:
    """The job's timeout: ``cluster.timeout_s`` as :func:`init_world` gave it to ``init_process_group``.
    A process group started elsewhere (tests that call ``init_process_group`` themselves) has its
    timeout read back from the default group's backend options."""
    if _JOB_TIMEOUT:
        return _JOB_TIMEOUT[0]
    from torch.distributed.distributed_c10d import _get_default_group

    backend = _get_default_group()._get_backend(torch.device("cuda" if dist.get_backend() == "nccl" else "cpu"))
    timeout = getattr(getattr(backend, "options", None), "_timeout", None)
    assert isinstance(timeout, timedelta), f"cannot read the default group's timeout from {type(backend).__name__}"
    return timeout


def subgroup_kwargs() -> dict[str, Any]:
    """Keyword arguments for every ``dist.new_group`` of the job (holder sets, mesh dimensions).

    Why: ``new_group`` without ``timeout=`` does not inherit the default group's; it falls back to torch's
    per-backend default (10 minutes on NCCL, 30 on gloo: ``_get_default_timeout``), so a rank stalled in a
    sub-group collective held the job that long whatever ``cluster.timeout_s`` said. Every group gets the
    default group's timeout and the job's backend options (:func:`comm_options`)."""
    timeout = world_timeout()
    return {"timeout": timeout, "pg_options": comm_options(backend=dist.get_backend(), timeout=timeout)}


def mesh_overrides(shape: tuple[int, ...]) -> dict[int, Any]:
    """``init_device_mesh(backend_override=...)`` for a mesh of ``shape``: the options of
    :func:`subgroup_kwargs` for every dimension that makes groups of its own (size < world size),
    because a DeviceMesh takes a dimension's timeout only from its options (``_init_one_process_group``:
    ``pg_options._timeout``, else torch's default). A dimension spanning the world uses the default
    group itself, which has the job's timeout (no override: ``init_device_mesh`` reuses it only then),
    except for gloo on a machine with CUDA, where the mesh makes a world group of its own anyway."""
    from torch._C._distributed_c10d import Backend

    world = dist.get_world_size()
    own_world_group = torch.cuda.is_available() and dist.get_backend() == "gloo"
    out: dict[int, Any] = {}
    for dim, size in enumerate(shape):
        if size < world or own_world_group:
            kw = subgroup_kwargs()
            out[dim] = kw["pg_options"] or Backend.Options(dist.get_backend(), kw["timeout"])
    return out


class Whereabouts:
    """Where this rank is: the step it runs and the groups its collectives went to since that step began
    (in first-use order), for :func:`sdp.rank.guards.naming_step`'s message and, once :meth:`keep_at` names
    a file, also in that file, rewritten in place whenever they change (a step begins, a group is used
    for the first time in the step: one ``pwrite`` of a small JSON, no fsync).

    Why a file written *before* anything fails: under NCCL's default error handling
    (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``, SkipCleanUp in torch 2.14) a collective that times out makes
    the watchdog thread abort the process (SIGABRT): no Python ``except`` runs, so neither naming_step's
    message nor the worker's failure file would exist. The choice over ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``
    (abort the communicator, keep the process, raise at the next use): that one leaves the main thread
    to find out at its next collective, on a communicator that may not be the aborted one, i.e. after
    another timeout; the watchdog's abort ends the rank within ``cluster.timeout_s``, and the file says
    where it was. :meth:`keep_at` also turns on :mod:`faulthandler`, so the abort prints every thread's
    Python stack to the rank's stderr (rank log, Slurm output)."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.groups: list[tuple[int, ...]] = []
        self.world = 0
        self.rank: int | None = None
        self._fd: int | None = None
        self._path: str | None = None

    def keep_at(self, path: str, *, rank: int, world: int) -> None:
        """Write the position to ``path`` from now on (the rank's failure file: see the class docstring)."""
        self.rank, self.world = rank, world
        faulthandler.enable(all_threads=True)
        try:
            os.makedirs(os.path.dirname(str(path)) or ".", exist_ok=True)
            self._fd, self._path = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), str(path)
        except OSError as exc:  # a breadcrumb must never cost the run: keep the position in memory only
            print(f"rank {rank}: cannot keep its position in {path} ({exc}); continuing without it", flush=True)
            return
        self._write()

    def release(self) -> None:
        """The rank finished cleanly: close and remove the file (nothing failed)."""
        if self._fd is not None:
            os.close(self._fd)
            with suppress(FileNotFoundError):
                os.unlink(self._path)  # type: ignore[arg-type]
            self._fd = self._path = None

    def begin_step(self, step: int) -> None:
        self.step, self.groups = step, []
        self._write()

    def used(self, ranks: tuple[int, ...], *, world: int) -> None:
        """A collective of this rank goes to the group of ``ranks`` (cheap when the group was used already)."""
        if ranks not in self.groups:
            self.world = world
            self.groups.append(ranks)
            self._write()

    def describe(self) -> str:
        """E.g. ``collectives of step 3 went to ranks (0, 1) then world`` (latest last)."""
        when = "set-up (before step 1)" if self.step is None else f"step {self.step}"
        if not self.groups:  # no collective through sdp.subnet.holder_groups.GroupSet (yet, or at all: DDP, FSDP)
            return when
        names = ["world" if len(g) == self.world else str(g) for g in self.groups]
        return f"collectives of {when} went to ranks {' then '.join(names)} (latest last)"

    def _write(self) -> None:
        if self._fd is None:
            return
        text = json.dumps({"rank": self.rank, "state": "running: no Python error was raised (killed or aborted, "
                           "e.g. by NCCL's watchdog after cluster.timeout_s)", "step": self.step,
                           "groups": [list(g) for g in self.groups], "where": self.describe(), "time": time.time()})
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, text.encode(), 0)


WHERE = Whereabouts()  # this process's position (one rank per process)


def last_position(path: str) -> str:
    """What a rank that died without a Python error left in its failure file (:class:`Whereabouts`), as
    one line for the launcher's report; "" when the file is absent or holds an error the rank raised."""
    try:
        saved = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return ""
    if not str(saved.get("state", "")).startswith("running"):
        return ""
    return f"\nrank {saved.get('rank')} was at: {saved.get('where')} ({path}; {saved['state']})"


def average_buffers(model: nn.Module, *, ctx: DistContext, group: Any = None) -> None:
    """Average floating-point buffers (BatchNorm running stats) over ``group`` (world default);
    integer buffers (num_batches_tracked) are left as they are (equal on every rank that ran the layer)."""
    average_tensors([b for b in model.buffers() if b.is_floating_point()], ctx=ctx, group=group)


def average_tensors(tensors: list[torch.Tensor], *, ctx: DistContext, group: Any = None) -> None:
    """Replace each tensor by its mean over ``group`` (world default), in place: one flat all-reduce."""
    if ctx.world_size == 1 or not tensors:
        return
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    size = dist.get_world_size(group)
    ctx.comm.record(kind="all_reduce", payload=flat.numel() * flat.element_size(), group_size=size)
    dist.all_reduce(flat, group=group)
    flat /= size
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
