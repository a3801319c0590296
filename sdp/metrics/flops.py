"""FLOPs per step and model FLOPs utilisation (MFU) against a per-device peak table.

Why FLOPs from the model's count rather than a profiler: ``flops_per_sample`` (forward + backward,
``torch.utils.flop_counter`` on the meta device) times the global batch times the fraction of the
model the workers compute (:meth:`sdp.parallel.spec.StrategySpec.flops_fraction`: 1 for a strategy that
runs the whole model) is the useful work of a step, the same for every strategy; activation
recomputation (``train.ac``) is overhead, not useful work, as in the usual MFU definition (``sdp-plan``'s step
time adds it: :func:`sdp.parallel.ac.recompute_share`). The budget module
already counts it once per run in the driver (``summary.json["budget"]["flops_per_step"]``);
:func:`block_shares` are each block's shares of the model that a strategy with a coverage scales (per
level: at neuron level only the declared split sub-branches), and :func:`forward_fraction` what a worker
computes of them, per block, as the strategy's plan says (SDP: its units and their holders).

MFU = useful FLOPs per second / (dense peak of one device x distinct devices). Several gloo ranks
sharing one GPU count that GPU once. Peaks are the vendors' dense (no sparsity) figures of the device
table ``conf/hardware.yaml`` (the one ``sdp-plan``'s step time divides by); on CPU (no reliable peak) MFU is null.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sdp.metrics.hardware import gpu_of_device
from sdp.models.base import LEVELS


@dataclass(frozen=True)
class BlockShare:
    """One SDP block's shares of the model's forward FLOPs (:func:`block_shares`)."""

    branch: float  # its residual branch, shared sub-modules (a projection shortcut) left out: what a worker
    #                that runs none of the block skips
    split: float  # the part of ``branch`` a worker holding some of the block's units narrows to its share:
    #               all of it at block level; at neuron level the sub-branches its hidden dims split


def block_shares(*, counts: dict[str, int], model: Any, level: str) -> dict[int, BlockShare]:
    """Per block of ``model.sdp_units()``, its :class:`BlockShare` of the forward FLOPs (``counts``: per-module
    FLOPs, :func:`sdp.models.base.forward_flop_counts`).

    ``level="block"``: the units' residual branches (a dropped block runs none of its branch; shared
    sub-modules such as a projection shortcut run anyway). ``level="neuron"``: only the sub-branches the
    blocks' hidden dims run (``HiddenDim.branch``, ``""`` = the whole residual branch), the same
    declaration that says what is rescaled; what no hidden dim splits (attention under grouped-query
    attention, Swin's attention) runs in full on every worker that holds a group of the block. A block
    without hidden dims is one whole unit at neuron level too (:func:`sdp.subnet.plan.declare_units`)."""
    if level not in LEVELS:
        raise ValueError(f"level={level!r} not in {LEVELS}")
    prefix = type(model).__name__
    total = counts["Global"]
    out: dict[int, BlockShare] = {}
    for i, block in model.sdp_units():
        name = f"{prefix}.blocks.{i}"
        whole = counts.get(name, 0) - sum(counts.get(f"{name}.{s}", 0) for s in block.shared_submodules())
        branches = {d.branch for d in block.hidden_dims()} if level == "neuron" else set()
        split = whole
        if branches and "" not in branches:
            split = 0
            for b in sorted(branches):
                key = f"{name}.{b}"
                if key not in counts and whole > 0:
                    block.get_submodule(b)  # raises when the declared branch names no sub-module
                    raise AssertionError(f"{key}: the declared HiddenDim.branch is never called as a module, so its "
                                         f"work is not counted under its name ({type(block).__name__}.forward_full)")
                split += counts.get(key, 0)
        assert 0 <= split <= whole <= total, f"{name}: split {split}, branch {whole}, total {total} FLOPs at level={level}"
        out[i] = BlockShare(branch=whole / total, split=split / total) if total > 0 else BlockShare(branch=0.0, split=0.0)
    return out


def unit_shares(*, counts: dict[str, int], model: Any) -> dict[str, dict[int, BlockShare]]:
    """:func:`block_shares` at every level (``{"block": .., "neuron": ..}``): the model's facts, counted once;
    a strategy picks its own level (:meth:`sdp.parallel.spec.StrategySpec.flops_fraction`)."""
    return {level: block_shares(counts=counts, model=model, level=level) for level in LEVELS}


def masked_fraction(*, counts: dict[str, int], model: Any, level: str) -> float:
    """Share of the forward FLOPs that a worker holding a fraction of every unit computes only that
    fraction of: the sum of the blocks' split shares (:func:`block_shares`)."""
    return sum(s.split for s in block_shares(counts=counts, model=model, level=level).values())


def forward_fraction(*, shares: dict[int, BlockShare], computed: dict[int, tuple[float, float]]) -> float:
    """Forward FLOPs one worker computes on average, as a fraction of the full model's: every block in
    ``computed`` maps to (the share of workers that run any of it, the mean share of its split part a worker
    computes), e.g. from an SDP plan's units and holders; a block not in it (shared whole, as a downsampling
    block under ``drop_downsample=false``) and everything outside the blocks (stem, head, shortcuts) runs in
    full on every worker. Why per block rather than one masked share times one coverage: which blocks are
    units, how many workers hold each and whether a block's unsplit rest runs everywhere are the plan's
    to say, and each option that changes them (``drop_downsample``, neuron level, a capped plan, per-block
    survival probabilities) changes the FLOPs."""
    skipped = 0.0
    for b, (runs, narrowed) in computed.items():
        s = shares[b]
        assert 0 <= narrowed <= runs <= 1, f"blocks.{b}: computed by {runs} of the workers, {narrowed} of its split part"
        skipped += (s.branch - s.split) * (1.0 - runs) + s.split * (1.0 - narrowed)
    return 1.0 - skipped


def peak_flops(*, device_name: str, dtype: str) -> float | None:
    """Dense peak of ``device_name`` (as ``torch.cuda.get_device_name`` spells it) for ``dtype``, from the one
    device table (``conf/hardware.yaml``, :func:`sdp.metrics.hardware.gpu_of_device`); None if unknown."""
    gpu = gpu_of_device(device_name)
    return gpu.peak_flops.get(dtype) if gpu is not None else None


def matmul_dtype(*, precision: str, tf32: bool) -> str:
    """What a run's matmuls run in, the key of a device's peak: bf16 under ``train.precision=bf16``, else tf32
    where TF32 matmuls are on (``train.tf32``, :func:`sdp.rank.rankenv.set_backends`), else fp32."""
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
