"""The benchmark suites, one command: ``sdp-bench SUITE [options]`` (``sdp-bench SUITE --help``).

Each suite is a module of this package with a ``main(argv)``; it runs real ``sdp-train`` jobs or ranks
through :mod:`sdp.bench.runs` and writes its tables (ratios to DDP: :mod:`sdp.report.compare`) and
JSON under ``--out``. ``python benchmarks/cpu_study.py`` and the other scripts there are thin shims that
run the same suites, so the commands recorded in committed reports keep working.

Adding a suite: a module here with ``main(argv)`` and a line in :data:`SUITES`.
"""

from __future__ import annotations

# name -> what it measures (the module is sdp.bench.<name with "_" for "-">)
SUITES: dict[str, str] = {
    "report": "strategies side by side on one model (--suite resnet18|llama): ratios to DDP, plots, report.json",
    "compare": "the ratio-to-DDP table alone, for any list of runs (default: DDP vs the SDP variants)",
    "memory": "set-up, train and eval peaks of DDP vs SDP C=0.5, and the live-tensor tracker's cost",
    "overlap": "SDP's gradient sync with and without overlap: the exposed communication",
    "precision": "bf16 against fp32 for every strategy: loss gaps and step time",
    "harness-overhead": "the suite's DDP step against a minimal hand-written DDP loop",
    "capacity": "the largest LLaMA each strategy trains within a per-rank memory budget",
    "throughput-model": "no run: sdp-plan's predicted step time, DDP vs SDP C=0.5 on LLaMA-1B at 8 and 64 GPUs per link",
    "memory-anchor": "no run: sdp-plan's training peak of Llama-3.1-8B FSDP against torchtitan's measured 8 and 128 H100s",
    "one-model-scale": "no run: sdp-plan's peak of every one-model remedy phase vs DDP, DDP+AC, FSDP+AC at LLaMA 1B/8B on 8 GPUs",
    "eval-protocols": "the same trained weights under every eval.bn protocol and evaluation-time rescale",
    "cpu-study": "the CPU-scale study (--study lm|lm_text|image): every run, then its report (--render-only: the report)",
    "diagnose": "no training: why block-level SDP's assembled model loses, from a run's final weights (RUN_DIR...)",
    "depth-probe": "one process, one seed: DDP at 8/4/2 blocks FLOP-matched on a candidate task, before the depth gate",
    "slim-runs": "no measurement: committed run directories keep what reports, sdp-rerun and skip_done read (PATH...)",
}


def module_name(suite: str) -> str:
    return f"sdp.bench.{suite.replace('-', '_')}"
