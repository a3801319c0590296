"""SDP's gradient sync with and without overlap, side by side in one invocation (issue 18, part 3).

Two real ``sdp-train`` jobs on the same model, data, batch and plan, alternated ``--repeats`` times
(off, on, off, on, ...) so that a load change on the machine hits both: ``parallelism.overlap=false``
(today's path: every holder-set all-reduce after backward, blocking, timed as the ``comm`` phase)
and ``parallelism.overlap=true`` (launched from backward hooks; the ``comm`` phase is then only the
wait before the optimizer step, i.e. the *exposed* communication). Per run: the step-time median
(max over ranks of the rank medians, as summary.json), and the comm / backward phase medians (mean
over ranks of the rank medians). Targets: exposed comm <= 0.5 x the non-overlapped comm time, step
time with overlap <= step time without.

``--base-root DIR`` adds a third arm, ``base``: the blocking path of another source tree (an earlier
commit, e.g. ``git archive <commit> | tar -x -C DIR``), alternated with the other two. Why: the overlap
path's buckets are runs of consecutive tensors of one holder set (``sdp.subnet.sync.holder_runs``),
shared with ``overlap=false`` so that both give bit-identical gradients; before that change a bucket
packed a holder set's tensors from all over the model, with fewer collectives. "Today's non-overlapped
comm time" of the issue is the earlier tree's, so the result also gives both ratios against ``base``.

Default = the issue's case: SDP C=0.5 (block level, forward masking), 4 CPU ranks, ResNet-18 width
64, synthetic 32x32, batch 32 per rank. Run it under the machine's CPU lock and report ``uptime``:

    flock /tmp/sdp-cpu.lock sdp-bench overlap --out outputs/bench/overlap
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

from sdp.bench.runs import ROOT, parser, run_one
from sdp.results.contract import provenance
from sdp.results.summary import Summary

COMMON = ["model=resnet18_cifar", "model.width=64", "dataset=synthetic", "dataset.image_size=32",
          "train.batch_size=32", "cluster.world_size=4", "train.steps=10", "train.warmup_steps=3",
          "train.eval_every=0", "logger.wandb.mode=disabled", "logger.progress=false",
          "parallelism.coverage=0.5"]


def figures(summary: Summary) -> dict[str, float]:
    ranks = summary.time["per_rank"]
    phase = lambda name: statistics.mean(r["phases_s_median"].get(name, 0.0) for r in ranks)  # noqa: E731
    return {"step_s": summary.time["step_s_median"], "comm_s": phase("comm"), "backward_s": phase("backward"),
            "forward_s": phase("forward")}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = parser(suite="overlap", doc=__doc__)
    ap.add_argument("--preset", default="sdp", help="conf/parallelism preset (default sdp: B-SDP)")
    ap.add_argument("--common", nargs="*", default=COMMON)
    ap.add_argument("--extra", nargs="*", default=[], help="overrides appended to --common")
    ap.add_argument("--repeats", type=int, default=2, help="off/on pairs, alternated")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "overlap")
    ap.add_argument("--base-root", type=Path, default=None, help="source tree of the 'base' arm (blocking path)")
    ap.add_argument("--base-label", default=None, help="what --base-root is (e.g. its commit), for the record")
    args = ap.parse_args(argv)
    at_start = provenance()  # the tree the runs start from
    common = [*args.common, *args.extra]
    arms = {"off": (ROOT, "false"), "on": (ROOT, "true")}
    if args.base_root is not None:
        arms["base"] = (args.base_root.resolve(), "false")
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in arms}
    for i in range(args.repeats):
        for label, (root, overlap) in arms.items():
            s = run_one(label=f"{label}{i}", spec=f"{args.preset},parallelism.overlap={overlap}", common=common,
                        out=args.out, root=root)
            runs[label].append(figures(s))
            print(label, i, runs[label][-1], flush=True)
    med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in runs.items()}
    ratio = lambda a, b, f: med[a][f] / med[b][f] if med[b][f] else None  # noqa: E731
    result = {
        "runs": runs, "median": med,
        "exposed_comm_ratio": ratio("on", "off", "comm_s"), "step_ratio": ratio("on", "off", "step_s"),
        "loadavg": os.getloadavg(), "common": common, "preset": args.preset, **at_start,
    }
    if "base" in arms:
        result.update(base_root=str(args.base_root), base_label=args.base_label,
                      exposed_comm_ratio_vs_base=ratio("on", "base", "comm_s"), step_ratio_vs_base=ratio("on", "base", "step_s"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overlap.json").write_text(json.dumps(result, indent=2))
    print("| path | step s | comm s (exposed) | backward s | forward s |\n|---|---|---|---|---|")
    for k, m in med.items():
        name = f"base ({args.base_label or args.base_root}), overlap=false" if k == "base" else f"overlap={k}"
        print(f"| {name} | {m['step_s']:.3f} | {m['comm_s']:.3f} | {m['backward_s']:.3f} | {m['forward_s']:.3f} |")
    print(f"exposed comm (on) / comm (off) = {result['exposed_comm_ratio']:.3f} (target <= 0.5); "
          f"step on / off = {result['step_ratio']:.3f} (target <= 1); loadavg at end {result['loadavg']}")
    if "base" in arms:
        print(f"against base: exposed comm (on) / comm (base) = {result['exposed_comm_ratio_vs_base']:.3f}; "
              f"step on / base = {result['step_ratio_vs_base']:.3f}")
    return result

