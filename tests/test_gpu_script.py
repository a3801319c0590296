"""The prepared GPU check (benchmarks/gpu/h200_check.sh) runs as written from a fresh checkout.

Default tier (cheap): the script parses, installs either with the README's command or, with ``WHEELS``, from
that folder alone (no index, no dependencies resolved), bounds every run with ``timeout -k``; the package
imports without W&B and submitit, and every third-party package it imports is either on the GPU image or in
``wheels.txt``; the row writer appends each run's row (or the run's error) as it ends, re-opening the table
after a verdict, and the verdicts read the runs, the plans and the groups check. Slow tier: the whole script
in its CPU dry run (``DRY_RUN=1``: the same commands at tiny sizes on gloo) from a copy of the files git would
check out, every run finishing and no check failing, once with the wheels of ``wheels.sh`` on an interpreter
that hides what the GPU image lacks; its results fit what the device tool returns (at most 8 files, 2 folders).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

SCRIPT = REPO / "benchmarks" / "gpu" / "h200_check.sh"
sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
import rows  # noqa: E402


# What the lent GPU's image lacks of what the check imports (docs/gpu.md); wheels.txt must bring each of them.
NOT_ON_GPU_IMAGE = {"hydra", "omegaconf", "antlr4", "wandb", "submitit", "hydra_plugins"}
# What that image has (/work/.library/device/KINDS.md's package list, the part the check can import).
ON_GPU_IMAGE = {"torch", "torchgen", "cython_runtime", "torchvision", "numpy", "scipy", "sklearn", "matplotlib", "psutil", "tqdm", "yaml",
                "packaging", "typing_extensions", "filelock", "jinja2", "fsspec", "networkx", "sympy", "mpmath",
                "markupsafe", "triton", "PIL", "cloudpickle", "joblib", "threadpoolctl", "dateutil", "six", "pyparsing",
                "kiwisolver", "cycler", "fontTools", "contourpy", "setuptools", "pkg_resources", "_distutils_hack",
                "nvidia", "cuda", "certifi", "urllib3", "idna", "charset_normalizer", "requests", "google"}
HIDE = """import importlib.machinery, os, sys, sysconfig
SITE = os.path.realpath(sysconfig.get_paths()["purelib"])
class Hide:  # the GPU image: these are not installed there (a WHEELS folder may bring them)
    def find_spec(self, name, path=None, target=None):
        if "." in name or name not in %r:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, [p for p in sys.path if os.path.realpath(p) != SITE])
        if spec is None:
            raise ModuleNotFoundError(f"No module named {name!r} (not on the GPU image)", name=name)
        return spec
sys.meta_path.insert(0, Hide())
"""


def test_script_parses_installs_from_the_repo_or_a_wheel_folder_and_bounds_every_run() -> None:
    text = SCRIPT.read_text()
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    subprocess.run(["bash", "-n", str(SCRIPT.parent / "wheels.sh")], check=True)
    assert re.search(r"pip install (-q )?-e \.", text), "install with the README's command: pip install -e ."
    wheel_installs = [ln for ln in text.splitlines() if "$WHEELS\"/*.whl" in ln and "pip install" in ln]
    assert len(wheel_installs) == 1, f"one install from the wheel folder, got {wheel_installs}"
    assert all(f in wheel_installs[0] for f in ("--no-index", "--no-deps", "--target")), wheel_installs[0]
    lines = text.splitlines()
    editable = next(i for i, ln in enumerate(lines) if "pip install -q -e ." in ln)
    assert "WHEELS" in lines[editable - 1] and "exit 2" in lines[editable - 1], \
        f"with WHEELS set, a failed import must stop before the -e install (it needs an index): {lines[editable - 1]!r}"
    launches = [ln for ln in text.splitlines() if re.search(r"-m sdp\.(driver\.train|planning\.planner)|rows\.py", ln) and not ln.lstrip().startswith("#")]
    assert launches, "no sdp.driver.train launch found"
    unbounded = [ln for ln in launches if "timeout -k" not in ln]
    assert not unbounded, f"launches without timeout -k (SIGTERM alone leaves the elastic grace period): {unbounded}"
    assert "DRY_RUN" in text and "TOTAL_S" in text


def _imported_top_level(code: str, *, hide: set[str] = frozenset()) -> set[str]:
    """Top-level modules a fresh interpreter has imported after ``code`` (with ``hide`` made unimportable)."""
    prog = (HIDE % sorted(hide) if hide else "") + code + "\nimport sys; print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", prog], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"import failed with {sorted(hide)} hidden:\n{out.stderr[-2000:]}"
    return set(out.stdout.split())


CHECK_IMPORTS = "import sdp.driver.train, sdp.rank.worker, sdp.planning.planner, sdp.report.build"


def test_the_check_imports_neither_wandb_nor_submitit() -> None:
    """W&B is imported only where a run logs to it and submitit only where it launches on Slurm: the GPU image
    has neither, and the check's runs use logger.wandb.mode=disabled on the local launcher."""
    mods = _imported_top_level(CHECK_IMPORTS, hide={"wandb", "submitit"})
    assert not mods & {"wandb", "submitit"}, sorted(mods & {"wandb", "submitit"})


