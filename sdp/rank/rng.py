"""Random state: per-rank seeding, deterministic mode, and RNG states as checkpointable tensors.

Why RNG states as tensors and plain types: checkpoints are loaded with ``torch.load(weights_only=True)``
(no arbitrary pickle), which accepts tensors, numbers, strings and containers only. Python's
``random`` state is a tuple of 625 ints and numpy's holds an ``ndarray``; both are stored as int64
tensors plus plain ints here, so a resumed rank continues every stream exactly where it stopped.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch

CUBLAS_WORKSPACE = ":4096:8"  # what cuBLAS needs for deterministic GEMMs (PyTorch's reproducibility notes)


def seed_rank_streams(seed: int) -> None:
    """Seed torch (CPU and every CUDA device), ``random`` and numpy with this rank's stream seed."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def set_deterministic(*, enabled: bool, device: torch.device) -> None:
    """``train.deterministic``: PyTorch's deterministic algorithms (an error, not silence, where an op
    has none); on CUDA also the cuBLAS workspace setting and no cuDNN autotuning. Call before the first
    CUDA kernel, since cuBLAS reads its workspace variable when its handle is created."""
    if not enabled:
        return
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True)


def capture(*, device: torch.device) -> dict[str, Any]:
    """Every RNG stream of this rank as tensors and plain types (``weights_only``-loadable).

    On CUDA, the generator of ``device`` (the rank's own) only: saving every visible device's tied a
    resume to the same number of visible GPUs, while each rank draws from its own device alone."""
    version, mt, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "torch_cpu": torch.get_rng_state(),
        "python": {"version": int(version), "mt": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "name": str(np_name),
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
    }
    if device.type == "cuda":
        state["torch_cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore(state: dict[str, Any], *, device: torch.device) -> None:
    """Inverse of :func:`capture`, onto this rank's ``device``. A checkpoint written before one device's
    state was saved holds a list of every visible device's: the entry of ``device``'s index is restored."""
    torch.set_rng_state(state["torch_cpu"])
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["mt"].tolist()), py["gauss"]))
    npy = state["numpy"]
    keys = npy["keys"].numpy().astype(np.uint32)
    np.random.set_state((npy["name"], keys, npy["pos"], npy["has_gauss"], npy["gauss"]))
    cuda = state.get("torch_cuda")
    legacy = isinstance(cuda, (list, tuple))  # saved whenever CUDA was initialised, a CPU rank's too
    if cuda is None or (legacy and device.type != "cuda"):
        return
    assert device.type == "cuda", f"the checkpoint holds a CUDA RNG state, but this rank runs on {device}"
    if legacy:  # every visible device's, by index
        index = torch.cuda.current_device() if device.index is None else device.index
        assert index < len(cuda), (f"the checkpoint holds the CUDA RNG states of {len(cuda)} devices, "
                                   f"none for this rank's {device} (index {index})")
        cuda = cuda[index]
    torch.cuda.set_rng_state(cuda, device)
