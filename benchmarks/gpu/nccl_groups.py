"""The communicator life cycle an SDP re-draw puts NCCL through, on one rank: split, use, destroy, split again.

Why a smoke test of its own: SDP makes one process group per holder set with ``new_group`` (on NCCL bound to its
device, a ``ncclCommSplit`` of the default communicator sharing its resources, ``sdp.core.distctx.comm_options``)
and a re-draw destroys the groups the new plan no longer uses and makes new ones
(``sdp.subnet.holder_groups.GroupSet.redraw``). At world size 1 SDP itself makes no sub-group (every unit is
held by the one rank), so a one-GPU run of SDP never exercises that path; this script does, with the job's own
initialisation (:func:`sdp.core.distctx.init_world`) and group options (:func:`sdp.core.distctx.subgroup_kwargs`).
What it cannot show: a split into groups of several ranks (NCCL refuses two ranks on one GPU).

Writes one JSON object: each step's name, whether it passed, its seconds, and the error where it failed.
``--device cpu --backend gloo`` runs the same steps on CPU (the check's dry run).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from sdp.core.distctx import init_world, subgroup_kwargs


def _reduce_is_identity(*, group: Any, device: torch.device) -> None:
    """One all-reduce on ``group``: at world size 1 the sum is the value itself."""
    x = torch.arange(4, dtype=torch.float32, device=device)
    dist.all_reduce(x, group=group)
    assert torch.equal(x.cpu(), torch.arange(4, dtype=torch.float32)), f"all_reduce on one rank changed {x.tolist()}"


def steps(*, device: torch.device) -> list[tuple[str, Callable[[dict[str, Any]], None]]]:
    """The life cycle, in order; each step reads and writes the shared ``state`` (the groups alive)."""
    def split(state: dict[str, Any]) -> None:
        state["group"] = dist.new_group([0], **subgroup_kwargs(), group_desc="holders(0,)")

    def use(state: dict[str, Any]) -> None:
        _reduce_is_identity(group=state["group"], device=device)

    def destroy(state: dict[str, Any]) -> None:
        dist.destroy_process_group(state.pop("group"))

    def split_group(state: dict[str, Any]) -> None:  # torch's one-call split of disjoint groups, where it exists
        if not hasattr(dist, "split_group") or dist.get_backend() != "nccl":
            state["split_group"] = "not available on this backend"
            return
        g = dist.split_group(split_ranks=[[0]], timeout=subgroup_kwargs()["timeout"], group_desc="split(0,)")
        _reduce_is_identity(group=g, device=device)
        dist.destroy_process_group(g)

    return [("new_group (split)", split),
            ("all_reduce on it", use), ("destroy it", destroy), ("new_group again (re-draw)", split),
            ("all_reduce on the new one", use), ("destroy it again", destroy), ("split_group", split_group),
            ("all_reduce on the default group", lambda s: _reduce_is_identity(group=None, device=device))]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], required=True)
    ap.add_argument("--backend", choices=["nccl", "gloo"], required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--timeout-s", type=float, default=60.0)
    a = ap.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.update(RANK="0", WORLD_SIZE="1")
    device = torch.device("cuda:0" if a.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    out: dict[str, Any] = {"backend": a.backend, "device": str(device), "torch": torch.__version__, "steps": []}
    if a.backend == "nccl":
        out["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
    state: dict[str, Any] = {}
    try:
        init_world(backend=a.backend, timeout=timedelta(seconds=a.timeout_s), device_id=device if a.backend == "nccl" else None)
        for name, step in steps(device=device):
            t0 = time.perf_counter()
            try:
                step(state)
                row: dict[str, Any] = {"step": name, "ok": True}
            except Exception as e:  # noqa: BLE001 - a failing step is the finding; later steps still report
                row = {"step": name, "ok": False, "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
            row["s"] = round(time.perf_counter() - t0, 4)
            if isinstance(state.get("split_group"), str):
                row.update(ok=None, note=state.pop("split_group"))
            out["steps"].append(row)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - initialisation itself failed: say so in the file
        out["error"] = traceback.format_exc().strip().splitlines()[-1][:300]
    a.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
