"""The device and link table (``conf/hardware.yaml``): what ``cluster.gpu`` and ``cluster.link`` name.

Why one YAML file read here rather than a Python dict beside each reader: the MFU a GPU run reports
(:func:`sdp.metrics.flops.peak_flops`, by the device name CUDA gives) and the step time ``sdp-plan`` predicts
(:mod:`sdp.planning.throughput`, by the name the config gives) must divide by the same peak, and the bus
bandwidths need their citations next to them, where a user adding a cluster's own measured link reads them.
Imports nothing from ``sdp`` (the schema reads the names for its choices) and only PyYAML, which the GPU
check's bare image has.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

TABLE = Path(__file__).resolve().parent.parent.parent / "conf" / "hardware.yaml"
DTYPES = ("bf16", "tf32", "fp32")


@dataclass(frozen=True)
class Gpu:
    """One device: its dense peak FLOP/s per matmul dtype and its memory."""

    name: str  # the table's key, what ``cluster.gpu`` names
    match: tuple[str, ...]  # parts of ``torch.cuda.get_device_name`` that identify it
    memory_gb: float
    peak_flops: dict[str, float]  # dtype (:data:`DTYPES`) -> dense peak FLOP/s


@dataclass(frozen=True)
class Link:
    """One interconnect: the bus bandwidth (nccl-tests' busbw) a collective crossing it runs at."""

    name: str  # the table's key, what ``cluster.link`` names
    bus_bytes_per_s: float


@lru_cache(maxsize=1)
def _table() -> dict[str, Any]:
    data = yaml.safe_load(TABLE.read_text())
    assert isinstance(data, dict) and set(data) == {"gpus", "links"}, f"{TABLE}: top-level keys must be gpus and links, got {data!r}"
    return data


def gpus() -> dict[str, Gpu]:
    """Every device of the table, in its order (the order :func:`gpu_of_device` matches in)."""
    out = {}
    for name, e in _table()["gpus"].items():
        peaks = {k: float(v) for k, v in e["peak_flops"].items()}
        assert set(peaks) == set(DTYPES) and all(v > 0 for v in peaks.values()), f"{TABLE}: gpus.{name}.peak_flops={peaks}"
        out[name] = Gpu(name=name, match=tuple(str(m) for m in e["match"]), memory_gb=float(e["memory_gb"]), peak_flops=peaks)
    return out


def links() -> dict[str, Link]:
    """Every link of the table."""
    out = {}
    for name, e in _table()["links"].items():
        bw = float(e["bus_bytes_per_s"])
        assert bw > 0, f"{TABLE}: links.{name}.bus_bytes_per_s={bw}"
        out[name] = Link(name=name, bus_bytes_per_s=bw)
    return out


def gpu_of_device(device_name: str) -> Gpu | None:
    """The first entry all of whose ``match`` parts occur in ``device_name`` (as ``torch.cuda.get_device_name``
    spells it, case-insensitive); None for a device the table does not know (a CPU, an unlisted GPU)."""
    name = device_name.upper()
    return next((g for g in gpus().values() if all(part.upper() in name for part in g.match)), None)
