"""Multi-node on one machine (issue 19, part 3): two torchrun agents (``--nnodes=2 --nproc-per-node=2``)
on 127.0.0.1 form one 4-rank job, the launch ``slurm/torchrun.sbatch`` makes on two nodes.

The static rendezvous (``--master-addr/--master-port --node-rank``) is used because torchrun honours
``--node-rank`` only there (pytorch/pytorch#182223, #182374): node 0 then holds ranks 0-1 and node 1
ranks 2-3, every time. The result must equal a 4-rank single-node run with the same seed, bit for bit:
SDP's holder groups are built from global ranks, whichever node they are on.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, free_port, run_train, sdp_env

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]

JOB = ["experiment=smoke", "cluster.world_size=4", "train.batch_size=16", "train.steps=6", "train.eval_every=3",
       "logger.wandb.mode=disabled", "logger.progress=false"]


def agents(run_dir: Path, *overrides: str, nnodes: int = 2) -> list[subprocess.CompletedProcess]:
    """``nnodes`` torchrun agents of 2 ranks each, started together, static rendezvous on 127.0.0.1."""
    port = free_port()
    procs = []
    for node in range(nnodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc-per-node=2",
               "--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={port}", f"--node-rank={node}",
               "-m", "sdp.driver.train", f"hydra.run.dir={run_dir}", *JOB, *overrides]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=sdp_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    done = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def curve(run_dir: Path) -> list[tuple]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [(r["step"], r.get("loss"), r.get("lr"), r.get("eval_loss"), r.get("eval_accuracy")) for r in rows]


def digests(summary: dict) -> list[str]:
    return [m["param_digest"] for m in summary["memory"]["per_rank"]]


@pytest.mark.parametrize("strategy", ["ddp", "sdp"])  # slow tier (~40 s each; CI time): the wrong-world case below stays in the default tier
def test_two_torchrun_agents_equal_one_node(tmp_path: Path, strategy: str) -> None:
    one = run_train(tmp_path / "one", *JOB, f"parallelism={strategy}")
    two_dir = tmp_path / "two"
    node0, node1 = agents(two_dir, f"parallelism={strategy}", "cluster.nodes=2")
    for i, p in enumerate((node0, node1)):
        assert p.returncode == 0, f"agent {i}:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    assert "world: 4 ranks on 2 node(s)" in node0.stdout, node0.stdout[-3000:]
    for rank, node in ((0, 0), (1, 0), (2, 1), (3, 1)):
        assert f"  node {node} host " in node0.stdout and f"local_rank {rank % 2} rank {rank} device cpu" in node0.stdout
    two = json.loads((two_dir / "summary.json").read_text())
    assert [(n["node"], n["ranks"]) for n in two["nodes"]] == [(0, [0, 1]), (1, [2, 3])], two["nodes"]
    assert [(n["node"], n["ranks"]) for n in one.summary["nodes"]] == [(0, [0, 1, 2, 3])]
    assert curve(two_dir) == curve(one.run_dir), "two nodes must train exactly as one node with the same seed"
    assert digests(two) == digests(one.summary), "every rank ends with the same parameters"
    if strategy == "sdp":
        assert two["strategy_info"] == one.summary["strategy_info"], "the same subnetworks, whichever node holds them"


@pytest.mark.slow  # ~11 s: slow tier (CI time)
def test_a_node_in_a_world_of_its_own_fails_naming_the_variables(tmp_path: Path) -> None:
    """The silent-fallback case: an agent that forms a world of its own (``--nnodes=1``, as with a
    MASTER_ADDR that fell back to localhost) stops at once, saying what it saw."""
    (alone,) = agents(tmp_path / "run", "parallelism=ddp", nnodes=1)
    assert alone.returncode != 0
    out = alone.stdout + alone.stderr
    assert "cluster.world_size=4 is invalid: the external launcher started a world of WORLD_SIZE=2" in out, out[-3000:]
    assert "GROUP_RANK=0" in out and "MASTER_ADDR=127.0.0.1" in out and "LOCAL_WORLD_SIZE=2" in out, out[-3000:]


def test_fewer_nodes_than_configured_fail_naming_the_layout(tmp_path: Path) -> None:
    """Four ranks on one node where ``cluster.nodes=2`` was asked for: refused on every rank at start."""
    job = run_train(tmp_path / "run", *JOB, "parallelism=ddp", "cluster.nodes=2", check=False)
    assert job.proc.returncode != 0
    assert "the world is not the configured one (1 node(s) [0] where cluster.nodes=2)" in job.output, job.output[-3000:]
    assert "rank 3: RANK=3 WORLD_SIZE=4" in job.output
