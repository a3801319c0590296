"""The rank environment: which launcher started this process and as what, and the world's layout.

Used by every rank (:mod:`sdp.rank.worker`) and by the driver above it (:mod:`sdp.driver.launch`,
:mod:`sdp.driver.config`, :mod:`sdp.driver.slurm`); in a module of its own so that the launcher and the worker do
not import each other.
"""

from __future__ import annotations

import os
import socket
from typing import Any


def external_launcher() -> bool:
    """True when RANK and WORLD_SIZE are already set (torchrun, Slurm + submitit)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


# Variables that say which launcher started a rank and as what (recorded per rank in summary.json).
LAUNCHER_ENV = (
    "SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_STEP_ID", "SLURM_PROCID",
    "SLURM_LOCALID", "SLURM_NODEID", "SLURM_RESTART_COUNT", "SUBMITIT_EXECUTOR", "TORCHELASTIC_RUN_ID",
    "GROUP_RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
)


# What decides the shape of the world under an external launcher (named when the world is not the one configured).
WORLD_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "MASTER_ADDR",
             "MASTER_PORT", "SLURM_NNODES", "SLURM_NTASKS", "SLURM_NODEID", "SLURM_PROCID")


# What tells one attempt of a job from another in the same run directory (requeue, elastic restart, another srun step).
ATTEMPT_ENV = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
               "MASTER_PORT")


def attempt_id() -> str:
    """This attempt of the job, the same in each of its processes (the failure records' and the resume verdict's name)."""
    return "-".join(os.environ.get(k, "") for k in ATTEMPT_ENV)


def seen_env() -> str:
    """``RANK=0 WORLD_SIZE=2 ...``: the world variables of this process that are set."""
    return " ".join(f"{k}={os.environ[k]}" for k in WORLD_ENV if k in os.environ) or "none of " + ", ".join(WORLD_ENV)


def node_index() -> int:
    """This process's node: torchrun's GROUP_RANK (its --node-rank under the static rendezvous), Slurm's
    SLURM_NODEID, else 0 (the local launcher runs every rank on one node)."""
    for key in ("GROUP_RANK", "SLURM_NODEID"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def world_layout(*, rank: int, local_rank: int, device: Any, world_size: int, nodes: int | None) -> list[dict[str, Any]]:
    """Every rank's (node, host, local rank, rank, device), gathered; collective. Raises on every rank,
    naming what each rank saw, when the world is not the configured one: ranks that are not 0..W-1, a
    node whose local ranks are not 0..n-1, or another number of nodes than ``cluster.nodes`` (where set)."""
    import torch.distributed as dist

    me = {"node": node_index(), "host": socket.gethostname(), "local_rank": local_rank, "rank": rank,
          "device": str(device), "env": seen_env()}
    layout: list[Any] = [None] * world_size
    dist.all_gather_object(layout, me)
    by_node: dict[int, list[dict[str, Any]]] = {}
    for r in layout:
        by_node.setdefault(r["node"], []).append(r)
    problems = []
    if sorted(r["rank"] for r in layout) != list(range(world_size)):
        problems.append(f"ranks {sorted(r['rank'] for r in layout)} are not 0..{world_size - 1}")
    for node, members in by_node.items():
        if sorted(m["local_rank"] for m in members) != list(range(len(members))):
            problems.append(f"node {node} has local ranks {sorted(m['local_rank'] for m in members)}")
    if nodes is not None and len(by_node) != int(nodes):
        problems.append(f"{len(by_node)} node(s) {sorted(by_node)} where cluster.nodes={nodes}")
    if problems:
        seen = "; ".join(f"rank {r['rank']}: {r['env']}" for r in layout)
        raise RuntimeError(f"the world is not the configured one ({', '.join(problems)}); variables seen: {seen}")
    return [{k: v for k, v in r.items() if k != "env"} for r in layout]


def format_layout(layout: list[dict[str, Any]]) -> str:
    """The world layout printed at start: one line per rank."""
    nodes = sorted({r["node"] for r in layout})
    lines = [f"world: {len(layout)} ranks on {len(nodes)} node(s)"]
    lines += [f"  node {r['node']} host {r['host']} local_rank {r['local_rank']} rank {r['rank']} device {r['device']}"
              for r in sorted(layout, key=lambda r: r["rank"])]
    return "\n".join(lines)


def nodes_of(layout: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """summary.json's ``nodes``: per node its host(s), ranks and devices."""
    out = []
    for node in sorted({r["node"] for r in layout}):
        members = sorted((r for r in layout if r["node"] == node), key=lambda r: r["rank"])
        out.append({"node": node, "hosts": sorted({m["host"] for m in members}), "ranks": [m["rank"] for m in members],
                    "devices": [m["device"] for m in members]})
    return out


def set_backends(*, device: Any, deterministic: bool, tf32: bool) -> dict[str, Any]:
    """This rank's numerics switches, set before its first kernel; returns what was set (``summary.json``'s
    ``backends``).

    ``train.deterministic`` (:func:`sdp.rank.rng.set_deterministic`) on any device. On CUDA only, the speed
    defaults a GPU user expects: ``train.tf32`` for fp32 matmuls (cuBLAS) and convolutions (cuDNN), and
    cuDNN autotuning (``cudnn.benchmark``) unless the run is deterministic (autotuning picks kernels by
    timing, which can differ from run to run). On CPU nothing else is touched and the flags are recorded
    as None: TF32 and cuDNN do not exist there. The legacy ``allow_tf32`` flags are the ones set and read:
    PyTorch refuses to read a TF32 flag that was set through both its legacy and its newer API."""
    import torch

    from sdp.rank import rng

    rng.set_deterministic(enabled=deterministic, device=device)
    record: dict[str, Any] = {"device_type": device.type, "deterministic": deterministic, "tf32_matmul": None,
                              "tf32_cudnn": None, "cudnn_benchmark": None, "cudnn_deterministic": None}
    if device.type != "cuda":
        return record
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = not deterministic
    record.update(tf32_matmul=bool(torch.backends.cuda.matmul.allow_tf32), tf32_cudnn=bool(torch.backends.cudnn.allow_tf32),
                  cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
                  cudnn_deterministic=bool(torch.backends.cudnn.deterministic))
    return record


def launcher_identity() -> dict[str, Any]:
    """This process as its launcher sees it: host, pid and the launcher's variables that are set."""
    env = {k: os.environ[k] for k in LAUNCHER_ENV if k in os.environ}
    return {"hostname": socket.gethostname(), "pid": os.getpid(), "env": env}
