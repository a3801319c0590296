"""``train.precision``: bf16 runs for every strategy on CPU (autocast), its 20-step loss curve stays
within a stated tolerance of the same strategy's fp32 curve, and SDP at coverage 1 in bf16 equals DDP
in bf16. One spawn of 2 gloo ranks trains every (strategy, precision) pair in turn (each ~1 s on a
ResNet-18 of width 8 on digits, BatchNorm included, which FSDP2's bf16 policy must handle).

Tolerances (stated):
- step 1 (same weights, same batch: the forward's rounding only): |bf16 - fp32| <= 1 % of the fp32 loss;
- mean loss of steps 11-20: within 15 % of the fp32 run's mean;
- every step of 20: |bf16 - fp32| <= 0.75 (no blow-up), and bf16 != fp32 somewhere (autocast really ran).
Why the later checks are loose: after the first update the two runs follow different trajectories
(a 32-sample global batch on digits, SGD with momentum, random block drops for the drop baselines),
and the gap measures that sensitivity, not bf16's per-op error (2^-9). Measured (lr 0.01, printed
with ``-s``): step-1 gaps <= 0.006, late-window mean gaps 0.3-9.4 % (DDP's is the largest), worst
single-step gap 0.41, 0.53 since the per-module initialisation (stochastic depth, whose loss jumps by
0.5 from step to step in fp32 alone),
while the fp32 loss of DDP falls 2.60 -> 0.65; a bf16 run that does not train fails the window check.
SDP at C = 1 in bf16 must equal DDP in bf16 exactly (2 ranks: a sum of two is exact in any order and
/2 is exact, so bucket layouts cannot matter; the forward is the same module under the same autocast)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from sdp.data.base import GlobalBatchSampler
from sdp.metrics.timing import PhaseTimer
from sdp.core.loss import loss_fn
from tests.helpers import config_dict, make_strategy, spawn

COMMON = ["model=resnet18_cifar", "model.width=8", "dataset=digits", "cluster.world_size=2", "train.batch_size=16",
          "optim=sgd", "optim.optimizer.lr=0.01"]
STEPS = 20
STRATEGIES = {
    "ddp": ["parallelism=ddp"],
    "ddp_ac": ["parallelism=ddp_ac"],
    "ddp_stochastic_depth": ["parallelism=ddp_stochastic_depth"],
    "ddp_layerdrop": ["parallelism=ddp_layerdrop"],
    "fsdp": ["parallelism=fsdp"],
    "pipeline": ["parallelism=pipeline"],
    "sdp": ["parallelism=sdp"],
    "sdp_block_bwd": ["parallelism=sdp_block_bwd"],
    "sdp_neuron_fwd": ["parallelism=sdp_neuron_fwd"],
    "sdp_neuron_bwd": ["parallelism=sdp_neuron_bwd"],
    "sdp_c1": ["parallelism=sdp", "parallelism.coverage=1.0"],
}
# WINDOW_REL: bf16's rounding compounds over the window's steps differently on different CPUs (bf16 kernels
# with and without native bf16 instructions); the bound catches a broken bf16 path (a loss that does not
# fall, or diverges), not a CPU's rounding, so it leaves room for both CPU kinds these tests run on
FIRST_REL, WINDOW_REL, STEP_ABS = 0.01, 0.20, 0.75


def _curves(rank: int, world: int, configs: dict) -> dict:
    cpu = torch.device("cpu")
    out = {}
    for key, config in configs.items():
        strategy, data, cfg = make_strategy(config, rank, world)
        replica, replicas = strategy.data_parallel()
        sampler = GlobalBatchSampler(num_samples=len(data.train), global_batch=int(cfg.train.batch_size) * world,
                                     seed=int(cfg.seed))
        x_all, y_all = data.train.tensors
        losses = []
        for step in range(STEPS):
            idx = sampler.shard(step, replica=replica, replicas=replicas)
            res = strategy.train_step(inputs=x_all[idx], targets=y_all[idx], loss_fn=loss_fn,
                                      timer=PhaseTimer(device=cpu), step=step)
            assert res.loss_sum.dtype == torch.float32, f"{key}: loss in {res.loss_sum.dtype}, expected float32"
            t = torch.stack([res.loss_sum.detach().reshape(()), torch.tensor(float(res.count))])
            dist.all_reduce(t)
            losses.append(float(t[0] / t[1]))
        dtypes = {str(p.dtype) for p in strategy.optimizer.param_groups[0]["params"]}
        out[key] = {"losses": losses, "param_dtypes": dtypes, "precision": strategy.precision}
    return out


@pytest.mark.dist
@pytest.mark.slow  # ~35 s, 22 runs: slow tier (CI time)
@pytest.mark.timeout(600)
def test_bf16_tracks_fp32_for_every_strategy_and_sdp_c1_equals_ddp() -> None:
    configs = {(name, prec): config_dict(COMMON + over + [f"train.precision={prec}"])
               for name, over in STRATEGIES.items() for prec in ("fp32", "bf16")}
    got = spawn(_curves, world=2, args=(configs,), timeout_s=540)[0]
    for key, val in got.items():
        print(key, [round(x, 4) for x in val["losses"]])
    worst = {}
    for name in STRATEGIES:
        fp32, bf16 = got[(name, "fp32")], got[(name, "bf16")]
        assert bf16["precision"] == "bf16" and fp32["precision"] == "fp32"
        assert bf16["param_dtypes"] == {"torch.float32"}, f"{name}: master weights {bf16['param_dtypes']}, expected fp32"
        first_bf16, first_fp32 = bf16["losses"][0], fp32["losses"][0]
        assert abs(first_bf16 - first_fp32) <= FIRST_REL * first_fp32, f"{name} step 1: bf16 {first_bf16} vs fp32 {first_fp32}"
        diffs = [abs(a - b) for a, b in zip(bf16["losses"], fp32["losses"])]
        worst[name] = max(diffs)
        assert worst[name] <= STEP_ABS, f"{name}: a bf16 step is {worst[name]:.3f} off fp32 (> {STEP_ABS}): {diffs}"
        late_bf16, late_fp32 = (sum(r["losses"][10:]) / 10 for r in (bf16, fp32))
        assert abs(late_bf16 - late_fp32) <= WINDOW_REL * late_fp32, (
            f"{name}: mean loss of steps 11-20 bf16 {late_bf16:.4f} vs fp32 {late_fp32:.4f} (> {WINDOW_REL:.0%})")
        assert worst[name] > 0, f"{name}: bf16 losses equal fp32 bit for bit: autocast did not run"
    print("\nmax |bf16 - fp32| loss over 20 steps:", {k: round(v, 5) for k, v in worst.items()})
    sdp, ddp = got[("sdp_c1", "bf16")]["losses"], got[("ddp", "bf16")]["losses"]
    assert sdp == ddp, f"SDP at C=1 in bf16 differs from DDP in bf16: {list(zip(sdp, ddp))}"
