"""Where sdp-plan's train peak and a real device part ways, op by op.

Why: the one-GPU check (h200_check.sh, ``peaks``) found the plan's train peaks above CUDA's allocator peaks
(benchmarks/results/gpu/h200_check.md) while the same rehearsal matches the CPU tracker. This script runs the
rehearsal's two training steps (:func:`sdp.parallel.plan_peaks.train_step`, the step :func:`~sdp.parallel.plan_peaks.rehearse`
runs: a warm-up step, then the measured one) on a real device under the real autocast, and on the meta
device under the plan's emulation (:func:`sdp.parallel.device_forward.device_forward`), logging the live bytes
after every op of the second step; ``--compare`` lines the two logs up and prints where they first differ and
what each holds at its peak.

    python benchmarks/gpu/peak_trace.py --device cuda --out cuda.json OVERRIDES...   # real CUDA, allocator bytes
    python benchmarks/gpu/peak_trace.py --device meta --target cuda --out meta.json OVERRIDES...  # the plan's view
    python benchmarks/gpu/peak_trace.py --device cpu --out cpu.json OVERRIDES...     # real CPU, live-tensor tracker
    python benchmarks/gpu/peak_trace.py --compare cuda.json meta.json

OVERRIDES are ``sdp-train``'s (model, dataset, train.batch_size, train.precision, optim). The model is a
single replica (DDP's rehearsal without its buckets): the comparison is of the step, not of a strategy.
"""

from __future__ import annotations

import argparse
import json
from contextlib import ExitStack
from difflib import SequenceMatcher
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sdp.bench.runs import compose
from sdp.core.loss import loss_fn
from sdp.core.precision import autocast
from sdp.metrics.live import LiveTensorTracker
from sdp.parallel.device_forward import Attention, device_forward, device_optimizer
from sdp.parallel.plan_peaks import train_step
from sdp.registry import build


class OpLog(TorchDispatchMode):
    """After each op: its name and the live bytes ``live()`` reports (entered inside the tracker, if any)."""

    def __init__(self, live: Any) -> None:
        super().__init__()
        self.live, self.on, self.rows = live, False, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if self.on:
            self.rows.append((str(func.overloadpacket.__name__), int(self.live())))
        return out


def trace(*, overrides: list[str], device: str, target: str) -> dict[str, Any]:
    cfg = compose(overrides)
    precision, batch = str(cfg.train.precision), int(cfg.train.batch_size)
    dev = torch.device("meta" if device == "meta" else device)
    with torch.device(dev):
        model = build(cfg.model)
    if device == "meta":
        model = model.to_empty(device="meta")
    tracker = LiveTensorTracker(device_type=dev.type) if dev.type != "cuda" else None
    live = (lambda: tracker.total) if tracker is not None else (lambda: torch.cuda.memory_allocated(dev))
    log = OpLog(live)
    params = list(model.parameters())  # meta: the optimizer as the plan builds it for ``target``; else torch's defaults
    opt = (device_optimizer(factory=build(cfg.optim.optimizer), params=params, device=target) if device == "meta"
           else build(cfg.optim.optimizer)(params))
    with ExitStack() as stack:
        if tracker is not None:
            stack.enter_context(tracker)
            tracker.label(list(model.parameters()) + list(model.buffers()), "parameters")
        if device == "meta":
            stack.enter_context(Attention(device=target))
        stack.enter_context(log)
        x = model.example_input(batch).to(dev)
        base = 0
        for step in range(2):
            if step == 1:
                log.on, base = True, int(live())
            region = (device_forward(precision=precision, device=target, attention=False) if device == "meta"
                      else autocast(precision=precision, device=dev))
            train_step(module=model, x=x, loss=loss_fn, optimizer=opt, region=region)  # the rehearsal's own step
        log.on = False
    peak = max((b for _, b in log.rows), default=base)
    return {"device": device, "target": target, "overrides": overrides, "start": base, "peak": peak,
            "rows": log.rows}


def compare(a: dict[str, Any], b: dict[str, Any]) -> str:
    lines = [f"{a['device']}: start {a['start'] / 2**20:.1f} MiB, peak {a['peak'] / 2**20:.1f} MiB, {len(a['rows'])} ops",
             f"{b['device']}: start {b['start'] / 2**20:.1f} MiB, peak {b['peak'] / 2**20:.1f} MiB, {len(b['rows'])} ops"]
    for t in (a, b):
        i = max(range(len(t["rows"])), key=lambda j: t["rows"][j][1])
        lines.append(f"{t['device']} peak at op {i} ({t['rows'][i][0]}); ops around it: "
                     + ", ".join(f"{n}:{v / 2**20:.0f}" for n, v in t["rows"][max(0, i - 6):i + 4]))
    names = [[n for n, _ in t["rows"]] for t in (a, b)]  # align the two op sequences (the backward's order may differ)
    step = max(2**20, a["peak"] // 200)
    shown, prev = 0, 0
    for ia, ib, size in SequenceMatcher(None, *names, autojunk=False).get_matching_blocks():
        for k in range(size):
            gap = (a["rows"][ia + k][1] - a["start"]) - (b["rows"][ib + k][1] - b["start"])
            if abs(gap - prev) > step and shown < 60:  # report each change of the gap (a - b) larger than step
                lines.append(f"op {ia + k}/{ib + k} {names[0][ia + k]}: gap (a - b) {prev / 2**20:+.1f} -> "
                             f"{gap / 2**20:+.1f} MiB; a's ops before: {names[0][max(0, ia + k - 4):ia + k]}")
                shown += 1
            prev = gap
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu", "meta"))
    p.add_argument("--target", default="cuda", help="meta only: the device the plan emulates (cluster.device)")
    p.add_argument("--out")
    p.add_argument("--compare", nargs=2)
    args, overrides = p.parse_known_args()
    if args.compare:
        print(compare(*(json.loads(Path(f).read_text()) for f in args.compare)))
        return
    assert args.device and args.out, "--device and --out (or --compare A B)"
    t = trace(overrides=overrides, device=args.device, target=args.target if args.device == "meta" else args.device)
    Path(args.out).write_text(json.dumps(t))
    print(f"{args.device}: start {t['start'] / 2**20:.1f} MiB, peak {t['peak'] / 2**20:.1f} MiB, {len(t['rows'])} ops")


if __name__ == "__main__":
    main()
