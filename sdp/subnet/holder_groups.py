"""The process groups of SDP's holder sets: which rank sets get one, in what order, and their lifetime.

Why one process group per distinct holder set: a unit's gradient is averaged over its holders only
(paper 1.4), so its all-reduce runs on exactly those ranks (:mod:`sdp.subnet.sync`); each holder set
also has a refresh set (its lowest holder and every non-holder) for what its lowest holder broadcasts to
the ranks that lack its values: the updated values after each step under backward masking, the
assembled model's pieces under forward masking (:func:`sdp.subnet.assemble.fill`), so no other holder
receives values it holds (:func:`with_refresh_sets`). ``new_group`` is collective over the world, so every
rank creates every group, in one order derived from the plan alone (:func:`group_rank_sets`).

Why a module of its own: which groups exist is a fact of the plan, asked also where nothing is
synchronised: ``sdp-plan`` predicts summary.json's ``process_groups`` (:func:`predicted_process_groups`,
for DDP too: the default group only) and the peak rehearsal builds a :class:`GroupSet` that creates no
group; neither needs the gradient buckets of :mod:`sdp.subnet.sync`. Before a plan's groups are made the
ranks check that they derived the same plan (:func:`check_same_plan`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable

import torch
import torch.distributed as dist

from sdp.core.distctx import WHERE, DistContext, subgroup_kwargs


def with_refresh_sets(*, mode: str) -> bool:
    """Whether the groups of masking ``mode`` (:func:`sdp.subnet.masking.masking_mode`) include each holder set's
    refresh set: under ``backward`` masking the refresh after every update (:meth:`sdp.subnet.sync.OwnerSetSync.refresh`),
    under ``forward`` masking :func:`sdp.subnet.assemble.fill` (assembled evaluation, the consolidation switch,
    calibration's assembly); ``global`` refresh broadcasts nothing (every rank keeps and updates every value).
    Why at set-up with the holder sets' groups, not at the first assembly: creating a group is collective over the
    world in one order (:func:`group_rank_sets`), a re-draw then keeps or destroys them with the rest
    (:meth:`GroupSet.redraw`), and ``sdp-plan`` predicts summary.json's ``process_groups`` from this same rule."""
    assert mode in ("forward", "backward", "global"), f"masking mode {mode!r} not in (forward, backward, global)"
    return mode != "global"


def group_rank_sets(*, world_size: int, holder_sets: Iterable[tuple[int, ...]], refresh: bool) -> list[tuple[int, ...]]:
    """The rank sets that get their own process group, in the one creation order every rank follows:
    each holder set (and, with ``refresh``, its refresh set) of 2 .. n - 1 ranks; n ranks use the default
    group, one rank needs none."""
    out: list[tuple[int, ...]] = []
    n = world_size
    for h in sorted(set(holder_sets), key=lambda h: (len(h), h)):
        for ranks in (h, refresh_set(h, n=n)) if refresh and len(h) < n else (h,):
            if 1 < len(ranks) < n and ranks not in out:
                out.append(ranks)
    return out


class PlanMismatch(RuntimeError):
    """The ranks derived different plans (raised on every rank, naming those that differ from rank 0)."""


def check_same_plan(*, identity: Any, draw: int, ctx: DistContext) -> None:
    """Fail on every rank, naming the ranks whose plan differs from rank 0's, unless every rank derived the
    same plan (``identity``: what identifies it as plain JSON types, :func:`sdp.parallel.sdp_plan.plan_lists`).

    Why: every rank derives each plan itself (a re-draw; under Slurm tasks or torchrun the first one too),
    and the groups are created in an order read from it (:func:`group_rank_sets`), so a divergence (a float
    tie broken differently, a library that differs between nodes) would give mismatched communicators and
    transfers that wait for a peer that never sends: a hang until ``cluster.timeout_s``. One all-gather of a
    32-byte SHA-256 per rank settles it first; a check, not the strategy's traffic, so not counted as comm."""
    if ctx.world_size == 1:
        return
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).digest()
    mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(ctx.device)
    everyone = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(everyone, mine)
    hexes = [bytes(t.cpu().tolist()).hex()[:12] for t in everyone]
    differ = [r for r, h in enumerate(hexes) if h != hexes[0]]
    if differ:
        raise PlanMismatch(f"draw {draw} of the SDP plan: ranks {differ} derived a different plan from rank 0's (plan "
                           f"SHA-256 by rank: {', '.join(f'{r}: {h}' for r, h in enumerate(hexes))}); every rank derives "
                           "it from the config and the draw, so their hosts differ (a library version, a float tie); "
                           "stopped before its process groups were built, which would hang until cluster.timeout_s")


