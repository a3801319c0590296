"""sdp-plan's CUDA emulation against what an H200 measured, and the autocast facts the planner relies on.

The anchor is benchmarks/results/gpu/trace_cuda_llama134m.json: the live bytes after every op of one LLaMA-134M
training step (bf16 autocast, AdamW, batch 8 x 512 tokens, vocabulary 32,000) on an H200, written by
``benchmarks/gpu/peak_trace.py --device cuda`` (benchmarks/gpu/h200_check.sh, item ``trace``). No GPU is needed
here: the same step is rehearsed on meta as sdp-plan rehearses it for ``cluster.device=cuda`` and compared.

- The step's peak above its start is the measured one within 4 % (before the fixes below it was 19 % above; with
  them but meta's decomposed RMSNorm 7.8 % above, with CUDA's fused one 1.5 % below), as many ops as CUDA ran;
- the loss's ops (log-softmax to its backward) are CUDA's, in CUDA's order (log-softmax in bf16, only
  ``nll_loss``'s input cast to float32), and so are the bytes each adds;
- the optimizer runs foreach where CUDA does, and its step then holds a copy of the parameters (AdamW's
  ``_foreach_sqrt``), as measured;
- torch's autocast keeps a dropped weight's float32 source alive until its region ends, the emulation does too,
  and a part built for evaluation (:func:`sdp.subnet.assemble.frozen_part`) is freed at once.
"""

from __future__ import annotations

import gc
import json
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from sdp.metrics.live import LiveTensorTracker

REPO = Path(__file__).resolve().parents[1]
ANCHOR = REPO / "benchmarks" / "results" / "gpu" / "trace_cuda_llama134m.json"


def _meta_trace() -> tuple[dict, dict]:
    sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
    from peak_trace import trace

    cuda = json.loads(ANCHOR.read_text())
    return cuda, trace(overrides=cuda["overrides"], device="meta", target="cuda")


def _loss_region(t: dict) -> list[tuple[str, int]]:
    """From the forward's log-softmax to the log-softmax backward: each op and the MiB it added (CUDA's allocator
    rounds each block up to 512 bytes, so a scalar's bytes differ from meta's)."""
    rows = t["rows"]
    i = next(k for k, (n, _) in enumerate(rows) if n == "_log_softmax")
    j = next(k for k, (n, _) in enumerate(rows) if n == "_log_softmax_backward_data")
    return [(rows[k][0], round((rows[k][1] - rows[k - 1][1]) / 2**20)) for k in range(i, j + 1)]


def test_the_planned_cuda_step_matches_the_h200_trace() -> None:
    cuda, meta = _meta_trace()
    measured, planned = cuda["peak"] - cuda["start"], meta["peak"] - meta["start"]
    assert len(meta["rows"]) == len(cuda["rows"]), (len(meta["rows"]), len(cuda["rows"]))  # one op each per CUDA op
    assert abs(planned / measured - 1) <= 0.04, \
        f"planned step peak {planned / 2**20:.1f} MiB vs the H200's {measured / 2**20:.1f} MiB ({planned / measured:.3f}x)"
    assert _loss_region(meta) == _loss_region(cuda), (_loss_region(meta), _loss_region(cuda))


def test_the_optimizer_runs_foreach_where_cuda_does() -> None:
    from sdp.parallel.device_forward import device_optimizer

    params = [nn.Parameter(torch.empty(1000, 1000, device="meta")) for _ in range(3)]
    factory = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    assert device_optimizer(factory=factory, params=params, device="cuda").param_groups[0]["foreach"] is True
    assert device_optimizer(factory=factory, params=params, device="cpu").param_groups[0]["foreach"] is None
    fixed = lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False)  # noqa: E731  a user's choice is kept
    assert device_optimizer(factory=fixed, params=params, device="cuda").param_groups[0]["foreach"] is False
    # the H200's AdamW step: one transient as large as the parameters (float32), nothing larger
    cuda = json.loads(ANCHOR.read_text())
    step = [v for n, v in cuda["rows"][next(k for k, (n, _) in enumerate(cuda["rows"]) if n.startswith("_foreach")):]]
    n_params = 134_105_856  # LLaMA-134M at vocabulary 32,000 (the anchor's model)
    assert 1.0 <= (max(step) - cuda["start"]) / (4 * n_params) <= 1.05, (max(step) - cuda["start"]) / (4 * n_params)
    _, meta = _meta_trace()
    planned = [v for n, v in meta["rows"][next(k for k, (n, _) in enumerate(meta["rows"]) if n.startswith("_foreach")):]]
    assert abs((max(planned) - meta["start"]) - (max(step) - cuda["start"])) <= 0.02 * (max(step) - cuda["start"])


