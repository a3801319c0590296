"""FLOPs per step and model FLOPs utilisation (MFU) against a per-device peak table.

Why FLOPs from the model's count rather than a profiler: ``flops_per_sample`` (forward + backward,
``torch.utils.flop_counter`` on the meta device) times the global batch times the fraction of the
model the workers compute (:meth:`sdp.parallel.spec.StrategySpec.flops_fraction`: 1 for a strategy that
runs the whole model) is the useful work of a step, the same for every strategy; activation
recomputation is overhead, not useful work, as in the usual MFU definition. The budget module
already counts it once per run in the driver (``summary.json["budget"]["flops_per_step"]``);
:func:`masked_fraction` is the model's share that a strategy with a coverage scales (per level: at
neuron level only the declared split sub-branches).

MFU = useful FLOPs per second / (dense peak of one device x distinct devices). Several gloo ranks
sharing one GPU count that GPU once. Peaks are the vendors' dense (no sparsity) figures of the device
table ``conf/hardware.yaml`` (the one ``sdp-plan``'s step time divides by); on CPU (no reliable peak) MFU is null.
"""

from __future__ import annotations

from typing import Any

from sdp.metrics.hardware import gpu_of_device
from sdp.subnet.units import LEVELS


def masked_fraction(*, counts: dict[str, int], model: Any, level: str) -> float:
    """Share of the forward FLOPs that a worker holding a fraction of every unit computes only that
    fraction of (``counts``: per-module FLOPs, :func:`sdp.models.base.forward_flop_counts`).

    ``level="block"``: the units' residual branches (a dropped block runs none of its branch; shared
    sub-modules such as a projection shortcut run anyway). ``level="neuron"``: only the sub-branches the
    blocks' hidden dims run (``HiddenDim.branch``, ``""`` = the whole residual branch), the same
    declaration that says what is rescaled; what no hidden dim splits (attention under grouped-query
    attention, Swin's attention) runs in full on every holder. A block without hidden dims is one whole
    unit at neuron level too (:func:`sdp.subnet.plan.declare_units`)."""
    if level not in LEVELS:
        raise ValueError(f"level={level!r} not in {LEVELS}")
    prefix = type(model).__name__
    total = counts["Global"]
    if total <= 0:
        return 0.0
    masked = 0
    for i, block in model.sdp_units():
        name = f"{prefix}.blocks.{i}"
        whole = counts.get(name, 0) - sum(counts.get(f"{name}.{s}", 0) for s in block.shared_submodules())
        branches = {d.branch for d in block.hidden_dims()} if level == "neuron" else set()
        if not branches or "" in branches:
            masked += whole
            continue
        for b in sorted(branches):
            key = f"{name}.{b}"
            if key not in counts and whole > 0:
                block.get_submodule(b)  # raises when the declared branch names no sub-module
                raise AssertionError(f"{key}: the declared HiddenDim.branch is never called as a module, so its "
                                     f"work is not counted under its name ({type(block).__name__}.forward_full)")
            masked += counts.get(key, 0)
    assert 0 <= masked <= total, f"masked FLOPs {masked} outside [0, total {total}] at level={level}"
    return masked / total


def masked_fractions(*, counts: dict[str, int], model: Any) -> dict[str, float]:
    """:func:`masked_fraction` at every level (``{"block": .., "neuron": ..}``): the model's facts, counted
    once; a strategy picks its own level (:meth:`sdp.parallel.spec.StrategySpec.flops_fraction`)."""
    return {level: masked_fraction(counts=counts, model=model, level=level) for level in LEVELS}


def peak_flops(*, device_name: str, dtype: str) -> float | None:
    """Dense peak of ``device_name`` (as ``torch.cuda.get_device_name`` spells it) for ``dtype``, from the one
    device table (``conf/hardware.yaml``, :func:`sdp.metrics.hardware.gpu_of_device`); None if unknown."""
    gpu = gpu_of_device(device_name)
    return gpu.peak_flops.get(dtype) if gpu is not None else None


def matmul_dtype(*, precision: str, tf32: bool) -> str:
    """What a run's matmuls run in, the key of a device's peak: bf16 under ``train.precision=bf16``, else tf32
    where TF32 matmuls are on (``train.tf32``, :func:`sdp.driver.rankenv.set_backends`), else fp32."""
    if precision == "bf16":
        return "bf16"
    return "tf32" if tf32 else "fp32"


def compute_dtype(summary: dict[str, Any]) -> str:
    """What the run's matmuls ran in (:func:`matmul_dtype`), from summary.json's ``precision`` (``train.precision``;
    fp32 when absent) and ``backends.tf32_matmul`` (what CUDA had on; false or absent on CPU)."""
    return matmul_dtype(precision=str(summary.get("precision") or "fp32"),
                        tf32=bool((summary.get("backends") or {}).get("tf32_matmul")))


def throughput(*, summary: dict[str, Any], flops_per_step: float | None) -> dict[str, Any]:
    """FLOPs per step, achieved FLOP/s and MFU of a run, from its summary and the budget's count."""
    t = summary["time"]
    step_s = t.get("step_s_median")
    devices = {(r.get("host"), r.get("device")) for r in t.get("per_rank", [])}
    names = {r.get("device_name", "cpu") for r in t.get("per_rank", [])}
    dtype = compute_dtype(summary)
    peak = peak_flops(device_name=names.pop(), dtype=dtype) if len(names) == 1 else None
    achieved = flops_per_step / step_s if flops_per_step and step_s else None
    mfu = achieved / (peak * len(devices)) if achieved and peak and devices else None
    return {"flops_per_step": flops_per_step, "flops_per_s": achieved, "mfu": mfu, "mfu_dtype": dtype,
            "peak_flops_per_device": peak, "devices": len(devices)}
