"""``sdp-bench diagnose RUN_DIR...``: why block-level SDP's assembled model loses against its workers (issue 39),
from one run's final weights (``train.save_final``) on the run's own validation set.

    sdp-bench diagnose outputs/2026-12-04/00-00-00            # writes <run>/diagnosis.json, prints the verdict
    sdp-bench diagnose RUN --per-depth                          # also the scale sweep of each block alone

What it computes, every figure on the same batches (the run's validation shards, ``train.eval_batch_size`` samples a
forward, summed shard by shard in rank order as the run's evaluation sums them):

- per block b and each holder w: 1 - cos between block b's input (the residual stream) in the assembled model and in
  worker w's own subnetwork, per token, averaged over the tokens (block 0's input is the embedding for both: 0);
- the losses of the assembled model (every block at the factor evaluation uses, ``eval_scale``), of each worker's own
  subnetwork (its blocks at the scales it trained with), their ensemble (the mean of their probabilities,
  :func:`sdp.rank.eval_ensemble.log_mean_prob`, the run's arithmetic) and the residual-stream average
  head(x0 + mean_w(h_w - x0)) (x0: the embedding's output, h_w: worker w's stream before the head's norm);
- the scale sweep: the assembled model's loss with every block's branch at m x the factor, m in ``--multipliers``;
  with ``--per-depth`` one block at a time at m x the factor, the others at the factor.

Why one process and the full model: the diagnosis is an analysis of a finished run's weights (a tiny model at CPU
scale), not a rank's evaluation, so it builds the full model once and switches blocks and scales on it rather than
assembling over ranks. The assembled model and the workers' figures then equal the run's own (``summary.json``) to
float rounding where the weights were kept in fp32 (``tests/test_diagnose.py``); bf16 / fp16 weights round them.
Models with BatchNorm are refused (their evaluation protocol re-estimates statistics per evaluated model), and so
are neuron-level and backward-masked runs (no worker runs its own chain of whole blocks). The verdict is
:mod:`sdp.bench.diagnosis_verdict`'s rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.nn import functional as F

from sdp.bench.diagnosis_verdict import DIAGNOSIS, verdict
from sdp.core.loss import LOSS_CHUNK_TOKENS, scored, scored_rows, target_logprobs
from sdp.core.precision import autocast
from sdp.data.base import val_batches
from sdp.errors import ConfigError, require
from sdp.models.base import ResidualBlock, SDPModel, batch_norms
from sdp.rank import final_weights
from sdp.rank.eval_ensemble import log_mean_prob
from sdp.rank.eval_ops import accumulate, ordered_sum
from sdp.results.contract import write_json
from sdp.results.rundir import RunDir
from sdp.results.summary import read_json

MULTIPLIERS = (0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0)  # x the evaluation factor (at C = 0.5: 0.25 .. 1, no rescale)


@dataclass
class Loaded:
    """One run's model with its final weights, data, plan and scales."""

    cfg: DictConfig
    model: SDPModel
    data: Any
    holders: dict[int, tuple[int, ...]]  # block -> the workers that held it
    own: dict[int, dict[int, float]]  # worker -> {block: the branch scale it trained that block at}
    factor: float  # the branch scale evaluation puts on every block of the assembled model
    meta: dict[str, Any]


def load(run_dir: Path) -> Loaded:
    """The run's resolved config, its dataset, the full model with the final weights, and the plan (ConfigError
    naming what the diagnosis cannot read)."""
    from sdp.registry import build, import_plugins
    from sdp.rank.worker import build_model
    from sdp.subnet.assemble import partwise_names, tensor_map

    cfg = OmegaConf.load(RunDir(run_dir).config)
    import_plugins(cfg)
    fw = final_weights.load(run_dir)
    facts = fw.meta["facts"]
    plan = facts.get("plan")
    require(plan is not None and plan["level"] == "block", "parallelism.level", None if plan is None else plan["level"],
            "block (the diagnosis compares whole-block chains; an SDP run's final weights)")
    require(facts["masking"] == "forward", "parallelism.masking", facts["masking"],
            "forward (under backward masking every worker runs the full model: there is no own chain to compare)")
    data = build(cfg.dataset)
    model = build_model(cfg, data)
    require(not batch_norms(model), "model", cfg.model.get("name"), "a model without BatchNorm (its statistics are "
            "re-estimated per evaluated model, which the diagnosis does not repeat)")
    require(bool(partwise_names(model)), "model", cfg.model.get("name"), "head(blocks(stem(x))) without tied tensors")
    _fill(tensor_map(model), fw.tensors)
    model.eval()
    holders = {int(u[0]): tuple(h) for u, h in zip(plan["units"], plan["holders"])}
    own = {w: {int(b): float(s) for b, s in fw.own[w]["branch_scale"].items()} for w in fw.own}
    return Loaded(cfg=cfg, model=model, data=data, holders=holders, own=own, factor=float(facts["eval_scale"]),
                  meta=fw.meta)


