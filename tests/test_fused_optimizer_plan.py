"""sdp-plan accepts torch's fused AdamW (``fused=True``, torchtitan's default) and rehearses what it holds
(sdp.parallel.device_forward.device_optimizer); it used to stop at torch's refusal of fused over meta tensors.

- The plan succeeds with ``+optim.optimizer.fused=true`` for DDP and block-level SDP (a re-drawing SDP too, whose state
  template describes the step counter fused keeps on the device) on llama_tiny, cuda, bf16. At the default batch the
  backward sets the train peak, which fused leaves as foreach's but for its step counters (a float32 per parameter on
  the device, where foreach's sit on the CPU).
- At batch 1 and 4 tokens the step sets foreach's train peak: parameters, gradients and moments plus its temporary, a
  float32 copy of the parameters. Fused's is lower by at least 0.3x the parameter bytes and at most their bytes: fused
  holds no temporary, so what stays is the backward's peak above the same state, autocast's bf16 weight casts (up to
  half the parameter bytes) and the few activations of 4 tokens.
- On the CPU, the meta rehearsal of a fused AdamW step holds what a real CPU fused step holds, byte for byte
  (:class:`~sdp.metrics.live.LiveTensorTracker`): moments and step counters at the first step, nothing above its
  start at the second (foreach holds a copy of the parameters there).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

from sdp.metrics.live import LiveTensorTracker
from tests.helpers import compose

JOB = ["model=llama_tiny", "dataset=synthetic_text", "optim=adamw", "cluster.device=cuda", "train.precision=bf16"]
FUSED = "+optim.optimizer.fused=true"
SHAPES = [(1000, 1000), (512, 300), (2000,)]  # float32: 4,622,400 B, the largest 4,000,000 B


def _plan(overrides: list[str]) -> dict:
    from sdp.planning.planner import predict

    return predict(compose(overrides))


@pytest.mark.parametrize("variant", [["parallelism=ddp"], ["parallelism=sdp"],
                                     ["parallelism=sdp", "parallelism.resample_every=2"]], ids=["ddp", "sdp", "sdp-redraw"])
def test_fused_adamw_is_planned(variant: list[str]) -> None:
    from sdp.registry import build

    job = [*JOB, *variant]
    foreach, fused = _plan(job), _plan([*job, FUSED])
    counters = 4 * len(list(build(compose(job).model).parameters()))  # one float32 step per parameter tensor, at most
    for a, b in zip(foreach["memory"]["per_rank"], fused["memory"]["per_rank"]):
        for key in ("train_peak_bytes", "redraw_peak_bytes"):
            if a.get(key) is not None:
                assert 0 <= b[key] - a[key] <= counters, f"rank {a['rank']} {key}: fused {b[key]} B, foreach {a[key]} B"
    assert fused.get("redraw") == foreach.get("redraw"), (fused.get("redraw"), foreach.get("redraw"))


@pytest.mark.parametrize("parallelism", ["ddp", "sdp"])
def test_fused_adamw_drops_the_foreach_temporary_where_the_step_sets_the_peak(parallelism: str) -> None:
    job = [*JOB, f"parallelism={parallelism}", "train.batch_size=1", "dataset.seq_len=4"]
    foreach, fused = (_plan(o)["memory"]["per_rank"][0] for o in (job, [*job, FUSED]))
    params = foreach["param_bytes"]
    state = foreach["param_bytes"] + foreach["grad_bytes"] + foreach["optim_bytes"]
    temporary = foreach["train_peak_bytes"] - state
    assert abs(temporary - params) <= 0.01 * params, f"foreach's step above the state {temporary} B, parameters {params} B"
    saved = foreach["train_peak_bytes"] - fused["train_peak_bytes"]
    assert 0.3 * params <= saved <= params, \
        (f"train peak: foreach {foreach['train_peak_bytes']} B, fused {fused['train_peak_bytes']} B, saved {saved} B "
         f"= {saved / params:.3f}x the parameters' {params} B (expected 0.3x to 1x)")


def _step_peaks(*, device: str, rehearsed: bool, **impl: bool) -> tuple[list[int], torch.optim.Optimizer]:
    """AdamW over SHAPES on ``device``: each of two steps' peak above its start (gradients set before), built by
    :func:`device_optimizer` (``rehearsed``) or by torch directly."""
    from sdp.parallel.device_forward import device_optimizer

    factory = partial(torch.optim.AdamW, lr=1e-3, **impl)
    tracker, peaks = LiveTensorTracker(device_type=device), []
    with tracker:
        params = [nn.Parameter(torch.ones(s, device=device)) for s in SHAPES]
        opt = device_optimizer(factory=factory, params=params, device="cpu") if rehearsed else factory(params)
        for _ in range(2):
            for p in params:
                p.grad = torch.full_like(p, 0.5)
            tracker.reset_peak()
            start = tracker.total
            opt.step()
            peaks.append(tracker.peak - start)
    return peaks, opt


def test_meta_fused_step_holds_what_a_cpu_fused_step_holds() -> None:
    params = 4 * sum(torch.Size(s).numel() for s in SHAPES)
    cpu, _ = _step_peaks(device="cpu", rehearsed=False, fused=True)
    meta, opt = _step_peaks(device="meta", rehearsed=True, fused=True)
    assert meta == cpu == [2 * params + 4 * len(SHAPES), 0], f"fused step peaks: meta {meta} B, CPU {cpu} B"
    assert all(s["step"].device.type == "meta" for s in opt.state.values())  # fused's counters, on the device
    from torch.optim import optimizer as torch_optimizer

    assert "meta" not in torch_optimizer._get_fused_kernels_supported_devices()  # torch's list restored after the step
    foreach, _ = _step_peaks(device="meta", rehearsed=True, foreach=True)
    assert foreach[1] == params, f"foreach's second step holds {foreach[1]} B above its start, parameters {params} B"
