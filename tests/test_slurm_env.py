"""Fast tier for the Slurm integration (no Slurm needed): config composition of cluster=slurm /
slurm_gpu, the rank environment a Slurm task exports, and the preemption signal routing."""

from __future__ import annotations

import signal

import pytest
from omegaconf import OmegaConf

from sdp.errors import ConfigError
from sdp.driver.slurm import install_preemption_handlers, master_port, slurm_environment
from tests.hydra_cfg import compose_config

RANK_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def compose_cfg(*overrides: str):
    return compose_config(*overrides, hydra=True)


@pytest.mark.parametrize("name,nodes,tasks,world,gpus", [("slurm", 1, 2, 2, None), ("slurm_gpu", 2, 8, 16, 8)])
def test_cluster_configs_select_the_submitit_launcher_and_derive_the_world(name, nodes, tasks, world, gpus):
    cfg = compose_cfg(f"cluster={name}", f"cluster.nodes={nodes}")
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher"), launcher._target_
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (nodes, tasks, gpus)
    assert cfg.cluster.world_size == world
    assert cfg.cluster.backend == "auto" and cfg.cluster.device == ("cuda" if gpus else "cpu")
    # Only keys hydra-submitit-launcher 1.2.0 defines (an unknown key would fail instantiation on submit),
    # plus srun_args (sdp.driver.slurm.SlurmLauncherConf), which submitit's Slurm executor takes.
    from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf

    assert set(OmegaConf.to_container(launcher)) <= set(OmegaConf.structured(SlurmQueueConf)) | {"_target_", "srun_args"}


@pytest.fixture
def slurm_task(monkeypatch):
    """Rank 3 of a 2-node x 2-task job step (no rank variables set yet)."""
    for k in RANK_VARS:  # set-then-delete registers them, so what slurm_environment exports is undone after
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    for k, v in dict(SLURM_JOB_ID="1234", SLURM_STEP_ID="0", SLURM_NTASKS="4", SLURM_PROCID="3",
                     SLURM_LOCALID="1", SLURM_NODEID="1", SLURM_JOB_NUM_NODES="2",
                     SLURM_JOB_NODELIST="gpu[07-08]").items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGUSR2)}  # restored after the test
    yield
    for sig, h in saved.items():
        signal.signal(sig, h)


def test_a_slurm_task_exports_its_rank_environment(slurm_task):
    import os

    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    slurm_environment(cluster=OmegaConf.create({"name": "slurm", "world_size": 4}))
    got = {k: os.environ[k] for k in RANK_VARS}
    assert got == {"MASTER_ADDR": "gpu07", "MASTER_PORT": str(master_port(job_id=1234)), "RANK": "3",
                   "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert master_port(job_id=1234) != master_port(job_id=1235)
    # Outside submitit, USR1/USR2 requeue through sdp's own handler.
    assert all(signal.getsignal(s).__name__ == "requeue_and_exit" for s in (signal.SIGUSR1, signal.SIGUSR2))


def test_a_wrong_world_size_or_a_non_slurm_process_is_a_clear_error(slurm_task, monkeypatch):
    with pytest.raises(ConfigError, match="cluster.world_size=2 .*SLURM_NTASKS"):
        slurm_environment(cluster=OmegaConf.create({"name": "slurm", "world_size": 2}))
    monkeypatch.delenv("SLURM_STEP_ID")
    with pytest.raises(ConfigError, match="--multirun"):
        slurm_environment(cluster=OmegaConf.create({"name": "slurm", "world_size": 4}))


def test_other_clusters_are_left_alone(slurm_task):
    import os

    slurm_environment(cluster=OmegaConf.create({"name": "local", "world_size": 2}))
    assert "RANK" not in os.environ


def test_an_existing_python_handler_is_kept(slurm_task):
    def mine(signum, frame):  # e.g. submitit's handler on its preemption signal
        pass

    signal.signal(signal.SIGUSR2, mine)
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    install_preemption_handlers()
    assert signal.getsignal(signal.SIGUSR2) is mine
    assert signal.getsignal(signal.SIGUSR1).__name__ == "requeue_and_exit"