def refresh_set(h: tuple[int, ...], *, n: int) -> tuple[int, ...]:
    """The lowest holder (the source) and every non-holder."""
    return tuple(sorted({min(h)} | (set(range(n)) - set(h))))


def predicted_process_groups(*, world_size: int, holder_sets: Iterable[tuple[int, ...]], refresh: bool) -> dict[str, Any]:
    """What summary.json's ``process_groups`` will say, per rank, before any rank starts: the default group
    plus every group of :func:`group_rank_sets` the rank is a member of (sizes largest first)."""
    sets = group_rank_sets(world_size=world_size, holder_sets=holder_sets, refresh=refresh)
    per_rank = []
    for r in range(world_size):
        sizes = sorted([world_size] + [len(s) for s in sets if r in s], reverse=True)
        per_rank.append({"rank": r, "count": len(sizes), "sizes": sizes})
    return {"per_rank": per_rank, "distinct_groups": len(sets)}


class GroupSet:
    """Process groups for holder sets and (``refresh``: :func:`with_refresh_sets`) refresh sets, created in one global order.

    Every group gets the default group's timeout (``cluster.timeout_s``) and, on NCCL, options that make
    it share the default communicator's resources (:func:`sdp.core.distctx.subgroup_kwargs`); its description
    names its ranks (``holders(0, 1)``), which NCCL's watchdog prints. A re-draw (:meth:`redraw`)
    destroys the groups the new plan no longer uses, so a run holds the groups of one plan (plus, during
    the re-draw, the new ones), not of every plan it ever drew."""

    def __init__(self, *, world_size: int, holder_sets: Iterable[tuple[int, ...]], refresh: bool) -> None:
        self.n = world_size
        self.groups: dict[tuple[int, ...], Any] = {}
        self.add(holder_sets=holder_sets, refresh=refresh)

    def add(self, *, holder_sets: Iterable[tuple[int, ...]], refresh: bool) -> None:
        """Create the groups still missing (collective: every rank calls this with the same sets)."""
        for ranks in group_rank_sets(world_size=self.n, holder_sets=holder_sets, refresh=refresh):
            if ranks not in self.groups:
                self.groups[ranks] = dist.new_group(list(ranks), **subgroup_kwargs(), group_desc=f"holders{ranks}")

    def redraw(self, *, holder_sets: Iterable[tuple[int, ...]], refresh: bool) -> list[tuple[int, ...]]:
        """Make the groups of a re-drawn plan: create the missing ones, then destroy those it no longer
        uses, returning their rank sets. Collective, in one order on every rank (creation in
        :func:`group_rank_sets` order, destruction in the order the groups were made), since
        ``ncclCommAbort``/finalize has been collective in some NCCL versions (torch destroys groups in a
        fixed order for that reason). Call it with no collective in flight on the old groups (SDP
        re-draws before a step, after the previous step's waits)."""
        holder_sets = list(holder_sets)
        keep = group_rank_sets(world_size=self.n, holder_sets=holder_sets, refresh=refresh)
        self.add(holder_sets=holder_sets, refresh=refresh)
        gone = [ranks for ranks in self.groups if ranks not in keep]
        for ranks in gone:
            dist.destroy_process_group(self.groups.pop(ranks))  # a non-member's handle: torch returns at once
        return gone

    def refresh_set(self, h: tuple[int, ...]) -> tuple[int, ...]:
        return refresh_set(h, n=self.n)

    def get(self, ranks: tuple[int, ...]) -> Any:
        """The group of ``ranks`` for a collective about to be issued: None (the default group) for the
        whole world. Noted in :data:`sdp.core.distctx.WHERE`, so a failure names the groups of its step."""
        WHERE.used(ranks, world=self.n)
        if len(ranks) == self.n:
            return None
        assert ranks in self.groups, (f"no process group for ranks {ranks} (world {self.n}); made: {sorted(self.groups)} "
                                      "(a refresh set exists only where with_refresh_sets(mode) made it)")
        return self.groups[ranks]