def test_wheels_txt_brings_every_package_the_gpu_image_lacks() -> None:
    import sys as _sys
    from importlib.metadata import packages_distributions

    mods = _imported_top_level(CHECK_IMPORTS) - set(_sys.stdlib_module_names) - {"sdp", "tests", "__main__"}
    mods = {m for m in mods if not m.startswith("_") or m in ON_GPU_IMAGE}
    missing = sorted(mods - ON_GPU_IMAGE - NOT_ON_GPU_IMAGE)
    assert not missing, f"the check imports {missing}: add each to ON_GPU_IMAGE (the image has it) or to wheels.txt"
    dists = packages_distributions()
    wanted = {d.lower().replace("_", "-") for m in mods & NOT_ON_GPU_IMAGE for d in dists.get(m, [m])}
    listed = {ln.split("==")[0].strip().lower() for ln in (SCRIPT.parent / "wheels.txt").read_text().splitlines()
              if ln.strip() and not ln.startswith("#")}
    assert wanted <= listed, f"wheels.txt lacks {sorted(wanted - listed)} (imported, not on the GPU image)"


def _summary(*, state: int, setup: int) -> dict:
    per_rank = [{"rank": r, "param_bytes": state // 4, "grad_bytes": state // 4, "optim_bytes": state // 2,
                 "activation_bytes": 10, "setup_peak_bytes": setup, "cuda_max_allocated_bytes": 100,
                 "cuda_max_reserved_bytes": 200, "cuda_device_used_bytes": 300} for r in range(2)]
    return {"world_size": 2, "memory": {"per_rank": per_rank}, "time": {"tokens_per_s": 1000.0},
            "final": {"eval_loss": 1.5}, "backends": {"device_type": "cuda", "tf32_matmul": True}}


def _write_run(runs: Path, name: str, summary: dict | None, log: str = "") -> None:
    (runs / name).mkdir(parents=True)
    (runs / name / "config.yaml").write_text("cluster:\n  device: cuda\n  backend: gloo\n")
    if summary is not None:
        (runs / name / "summary.json").write_text(json.dumps(summary))
    (runs / f"{name}.log").write_text(log)