@torch.no_grad()
def _fill(state: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    """Copy the saved tensors (or slices, ``name#dim:start:length``) into ``state``; every element must be written."""
    written = {name: 0 for name in state}
    for key, value in tensors.items():
        name, _, where = key.partition("#")
        if name not in state:
            raise ConfigError(f"final weights hold {key!r}, which the run's model (config.yaml) lacks")
        target = state[name].data
        if where:
            dim, start, length = map(int, where.split(":"))
            target = target.narrow(dim, start, length)
        target.copy_(value)
        written[name] += target.numel()
    short = {n: (w, state[n].numel()) for n, w in written.items() if w != state[n].numel()}
    assert not short, f"tensors not (or not exactly once) in the final weights: {dict(list(short.items())[:5])}"


def step_block(block: Any, x: torch.Tensor, *, scale: float | None) -> torch.Tensor:
    """``block(x)`` with its branch at ``scale`` (None: dropped, the block's skip path); a block that is no unit runs."""
    if isinstance(block, ResidualBlock):
        block.active = scale is not None
        block.set_scale(1.0 if scale is None else scale, split=False)
    return block(x)


def token_drift(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of 1 - cos(a, b) along the residual width, in float64, each term at least 0 (a cosine that
    rounds above 1 for identical inputs counts as 1)."""
    return (1 - F.cosine_similarity(a.double(), b.double(), dim=-1)).clamp_min(0).sum()


def target_log_probs(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """float64 log-probability of each scored row's target (:data:`IGNORE_INDEX` rows dropped, as the run's ensemble
    evaluation drops them: :func:`sdp.rank.eval_ensemble.add_batch`), in chunks as the loss and the ensemble
    compute it."""
    rows, labels = scored_rows(logits, target)
    return torch.cat([target_logprobs(o, t)[1] for o, t in zip(rows.split(LOSS_CHUNK_TOKENS), labels.split(LOSS_CHUNK_TOKENS))])


class Sums:
    """Every figure's float64 sums on one validation shard: losses (loss sum, correct, count) by name, drift
    (sum, tokens) by (block, worker)."""

    def __init__(self) -> None:
        self.loss: dict[str, torch.Tensor] = {}
        self.drift: dict[tuple[int, int], torch.Tensor] = {}

    def add(self, name: str, out: torch.Tensor, target: torch.Tensor) -> None:
        accumulate(self.loss.setdefault(name, torch.zeros(3, dtype=torch.float64)), out, target)


@torch.no_grad()
def batch_sums(run: Loaded, sums: Sums, x: torch.Tensor, y: torch.Tensor, *, multipliers: tuple[float, ...],
               per_depth: bool) -> None:
    """Every figure of one validation batch added to ``sums``: the chains run in lockstep, block by block."""
    m, f, workers = run.model, run.factor, sorted(run.own)
    x0 = m.stem(x)
    xa, xs, inputs = x0, {w: x0 for w in workers}, []
    for b, block in enumerate(m.blocks):
        inputs.append(xa)
        for w in run.holders.get(b, ()):
            sums.drift.setdefault((b, w), torch.zeros(2, dtype=torch.float64)).add_(
                torch.stack([token_drift(xa, xs[w]), torch.tensor(float(xa.shape[:-1].numel()), dtype=torch.float64)]))
        xa = step_block(block, xa, scale=f)
        xs = {w: step_block(block, xs[w], scale=run.own[w].get(b)) for w in workers}
    sums.add("assembled", m.head(xa), y)
    lp = []
    for w in workers:
        out = m.head(xs[w])
        sums.add(f"worker/{w}", out, y)
        lp.append(target_log_probs(out, y))
    ens = sums.loss.setdefault("ensemble", torch.zeros(3, dtype=torch.float64))
    ens[0] -= log_mean_prob(torch.stack(lp), workers=len(workers), reduce=_reduce_workers).sum()
    ens[2] += scored(y)
    moved = torch.stack([xs[w].double() - x0.double() for w in workers]).mean(0)
    sums.add("residual_average", m.head((x0.double() + moved).to(x0.dtype)), y)
    for mult in multipliers:
        h = x0
        for block in m.blocks:
            h = step_block(block, h, scale=mult * f)
        sums.add(f"scale/{mult:g}", m.head(h), y)
    for b in sorted(run.holders) if per_depth else ():
        for mult in multipliers:
            h = inputs[b]
            for c in range(b, len(m.blocks)):
                h = step_block(m.blocks[c], h, scale=mult * f if c == b else f)
            sums.add(f"depth/{b}/{mult:g}", m.head(h), y)


def _reduce_workers(t: torch.Tensor, op: Any) -> torch.Tensor:
    """:func:`log_mean_prob`'s reduction over the workers when one process holds every worker's rows (dim 0)."""
    return t.amax(0, keepdim=True) if op == dist.ReduceOp.MAX else t.sum(0, keepdim=True)


def measure(run: Loaded, *, multipliers: tuple[float, ...] = MULTIPLIERS, per_depth: bool = False) -> dict[str, Any]:
    """Every figure on the run's validation set, shard by shard as the run's evaluation (``cluster.world_size``
    shards of ``train.eval_batch_size``), under the run's ``train.precision``; returns the diagnosis' figures."""
    cfg, shards = run.cfg, []
    n = int(cfg.cluster.world_size)
    for j in range(n):
        sums = Sums()
        for x, y in val_batches(run.data, rank=j, world_size=n, batch_size=int(cfg.train.eval_batch_size)):
            with autocast(precision=str(cfg.train.precision), device=x.device):
                batch_sums(run, sums, x, y, multipliers=multipliers, per_depth=per_depth)
        shards.append(sums)
    loss = {k: ordered_sum([s.loss[k] for s in shards]) for k in shards[0].loss}
    drift = {k: ordered_sum([s.drift[k] for s in shards]) for k in shards[0].drift}
    value = {k: float(t[0] / t[2]) for k, t in loss.items()}
    workers = sorted(run.own)
    mean_workers = 0.0
    for w in workers:  # in rank order, as the run's world_sum adds the ranks' losses
        mean_workers += value[f"worker/{w}"]
    figures: dict[str, Any] = {
        "losses": {"assembled": value["assembled"], "ensemble": value["ensemble"],
                   "workers_mean": mean_workers / len(workers), "workers": [value[f"worker/{w}"] for w in workers],
                   "residual_average": value["residual_average"]},
        "drift": [{"block": b, "holders": {str(w): float(drift[b, w][0] / drift[b, w][1]) for w in hs},
                   "mean": sum(float(drift[b, w][0] / drift[b, w][1]) for w in hs) / len(hs)}
                  for b, hs in sorted(run.holders.items())],
        "scale_sweep": sweep([value[f"scale/{m:g}"] for m in multipliers], multipliers=multipliers, factor=run.factor),
        "tokens": int(loss["assembled"][2]),
    }
    if per_depth:
        figures["depth_sweep"] = [{"block": b, **sweep([value[f"depth/{b}/{m:g}"] for m in multipliers],
                                                       multipliers=multipliers, factor=run.factor)}
                                  for b in sorted(run.holders)]
    return figures


def sweep(losses: list[float], *, multipliers: tuple[float, ...], factor: float) -> dict[str, Any]:
    """A scale sweep's record: each multiplier, its scale (x the factor), its loss, and the best of them."""
    best = min(range(len(losses)), key=losses.__getitem__)
    return {"multipliers": list(multipliers), "scales": [m * factor for m in multipliers], "loss": losses,
            "best_multiplier": multipliers[best], "best_loss": losses[best]}


def diagnose(run_dir: Path, *, multipliers: tuple[float, ...] = MULTIPLIERS, per_depth: bool = False) -> dict[str, Any]:
    """The diagnosis of one run (module docstring), written to ``<run_dir>/diagnosis.json`` and returned."""
    require(1.0 in multipliers, "--multipliers", list(multipliers), "a list holding 1 (the factor evaluation uses)")
    run = load(run_dir)
    torch.manual_seed(0)  # nothing draws at evaluation (eval mode); fixed anyway
    figures = measure(run, multipliers=multipliers, per_depth=per_depth)
    final = (read_json(RunDir(run_dir).summary) or {}).get("final") or {}
    out = {"run_dir": str(run_dir), "step": run.meta["step"], "dtype": run.meta["dtype"], "world_size": len(run.own),
           "blocks": len(run.model.blocks), "plan": {str(b): list(h) for b, h in sorted(run.holders.items())},
           "eval_scale": run.factor, "rescale": run.meta["facts"]["rescale"],
           "precision": str(run.cfg.train.precision), **figures,
           "run_figures": {k: final.get(k) for k in ("eval_loss", "eval_loss_workers", "eval_loss_ensemble")}}
    out["verdict"] = verdict(out)
    write_json(RunDir(run_dir).root / DIAGNOSIS, out)
    return out


def main(argv: list[str] | None = None) -> int:
    from sdp.bench.diagnosis_verdict import markdown
    from sdp.bench.runs import parser

    ap = parser(suite="diagnose", doc=__doc__)
    ap.add_argument("run_dirs", nargs="+", type=Path, help="run directories of runs with train.save_final")
    ap.add_argument("--multipliers", default=",".join(f"{m:g}" for m in MULTIPLIERS),
                    help="comma-separated multipliers of the evaluation factor for the scale sweep (must hold 1)")
    ap.add_argument("--per-depth", action="store_true", help="also sweep each block's scale alone")
    args = ap.parse_args(argv)
    try:
        mults = tuple(float(v) for v in args.multipliers.split(","))
    except ValueError:
        raise SystemExit(f"sdp-bench diagnose: --multipliers={args.multipliers!r} is invalid: allowed: numbers, comma-separated")
    for run_dir in args.run_dirs:
        try:
            result = diagnose(run_dir, multipliers=mults, per_depth=args.per_depth)
        except ConfigError as exc:
            raise SystemExit(f"sdp-bench diagnose: {exc}")
        print("\n".join(markdown(result)), flush=True)
        print(f"wrote {RunDir(run_dir).root / DIAGNOSIS}", flush=True)
    return 0
