"""Do the holders of each SDP unit agree? Reads the ranks' checkpoints (``rank*.pt``, SDP's "local"
state: module state dict, optimizer state dict, plan) and compares, piece by piece, every parameter
present on several ranks and every optimizer-state entry of the ranks that train it.

Why piece by piece: at neuron level a rank's tensor is the concatenation of the groups it holds, so two
ranks' tensors of one name hold different groups; only the pieces (one group of one tensor) are
comparable. A checkpoint is interpreted by rebuilding the rank's masking on the meta device from the
run's config and the saved draw (what ``load_checkpoint_state`` rebuilds on resume), which gives the
state-dict key and offsets of every piece, and the optimizer's parameter order (the trainable tensors
in piece order, every parameter under global refresh: ``SDPStrategy._trainable``).

Command line (the count of issue 13): ``python -m tests.holders <run_dir>/checkpoints/step_N``.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from sdp.subnet import masking as M


def pieces_of(local: dict[str, Any], *, cfg: DictConfig, rank: int) -> dict[tuple, dict[str, Any]]:
    """(name, start) -> {"param": view, "state": ...} for every parameter piece this
    rank's checkpoint has, with ``"state"``: {state key: view or scalar} where this rank trains the piece,
    None where it only stores it (backward masking, a non-held piece)."""
    from sdp.parallel.sdp_plan import plan_for, plan_lists
    from sdp.registry import build

    p = cfg.parallelism
    mode = "forward" if p.masking == "forward" else ("backward" if p.refresh == "holders" else "global")
    with torch.device("meta"):
        full = build(cfg.model)
    saved = local["extra"]["plan"]
    plan = plan_for(model=full, cfg=p, world_size=int(saved["world_size"]), draw=int(saved["draw"]))
    assert plan_lists(plan) == saved, f"rank {rank}: draw {saved['draw']} rebuilds {plan_lists(plan)}, saved {saved}"
    pieces = M.pieces(full, plan)
    masked = copy.deepcopy(full)
    layout = M.apply(masked, plan, rank=rank, masking=mode, all_pieces=pieces)
    key_of = {id(t): k for k, t in masked.state_dict(keep_vars=True).items()}
    trainable = list(masked.parameters()) if mode == "global" else list(M.held_parameters(layout, pieces, rank))
    index = {id(t): i for i, t in enumerate(trainable)}
    model, optim = local["model"], local["optimizer"]
    assert optim["param_groups"][0]["params"] == list(range(len(trainable))), \
        f"rank {rank}: optimizer holds {optim['param_groups'][0]['params']}, the masking gives {len(trainable)} tensors"
    out: dict[tuple, dict[str, Any]] = {}
    for piece in pieces:
        spec = M.locate(piece, layout) if piece.is_param else None
        if spec is None:
            continue
        t, dim, start, length = spec
        entry: dict[str, Any] = {"param": M.view(model[key_of[id(t)]], dim, start, length), "state": None}
        if id(t) in index and (mode == "global" or rank in piece.holders):  # a rank that trains the piece
            entry["state"] = {}
            for key, value in optim["state"].get(index[id(t)], {}).items():
                shaped = isinstance(value, torch.Tensor) and value.shape == t.shape
                entry["state"][key] = M.view(value, dim, start, length) if shaped else value
        out[(piece.name, piece.start)] = entry
    return out


def compare(ranks: list[dict[tuple, dict[str, Any]]]) -> dict[str, Any]:
    """Over ``pieces_of`` of every rank: the number of pieces present on several ranks (``multi``) and
    trained by several (``trained_by_several``), and the keys of those whose parameter values differ
    (``params``), whose optimizer state differs between the ranks that have some (``state``), or which
    some rank trains without state while another has it (``missing_state``)."""
    out: dict[str, Any] = {"multi": 0, "trained_by_several": 0, "params": [], "state": [], "missing_state": []}
    for key in sorted({k for r in ranks for k in r}):
        have = [r[key] for r in ranks if key in r]
        if len(have) < 2:
            continue
        out["multi"] += 1
        if any(not torch.equal(have[0]["param"], h["param"]) for h in have[1:]):
            out["params"].append(key)
        states = [h["state"] for h in have if h["state"] is not None]  # the ranks that train the piece
        out["trained_by_several"] += len(states) > 1
        with_state = [s for s in states if s]
        if with_state and len(with_state) < len(states):
            out["missing_state"].append(key)
        ref = with_state[0] if with_state else {}
        if any(set(s) != set(ref) or any(not _same(s[k], ref[k]) for k in s) for s in with_state[1:]):
            out["state"].append(key)
    return out


def differing(ckpt: Path, *, cfg: DictConfig | None = None) -> dict[str, Any]:
    """``compare`` over the ranks' files of the checkpoint directory ``ckpt`` (config: the run's
    ``config.yaml`` unless given)."""
    cfg = cfg if cfg is not None else OmegaConf.load(ckpt.parent.parent / "config.yaml")
    files = sorted(ckpt.glob("rank*.pt"))
    return compare([pieces_of(torch.load(f, map_location="cpu", weights_only=True)["local"], cfg=cfg, rank=r)
                    for r, f in enumerate(files)])


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return type(a) is type(b) and a == b


if __name__ == "__main__":
    res = differing(Path(sys.argv[1]))
    print(f"{len(res['params'])} of {res['multi']} parameter pieces held by several ranks differ in value; "
          f"{len(res['state'])} differ in optimizer state; "
          f"{len(res['missing_state'])} lack state on some of their holders")