def test_rows_are_appended_as_runs_end_and_verdicts_read_them(tmp_path: Path) -> None:
    results, runs = tmp_path / "results.md", tmp_path / "runs"
    runs.mkdir()
    common = ["--results", str(results), "--runs", str(runs)]
    rows.main([*common, "header", "--title", "t0", "--line", "device: test"])
    _write_run(runs, "ddp", _summary(state=1000 * 2**20, setup=600 * 2**20))
    rows.main([*common, "row", "--name", "ddp", "--rc", "0", "--secs", "5"])
    first = results.read_text()
    assert first.count("| ddp | 0 | 5 | 2 | gloo |") == 1, first
    _write_run(runs, "fsdp", _summary(state=500 * 2**20, setup=100 * 2**20))
    rows.main([*common, "row", "--name", "fsdp", "--rc", "0", "--secs", "6"])
    rows.main([*common, "verdict", "fsdp_setup", "ddp", "fsdp"])
    rows.main([*common, "verdict", "device_figures", "ddp", "fsdp"])
    _write_run(runs, "hung", None, log="step 3\nRuntimeError: something broke | here\n")
    rows.main([*common, "row", "--name", "hung", "--rc", "137", "--secs", "110"])
    text = results.read_text()
    assert text.startswith(first), "a later row rewrote earlier output instead of appending"
    assert "**fsdp_setup: PASS**" in text and "**device_figures: PASS**" in text, text
    tables = text.count("| run | rc |")
    assert tables == 2, f"the table is re-opened after the verdicts: {tables} headers\n{text}"
    assert "| hung | 137 | 110 |" in text and "RuntimeError: something broke / here" in text, text


def test_verdicts_on_plans_step_times_and_the_groups_check(tmp_path: Path) -> None:
    results, runs = tmp_path / "results.md", tmp_path / "runs"
    runs.mkdir()
    common = ["--results", str(results), "--runs", str(runs)]
    for name, measured in (("ddp", 105), ("sdp", 150)):
        s = _summary(state=1000, setup=100)
        for m in s["memory"]["per_rank"]:
            m.update(setup_peak_bytes=100 * 2**20, train_peak_bytes=measured * 2**20, eval_peak_bytes=50 * 2**20)
        _write_run(runs, name, s)
        predicted = {"memory": {"per_rank": [{"rank": r, "param_bytes": 1, "grad_bytes": 1, "optim_bytes": 1,
                                              "setup_peak_bytes": 100 * 2**20, "train_peak_bytes": 100 * 2**20,
                                              "eval_peak_bytes": 50 * 2**20} for r in range(2)]}}
        (runs / f"{name}.plan.json").write_text(json.dumps(predicted))
    rows.main([*common, "verdict", "peaks", "ddp"])
    rows.main([*common, "verdict", "peaks", "ddp", "sdp"])
    lines = [ln for ln in results.read_text().splitlines() if ln.startswith("- **peaks")]
    assert lines[0].startswith("- **peaks: PASS**") and "train 105/100 MiB = 1.05x" in lines[0], lines
    assert lines[1].startswith("- **peaks: FAIL**") and "sdp: setup 100/100 MiB = 1.00x, train 150/100 MiB = 1.50x" in lines[1], lines
    for name, step, mfu in (("full", 0.2, 0.41), ("half", 0.12, None)):
        s = _summary(state=1000, setup=100)
        s["time"].update(step_s_median=step, mfu=mfu, mfu_dtype="bf16")
        _write_run(runs, name, s)
    rows.main([*common, "verdict", "mfu", "full", "half"])
    assert "**mfu: n/a**" in results.read_text() and "step time half / full = 0.600x" in results.read_text()
    (runs / "nccl_groups.json").write_text(json.dumps({"backend": "nccl", "device": "cuda:0", "torch": "2.11",
        "steps": [{"step": "new_group (split)", "ok": True}, {"step": "destroy it", "ok": False, "error": "E: boom"},
                  {"step": "split_group", "ok": None, "note": "not available"}]}))
    rows.main([*common, "groups"])
    rows.main([*common, "caveats"])
    text = results.read_text()
    assert "**groups: FAIL**" in text and "destroy it: E: boom" in text and "split_group not available" in text, text
    assert "mean nothing on a shared GPU" in text and "mem_get_info counts every process" in text, text


