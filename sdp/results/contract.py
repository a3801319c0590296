"""The results contract: what every run writes into its run directory (Hydra's job output directory).

- ``config.yaml``: the resolved config, secrets removed (:func:`write_config`);
- ``metrics.jsonl``: one JSON row per logged step from rank 0 (``step``, ``loss``, ``lr``,
  ``samples_per_s``; eval rows with ``eval_loss``, ``eval_accuracy`` and the other measured fields of
  :class:`sdp.results.evalresult.EvalResult`, e.g. ``eval_loss_by_group`` where the dataset declares groups)
  (:func:`read_metrics`);
- ``summary.json``: strategy, world size, steps, final losses, per-rank memory and communication,
  time, versions and machine info, and per rank how it was launched (host, pid, SLURM_*/torchrun
  variables): the typed :class:`sdp.results.summary.Summary`, every field documented there.

Every path of a run directory is named by :class:`sdp.results.rundir.RunDir`. Reports read these files only
(W&B is a mirror), so these three modules are the one place their names and shape are defined.
Extend them, never break them.
"""

from __future__ import annotations

import gzip
import json
import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

import sdp
from sdp.results.rundir import RunDir

SECRET_KEYS = ("api_key", "apikey", "password", "token", "secret")
# Config keys that say how a run was run, not what it computes (a resumed job records train.resume as
# its checkpoint path, a killed-and-restarted one drops train.debug, a rerun sweep adds skip_done; W&B is a
# mirror of the files, and a sweep recorded under logger.wandb.mode=offline, before null meant WANDB_MODE, is the same job):
# sdp.driver.sweep ignores them when it compares configs, and the report does not split tables by them.
RUN_CONTROL_KEYS = ("train.resume", "train.skip_done", "train.extend_steps", "train.debug", "logger.progress",
                    "train.checkpoint_timeout_s", "logger.wandb")


def is_secret(key: str) -> bool:
    k = key.lower()
    return any(k == s or k.startswith(s + "_") or k.endswith("_" + s) for s in SECRET_KEYS)


def scrub(obj: Any) -> Any:
    """Drop values whose key names a secret (W&B API keys must never reach a results file).

    A key is secret when it is, starts with or ends with a secret word as a whole ``_``-separated
    part (``token``, ``hf_token``, ``api_key_file``), not when it merely contains one: the data
    budget ``val_tokens`` must survive in config.yaml.
    """
    if isinstance(obj, dict):
        return {k: ("<redacted>" if is_secret(str(k)) else scrub(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [scrub(v) for v in obj]
    return obj


def write_config(*, cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Write the resolved, scrubbed config as ``config.yaml``; returns it as a plain dict."""
    container = scrub(OmegaConf.to_container(cfg, resolve=True))
    run_dir.mkdir(parents=True, exist_ok=True)
    RunDir(run_dir).config.write_text(OmegaConf.to_yaml(OmegaConf.create(container)))
    return container


def git_commit() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except Exception:  # noqa: BLE001
        return None


# Run data, not code: a study rewriting its REPORT.md or replacing committed runs between its stages must
# not mark the next stage's runs as made by other code.
DATA_PATHS = ("benchmarks/results", "outputs", "multirun")


def git_dirty(*, root: Path | None = None) -> bool | None:
    """Whether tracked files other than run data (``DATA_PATHS``) differ from the commit (a run "at commit X"
    then ran other code); ``root``: a directory of the checkout (default: this package's)."""
    try:
        here = root or Path(__file__).resolve().parent
        spec = [":(top)", *(f":(top,exclude){d}" for d in DATA_PATHS)]
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *spec], cwd=here,
                             capture_output=True, text=True, timeout=5)
        return bool(out.stdout.strip()) if out.returncode == 0 else None
    except Exception:  # noqa: BLE001
        return None


def versions() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "sdp": sdp.__version__,
        "git_commit": git_commit(),
        "git_dirty": git_dirty(),
        "cuda": torch.version.cuda,
    }


def provenance() -> dict[str, Any]:
    """``versions`` and ``machine`` under those keys: what every benchmark's result file records (taken when
    its runs start, so that the commit is the one they ran at)."""
    return {"versions": versions(), "machine": machine()}


def cpu_model() -> str | None:
    """The CPU's model name (Linux: /proc/cpuinfo), or None where it cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "processor": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        # CPU kernels differ by model (AVX-512 vs AVX2 paths round differently): bit-for-bit re-runs hold
        # on the same model only, so the run says which
        "cpu_model": cpu_model(),
    }
    try:
        import psutil

        info["memory_total_bytes"] = int(psutil.virtual_memory().total)
    except Exception:  # noqa: BLE001
        pass
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def write_json(path: Path, obj: Any) -> None:
    """Write atomically (tmp + rename), so a reader never sees half a summary."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metrics rows, from ``metrics.jsonl`` or, in a committed run ``sdp-bench slim-runs`` compressed,
    ``metrics.jsonl.gz`` (every reader comes here, so both forms read alike); [] when neither exists. Both at
    once is refused: which rows are the run's would be a guess."""
    paths = RunDir(run_dir)
    plain, packed = paths.metrics, paths.metrics_gz
    if plain.exists() and packed.exists():
        raise ValueError(f"{paths.root} holds both {plain.name} and {packed.name}; allowed: one of them "
                         f"(sdp-bench slim-runs {paths.root} keeps the rows of {plain.name} only)")
    if packed.exists():
        text = gzip.decompress(packed.read_bytes()).decode()
    elif plain.exists():
        text = plain.read_text()
    else:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]