def test_autocast_keeps_a_dropped_weight_alive_and_a_frozen_part_is_freed() -> None:
    """The torch behaviour behind :func:`sdp.subnet.assemble.frozen_part` (a real CPU autocast region)."""
    from sdp.subnet.assemble import frozen_part

    for freeze, alive in ((False, True), (True, False)):
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            part = nn.Linear(64, 176)
            if freeze:
                part = frozen_part(part)
            storage = part.weight.untyped_storage()
            ref = weakref.ref(storage)
            del storage
            part(torch.randn(4, 64))
            del part
            gc.collect()
            assert (ref() is not None) == alive, f"frozen_part={freeze}: source {'alive' if ref() else 'freed'}"


def test_the_meta_autocast_holds_dropped_sources_as_torch_does() -> None:
    """A module dropped inside one autocast region: the live bytes at the end of the region, real CPU autocast
    against the planner's emulation on meta (:class:`sdp.parallel.device_forward.Autocast`)."""
    from sdp.parallel.device_forward import device_forward

    def run(device: str) -> int:
        tracker = LiveTensorTracker(device_type=device)
        with tracker:
            region = (torch.autocast("cpu", dtype=torch.bfloat16) if device == "cpu"
                      else device_forward(precision="bf16", device="cpu"))
            with region, torch.no_grad():
                x = torch.empty(4, 64, device=device)
                for _ in range(3):
                    part = nn.Linear(64, 176, bias=False, device=device)
                    part(x)
                    del part
                gc.collect()
                held = tracker.total
        return held

    assert run("meta") == run("cpu") == 4 * 64 * 4 + 3 * 176 * 64 * (4 + 2), (run("meta"), run("cpu"))


RUNS = REPO / "benchmarks" / "results" / "gpu" / "runs-20261204T164231Z.tar.gz"  # the check's call 3 (h200_check.md)


@pytest.mark.parametrize("name", ["gloo_ddp_lm", "gloo_sdp_lm", "gloo_fsdp_lm"])
def test_the_plan_of_each_h200_run_is_its_measured_peaks(name: str) -> None:
    """The GPU check's memory runs (LLaMA-134M, 4 gloo ranks on one H200, bf16; DDP, SDP C = 0.5, FSDP): sdp-plan for
    each run's own overrides against the allocator peaks its summary.json recorded, largest rank, every phase within
    5 % (the check's verdict allows 10 %). When the runs were made the plan had FSDP's training step at 0.88x
    measured (meta's decomposed RMSNorm, above)."""
    import tarfile

    import yaml

    from sdp.bench.runs import compose
    from sdp.planning.planner import predict

    with tarfile.open(RUNS) as tar:
        run = next(m.name.rsplit("/", 1)[0] for m in tar.getmembers() if m.name.endswith(f"/{name}/summary.json"))
        read = lambda f: tar.extractfile(f"{run}/{f}").read()  # noqa: E731
        overrides = [o for o in yaml.safe_load(read(".hydra/overrides.yaml")) if not o.startswith("hydra")]
        measured = json.loads(read("summary.json"))["memory"]["per_rank"]
    planned = predict(compose(overrides))["memory"]["per_rank"]
    ratios = {key: max(r[key] for r in measured) / max(r[key] for r in planned)
              for key in ("setup_peak_bytes", "train_peak_bytes", "eval_peak_bytes")}
    assert all(abs(r - 1) <= 0.05 for r in ratios.values()), f"{name} measured / planned: {ratios}"