def test_the_ac_verdict_compares_the_measured_saving_with_the_planned_one(tmp_path: Path) -> None:
    """DDP+AC's training peak over DDP's, measured, against the plans' ratio: PASS within 10 %, FAIL outside it,
    n/a without a plan (not a pass)."""
    results, runs = tmp_path / "results.md", tmp_path / "runs"
    runs.mkdir()
    common = ["--results", str(results), "--runs", str(runs)]

    def write(name: str, *, measured: int, predicted: int | None) -> None:
        s = _summary(state=1000, setup=100)
        for m in s["memory"]["per_rank"]:
            m.update(cuda_max_allocated_bytes=measured * 2**20, train_peak_bytes=measured * 2**20)
        _write_run(runs, name, s)
        if predicted is not None:
            per_rank = [{"rank": r, "train_peak_bytes": predicted * 2**20} for r in range(2)]
            (runs / f"{name}.plan.json").write_text(json.dumps({"memory": {"per_rank": per_rank}}))

    write("ddp", measured=200, predicted=210)
    write("near", measured=120, predicted=120)  # 0.600x measured, 0.571x planned: 5 % apart
    write("far", measured=160, predicted=120)  # 0.800x against 0.571x
    write("unplanned", measured=120, predicted=None)
    for name in ("near", "far", "unplanned"):
        rows.main([*common, "verdict", "ac", "ddp", name])
    lines = [ln for ln in results.read_text().splitlines() if ln.startswith("- **ac")]
    assert lines[0].startswith("- **ac: PASS**") and "= 0.600x, predicted 120/210 MiB = 0.571x" in lines[0], lines
    assert lines[1].startswith("- **ac: FAIL**") and "= 0.800x" in lines[1], lines
    assert lines[2].startswith("- **ac: n/a**"), lines


def _checkout(tmp_path: Path) -> Path:
    """The files git would check out (tracked and untracked-not-ignored), copied: what the device tool sends."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    clone = tmp_path / "clone"
    for f in filter(None, files):
        src = REPO / f
        if src.is_file():
            (clone / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, clone / f)
    return clone


def _dry_run(tmp_path: Path, *, clone: Path, env: dict[str, str]) -> str:
    out = tmp_path / "results"
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script puts the checkout first itself
    env = {**base, "DRY_RUN": "1", "RESULTS_DIR": str(out), "PYTHON": sys.executable, **env}
    proc = subprocess.run(["bash", "benchmarks/gpu/h200_check.sh"], cwd=clone, env=env, capture_output=True, text=True,
                          timeout=840)
    text = (out / "h200_check.md").read_text() if (out / "h200_check.md").exists() else ""
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{text}"
    run_rows = [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| run |")]
    assert len(run_rows) == 9 and all(ln.split("|")[2].strip() == "0" for ln in run_rows), text
    assert "Plan floor" in text and "**groups: PASS**" in text and text.count("**") >= 2 * 7, text
    got = [p.relative_to(out) for p in out.rglob("*") if p.is_file()]
    assert len(got) <= 8 and all(len(p.parts) <= 3 for p in got), f"the device tool returns 8 files, 2 folders deep: {got}"
    return text


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_dry_run_from_a_fresh_checkout(tmp_path: Path) -> None:
    text = _dry_run(tmp_path, clone=_checkout(tmp_path), env={})
    fails = [ln for ln in text.splitlines() if "FAIL" in ln and not ln.startswith("- **peaks")]
    assert not fails, fails  # peaks: the planner's CPU accuracy at these tiny sizes is reported, not required


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_dry_run_without_a_package_index_from_the_wheels_of_wheels_sh(tmp_path: Path) -> None:
    """The lent GPU's situation: no hydra, omegaconf, antlr4, W&B or submitit on the interpreter, no index; the
    wheels of wheels.sh (made here, where an index answers) are all the check gets."""
    wheels = tmp_path / "wheels"
    made = subprocess.run(["bash", str(SCRIPT.parent / "wheels.sh"), str(wheels), f"{sys.version_info.major}.{sys.version_info.minor}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHON": sys.executable})
    if made.returncode != 0:
        pytest.skip(f"wheels.sh could not reach a package index here: {made.stderr.strip().splitlines()[-1:]}")
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE % sorted(NOT_ON_GPU_IMAGE))
    text = _dry_run(tmp_path, clone=_checkout(tmp_path), env={"WHEELS": str(wheels), "PYTHONPATH": str(hide),
                                                               "PIP_NO_INDEX": "1"})
    fails = [ln for ln in text.splitlines() if "FAIL" in ln and not ln.startswith("- **peaks")]
    assert not fails, fails
