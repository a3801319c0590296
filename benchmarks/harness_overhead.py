"""What the suite's harness costs: its DDP step time against a minimal hand-written torch DDP loop on
the same model, batch, data order and optimizer (issue 18, part 5; target ratio <= 1.05).

The suite run is a real ``sdp-train`` job (``parallelism=ddp``: phase timer, comm hook counting every
bucket, the per-step loss/NaN all-reduce, logging, peak-memory and activation meters). The minimal
loop spawns the same number of gloo ranks, builds the model with the suite's own ``build_model``
(same class, same seed, same init), takes every step's batch from the suite's ``GlobalBatchSampler``
(same samples per rank and step), wraps it in plain ``DistributedDataParallel`` with the suite's
bucket settings and runs forward, backward, SGD step, timing each step with ``perf_counter`` only.
Both report the max over ranks of each rank's median step time over the steps after warm-up; the
minimal loop also uses one thread per rank as the suite does on this machine (cores / ranks).
The ordering (suite, minimal, suite, minimal, ...) alternates ``--repeats`` times.

    flock /tmp/sdp-cpu.lock env PYTHONPATH=$PWD python benchmarks/harness_overhead.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import ROOT, run_one  # noqa: E402

COMMON = ["model=resnet18_cifar", "model.width=32", "dataset=synthetic", "dataset.image_size=32", "train.batch_size=32",
          "cluster.world_size=2", "train.steps=16", "train.warmup_steps=4", "train.eval_every=0",
          "logger.wandb.mode=disabled", "logger.progress=false", "optim=sgd"]


def _minimal_rank(rank: int, world: int, port: int, config: dict, out: str) -> None:
    from omegaconf import OmegaConf
    from torch.nn.functional import cross_entropy
    from torch.nn.parallel import DistributedDataParallel

    from sdp.data.base import GlobalBatchSampler
    from sdp.worker import build, build_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = OmegaConf.create(config)
    data = build(cfg.dataset)
    model = build_model(cfg, data)
    ddp = DistributedDataParallel(model, broadcast_buffers=False, bucket_cap_mb=25, gradient_as_bucket_view=True)
    oc = cfg.optim.optimizer
    opt = torch.optim.SGD(ddp.parameters(), lr=float(oc.lr), momentum=float(oc.get("momentum", 0.0)),
                          nesterov=bool(oc.get("nesterov", False)), weight_decay=float(oc.get("weight_decay", 0.0)))
    sampler = GlobalBatchSampler(num_samples=len(data.train), global_batch=int(cfg.train.batch_size) * world, seed=int(cfg.seed))
    x_all, y_all = data.train.tensors
    times = []
    for step in range(int(cfg.train.steps)):
        t0 = time.perf_counter()
        idx = sampler.shard(step, replica=rank, replicas=world)
        x, y = x_all[idx], y_all[idx]
        loss = cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - t0)
    median = statistics.median(times[int(cfg.train.warmup_steps):])
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, median)
    if rank == 0:
        Path(out).write_text(json.dumps({"step_s_median": max(gathered), "per_rank": gathered, "last_loss": float(loss.detach())}))
    dist.destroy_process_group()


def minimal(config: dict, *, world: int, out: Path) -> dict[str, Any]:
    from tests.dist_helpers import free_port

    mp.spawn(_minimal_rank, args=(world, free_port(), config, str(out)), nprocs=world, join=True)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--common", nargs="*", default=COMMON)
    ap.add_argument("--extra", nargs="*", default=[])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / "harness")
    args = ap.parse_args(argv)
    common = [*args.common, *args.extra]
    sys.path.insert(0, str(ROOT))
    from omegaconf import OmegaConf

    from tests.hydra_cfg import compose_config

    cfg = compose_config(*common, "parallelism=ddp")
    config = OmegaConf.to_container(cfg, resolve=True)
    world = int(cfg.cluster.world_size)
    args.out.mkdir(parents=True, exist_ok=True)
    suite, mini = [], []
    for i in range(args.repeats):
        s = run_one(label=f"suite{i}", spec="ddp", common=common, out=args.out)
        suite.append(s.time["step_s_median"])
        mini.append(minimal(config, world=world, out=args.out / f"minimal{i}.json")["step_s_median"])
        print(f"repeat {i}: suite {suite[-1]:.4f} s, minimal {mini[-1]:.4f} s", flush=True)
    result = {"suite_step_s": statistics.median(suite), "minimal_step_s": statistics.median(mini),
              "runs": {"suite": suite, "minimal": mini}, "loadavg": os.getloadavg(), "common": common}
    result["ratio"] = result["suite_step_s"] / result["minimal_step_s"]
    (args.out / "harness.json").write_text(json.dumps(result, indent=2))
    print(f"suite DDP step {result['suite_step_s']:.4f} s vs minimal DDP loop {result['minimal_step_s']:.4f} s: "
          f"ratio {result['ratio']:.3f} (target <= 1.05); loadavg {result['loadavg']}")
    return result


if __name__ == "__main__":
    main()
