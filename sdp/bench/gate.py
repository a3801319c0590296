"""The depth gate of the CPU LM study (issue 38, item 1): does the task reward depth at equal FLOPs?

Why a gate: the study's verdicts compare methods that compute fewer blocks per step (SDP, the drop
baselines) with DDP on all of them; on a task where a shallower model given more steps is as good as a deeper
one, such verdicts say nothing about depth. So before its table the study runs DDP at 2, 4 and 8 blocks (same
width, embedding and head), each FLOP-matched to the 8-block model (``train.flops_reference={n_layers: 8}``,
:mod:`sdp.driver.budget`: the shallower ones run proportionally more steps), over seeds, paired by seed (one
seed fixes the data order of every depth).

The rule (:func:`gate_verdict`), on the paired differences of final eval loss with their 95 % Student t intervals
(:func:`sdp.report.stats.paired_difference`):

- PASS: DDP-8 − DDP-4 at most −:data:`MARGIN` nats with its interval below 0, and DDP-4 − DDP-2 below 0 with its
  interval below 0, on at least :data:`SEEDS_FOR_PASS` seeds; the same on fewer seeds is a *screening pass*;
- FAIL: the interval of DDP-8 − DDP-4 lies above −MARGIN (the deep model's gain is resolved to be smaller than
  the margin, or a loss), or that of DDP-4 − DDP-2 lies above 0;
- not resolved: anything else (fewer than 2 seeds included).

Tasks are experiment YAMLs (``conf/experiment/``, :data:`GATES`); each task's runs are
``<study>/runs/gate/<task>/seed-<s>/blocks-<n>`` (one run per sweep, so that each can be run alone, e.g. under
a lock). The study's own task (``task``, the candidate it runs on) is the one to pass: its gate runs are the study table's DDP rows at
every depth (:func:`task_runs`; DDP-8 the reference, the shallower ones the small dense models), so its main sweep
runs no DDP. A task whose reference-depth runs are another study's main sweep (``elsewhere``: the text task, whose
study ``lm_text`` is kept as a record) reads them from there (the same job).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdp.bench.gate_groups import group_lines
from sdp.report.runs import Run, find_runs, run_figures
from sdp.report.stats import Paired, paired_difference

MARGIN = 0.05  # nats: the least gain of DDP-8 over DDP-4 that passes
SEEDS_FOR_PASS = 5
DEPTHS = (2, 4, 8)  # blocks; the last is the reference every depth is FLOP-matched to
# study -> its task (the experiment whose gate runs at every depth are the study's DDP rows), the tasks tried, each with
# the seeds its gate runs (the screening seeds; 5 for a task that is to pass), and the tasks whose reference-depth
# DDP runs are the main sweep of another study (its directory next to this one's)
GATES: dict[str, dict[str, Any]] = {
    "lm": {"task": "cpu_gate_automaton_sparse_k6_8k",
           "tasks": {"cpu_study_lm": 3, "cpu_gate_narrow": 2, "cpu_gate_lr3": 2, "cpu_gate_pointer": 1,
                     "cpu_gate_automaton": 1, "cpu_gate_automaton_sparse": 1, "cpu_gate_automaton_sparse_k6": 5,
                     "cpu_gate_automaton_sparse_k6_8k": 5},
           "elsewhere": {"cpu_study_lm": "lm_text"}},
}


def gate_stages(*, study: str, out_runs: Path, common: list[str]) -> list[tuple[str, list[str]]]:
    """``(stage name, sdp-train arguments)`` of every gate run of ``study``: ``gate-<task>-s<seed>-L<blocks>``,
    seed the outer loop, the deepest first (``common``: the study's own arguments less the experiment)."""
    spec = GATES.get(study)
    if spec is None:
        return []
    ref = DEPTHS[-1]
    out = []
    for task, n_seeds in spec["tasks"].items():
        for seed in range(n_seeds):
            for blocks in sorted(DEPTHS, reverse=True):
                if task in spec.get("elsewhere", {}) and blocks == ref:
                    continue  # that study's main sweep's DDP run of this seed
                out.append((f"gate-{task}-s{seed}-L{blocks}",
                            [f"experiment={task}", *common, "variant=ddp", f"seed={seed}", f"model.n_layers={blocks}",
                             f"train.flops_reference={{n_layers:{ref}}}",
                             f"hydra.sweep.dir={out_runs / 'gate' / task / f'seed-{seed}' / f'blocks-{blocks}'}"]))
    return out


@dataclass(frozen=True)
class Gate:
    """One task's gate: final eval loss by depth and seed, and the two paired differences."""

    task: str
    losses: dict[int, dict[int, float | None]]  # blocks -> seed -> final eval loss
    settings: dict[str, Any]
    train_s: dict[int, list[float]]  # blocks -> each run's training seconds (steps x its median step time)
    commits: tuple[str, ...] = ()  # the code the runs were made at (a reference taken from the main sweep: its own)
    groups: dict[int, dict[int, Any]] = field(default_factory=dict)  # blocks -> seed -> final eval_loss_by_group or None

    @property
    def deep(self) -> Paired:
        """DDP-8 − DDP-4, paired by seed."""
        return paired_difference(self.losses.get(DEPTHS[2], {}), self.losses.get(DEPTHS[1], {}))

    @property
    def mid(self) -> Paired:
        """DDP-4 − DDP-2, paired by seed."""
        return paired_difference(self.losses.get(DEPTHS[1], {}), self.losses.get(DEPTHS[0], {}))

    @property
    def seeds(self) -> list[int]:
        """Seeds with a loss at every depth."""
        common = set.intersection(*(set(s for s, v in self.losses.get(d, {}).items() if v is not None) for d in DEPTHS))
        return sorted(common)

    @property
    def verdict(self) -> str:
        return gate_verdict(deep=self.deep, mid=self.mid, n=len(self.seeds))

    @property
    def seed_s(self) -> float | None:
        """Training seconds of one seed at every depth (mean per depth, summed): what one more seed costs."""
        if any(not self.train_s.get(d) for d in DEPTHS):
            return None
        return sum(statistics.fmean(self.train_s[d]) for d in DEPTHS)


def gate_verdict(*, deep: Paired, mid: Paired, n: int, margin: float = MARGIN, seeds_for_pass: int = SEEDS_FOR_PASS) -> str:
    """PASS, ``FAIL (why)``, ``screening pass (n seeds; ... needed)`` or ``not resolved``: the rule of this module's
    docstring; ``n``: the seeds with every depth."""
    why = []  # a FAIL needs only the interval that fails: a resolved miss is not undone by a depth still missing
    if deep.half_width is not None and deep.mean - deep.half_width > -margin:
        why.append(f"DDP-8 − DDP-4 interval above −{margin}")
    if mid.half_width is not None and mid.mean - mid.half_width > 0:
        why.append("DDP-4 − DDP-2 interval above 0")
    screening = "" if n >= seeds_for_pass else f" (screening: {n} of {seeds_for_pass} seeds at every depth)"
    if why:
        return f"FAIL ({'; '.join(why)}){screening}"
    short = [f"{name}: {d.n} paired seed{'' if d.n == 1 else 's'}" for name, d in
             (("DDP-8 − DDP-4", deep), ("DDP-4 − DDP-2", mid)) if d.half_width is None]
    if short:  # no interval yet: say which difference lacks seeds (the other may be resolved already)
        return f"not resolved ({'; '.join(short)}){screening}"
    if deep.mean <= -margin and deep.resolved and mid.mean < 0 and mid.resolved:
        return "PASS" if not screening else f"screening pass ({n} seeds; {seeds_for_pass} needed for PASS)"
    return f"not resolved{screening}"


def _settings(run: Run) -> dict[str, Any]:
    f = run.flat
    seq = f.get("dataset.seq_len")
    tokens = run.tokens_per_step() if run.tokens_per_sample() else None  # a gate's task is a language model's
    corpus = f.get("dataset.kind") or f.get("dataset.name")
    if f.get("dataset.text_bytes") is not None:
        corpus = f"{corpus}, {int(f['dataset.text_bytes']) / 1e6:g} MB"
    if f.get("dataset.hops") is not None:  # dataset=pointer (sdp/data/pointer.py)
        corpus = f"{corpus}: {f['dataset.chains']} chains x {f['dataset.hops']} hops, {f['dataset.queries']} queries"
    if f.get("dataset.max_steps") is not None:  # dataset=automaton (sdp/data/automaton.py)
        corpus = f"{corpus}: {f['dataset.symbols']} symbols, k = 1..{f['dataset.max_steps']} steps"
        if f.get("dataset.neighbours") is not None:  # runs before the key read 2 neighbours, a dense table
            density = f.get("dataset.density")
            corpus += f", {f['dataset.neighbours']} neighbours, " + ("dense" if density is None else f"density {density:g}")
    budget = (run.summary.budget or {}) if run.summary else {}
    return {"corpus": corpus, "seq_len": seq, "tokens/step": tokens, "width": f"{f.get('model.dim')}/{f.get('model.hidden')}",
            "peak lr": f.get("optim.optimizer.lr"),
            "DDP-8 steps": budget.get("base_steps", f.get("train.steps"))}


def _is_reference_ddp(run: Run, *, blocks: int) -> bool:
    f = run.flat
    return (run.ok and f.get("parallelism.name") == "ddp" and f.get("train.budget") == "flops"
            and int(f.get("model.n_layers", -1)) == blocks and not any(k.startswith("train.flops_reference.") for k in f))


def task_runs(*, study_dir: Path, study: str) -> list[Run]:
    """The finished gate runs of the study's own task (every depth and seed): the study table's DDP rows."""
    task = GATES.get(study, {}).get("task")
    root = Path(study_dir) / "runs" / "gate" / str(task)
    return [r for r in find_runs(root) if r.ok] if task and root.is_dir() else []


def collect_gates(*, study_dir: Path, study: str) -> list[Gate]:
    """Every task under ``<study_dir>/runs/gate`` (in :data:`GATES` order, then any other); a task ``elsewhere``
    takes its reference depth from that study's main sweep's DDP runs."""
    spec = GATES.get(study, {"tasks": {}})
    root = Path(study_dir) / "runs" / "gate"
    found = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    order = [t for t in spec["tasks"] if t in found] + [t for t in found if t not in spec["tasks"]]
    gates = []
    for task in order:
        runs = [r for r in find_runs(root / task) if r.ok]
        other = Path(study_dir).parent / spec.get("elsewhere", {}).get(task, "-") / "runs" / "main"
        if other.is_dir():
            runs += [r for r in find_runs(other) if _is_reference_ddp(r, blocks=DEPTHS[-1])]
        losses: dict[int, dict[int, float | None]] = {}
        train_s: dict[int, list[float]] = {}
        groups: dict[int, dict[int, Any]] = {}
        for r in runs:
            blocks, fig = int(r.flat["model.n_layers"]), run_figures(r.summary)
            losses.setdefault(blocks, {})[int(r.seed)] = fig["eval_loss"]
            groups.setdefault(blocks, {})[int(r.seed)] = fig.get("eval_loss_by_group")
            if fig["step_s"] is not None and fig["steps"]:
                train_s.setdefault(blocks, []).append(fig["step_s"] * fig["steps"])
        if runs:  # the settings of a reference-depth run where there is one (its steps are the budget's base)
            ref = next((r for r in runs if int(r.flat["model.n_layers"]) == DEPTHS[-1]), runs[0])
            commits = tuple(sorted({str(r.summary.versions.get("git_commit"))[:12] for r in runs}))
            gates.append(Gate(task=task, losses=losses, settings=_settings(ref), train_s=train_s, commits=commits,
                              groups=groups))
    return gates


def _pm(p: Paired) -> str:
    if p.mean is None:
        return "–"
    return f"{p.mean:+.3f}" + ("" if p.half_width is None else f" ± {p.half_width:.3f}")


def _loss(gate: Gate, blocks: int) -> str:
    vals = [v for v in gate.losses.get(blocks, {}).values() if v is not None]
    if not vals:
        return "–"
    return f"{statistics.fmean(vals):.3f}" + (f" ± {statistics.stdev(vals):.3f}" if len(vals) > 1 else "")


def gate_section(*, study_dir: Path, study: str) -> list[str]:
    """The report's first section: the rule, the verdict of the study's own task, the table of every task tried, and
    for a task whose runs recorded ``eval_loss_by_group`` its loss by group per depth (:mod:`sdp.bench.gate_groups`)."""
    gates = collect_gates(study_dir=study_dir, study=study)
    if not gates:
        return []
    main = GATES.get(study, {}).get("task")
    lines = ["## Depth gate: does the task reward depth at equal FLOPs?", "",
             f"DDP at {', '.join(map(str, DEPTHS))} blocks (same width, embedding and head), each FLOP-matched to the "
             f"{DEPTHS[-1]}-block model (`train.flops_reference={{n_layers: {DEPTHS[-1]}}}`: a shallower model runs "
             f"proportionally more steps), paired by seed. PASS: DDP-{DEPTHS[2]} − DDP-{DEPTHS[1]} ≤ −{MARGIN} nats "
             f"with its 95 % t interval below 0, and DDP-{DEPTHS[1]} − DDP-{DEPTHS[0]} below 0, resolved, on at least "
             f"{SEEDS_FOR_PASS} seeds (on fewer: a screening pass); FAIL: the first interval lies above −{MARGIN} or "
             f"the second above 0. Differences: mean ± 95 % t half-width over the seeds run at both depths; losses: "
             f"mean ± sample std. Train s per seed: one seed at every depth, each run's steps x its median step time "
             f"(training only, on this shared machine: what one more seed costs).", ""]
    for g in gates:
        if g.task == main:
            lines += [f"**The study's task (`{main}`, the table below): {g.verdict}** — DDP-{DEPTHS[2]} − "
                      f"DDP-{DEPTHS[1]} {_pm(g.deep)} nats, DDP-{DEPTHS[1]} − DDP-{DEPTHS[0]} {_pm(g.mid)} nats "
                      f"(paired seeds: {g.deep.n} and {g.mid.n}; {len(g.seeds)} at every depth; these runs are the "
                      f"table's DDP rows: DDP-{DEPTHS[-1]} the reference, the shallower ones the small dense models at "
                      f"one SDP worker's depth).", ""]
    per_depth = "/".join(map(str, sorted(DEPTHS, reverse=True)))
    head = ["task", "corpus", "seq_len", "tokens/step", "width (dim/hidden)", "peak lr", "DDP-8 steps",
            "seeds at every depth", f"seeds at {per_depth} blocks",
            *(f"DDP-{d} loss" for d in sorted(DEPTHS, reverse=True)), "DDP-8 − DDP-4", "DDP-4 − DDP-2", "train s per seed", "verdict", "commits"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in gates:
        s = g.settings
        cells = [f"`{g.task}`", str(s["corpus"]), str(s["seq_len"]), f"{s['tokens/step']:,}" if s["tokens/step"] else "–",
                 s["width"], f"{s['peak lr']:g}" if s["peak lr"] is not None else "–", str(s["DDP-8 steps"]), ",".join(map(str, g.seeds)) or "–",
                 "/".join(str(sum(v is not None for v in g.losses.get(d, {}).values())) for d in sorted(DEPTHS, reverse=True)),
                 *(_loss(g, d) for d in sorted(DEPTHS, reverse=True)), _pm(g.deep), _pm(g.mid),
                 "–" if g.seed_s is None else f"{g.seed_s:.0f}", g.verdict, " ".join(g.commits)]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    probes = study_dir / "depth_probes" / "probes.md"
    if probes.is_file():  # the cheaper screen that picks which tasks get the runs above (sdp.bench.depth_probe)
        lines += ["Tasks screened in one process on one seed before any gate run (`sdp-bench depth-probe`, "
                  "plumbing-grade, each with its loss by depth): [depth_probes/probes.md](depth_probes/probes.md).", ""]
    for g in gates:  # where the runs recorded the loss by difficulty group: at which group depth pays
        lines += group_lines(task=g.task, groups=g.groups, depths=DEPTHS)
    return lines


def no_gate_lines(*, study: str, ddp_accuracy: float | None) -> list[str]:
    """A study without a gate (:data:`GATES`) whose DDP accuracy is measured: why it has none, from that figure."""
    if study in GATES or ddp_accuracy is None:
        return []
    return ["## Depth gate: not run for this study", "",
            f"DDP reaches {ddp_accuracy:.2f} % evaluation accuracy (mean over its seeds), {100 - ddp_accuracy:.2f} "
            f"points from 100 %: on this task a deeper ResNet has almost nothing left to gain, so a gate of DDP at "
            f"several depths could only tie, and the verdicts below say nothing about depth. A gate for the image "
            f"study needs a task that is not saturated (e.g. CIFAR-10 through `dataset=cifar10`, a download this "
            f"CPU study avoids); the LM study carries the depth question.", ""]
