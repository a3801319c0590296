"""What SDP's ranks evaluate: the full model assembled from its holders, and each worker's own subnetwork.

Apart from :mod:`sdp.parallel.sdp` (set-up, the step, re-draws, checkpoints) because evaluation reads the
trained subnetworks and changes none of them: it builds the assembled model one part at a time
(:class:`~sdp.subnet.assemble.PartwiseAssembly`), scales it as ``parallelism.rescale`` or the calibration says
(:meth:`~sdp.parallel.sdp_calibrate.Calibrated.eval_factor`) and records the largest part built
(``eval_assembled_bytes``). The trainer applies the evaluation protocol (``eval.bn``) to what it yields, as to
every strategy's model.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from torch import nn

from sdp.models.base import SDPModel
from sdp.subnet.assemble import PartwiseAssembly, assemble, own_evaluated, set_branch_scales, tensor_map


class AssembledEval:
    """:class:`sdp.parallel.sdp.SDPStrategy`'s evaluation hooks (:meth:`~sdp.parallel.base.Strategy.eval_module`,
    :meth:`~sdp.parallel.base.Strategy.subnetwork_module`). Reads the strategy's skeleton, plan, pieces, layout,
    groups, masking mode and calibration; writes only ``eval_copy_bytes`` (the largest part, or whole model, built so
    far: the summary's ``eval_assembled_bytes``; 0 from the strategy's set-up)."""

    def _assemble(self) -> SDPModel:
        """The whole assembled model at once (a model that cannot be cut into parts; tests compare the parts with it)."""
        s: Any = self
        assert s.groups is not None
        return assemble(skeleton=s.skeleton, pieces=s.pieces, layout=s.layout, plan=s.plan,
                        masking=s.mode, groups=s.groups, ctx=s.ctx)

    @contextmanager
    def eval_module(self) -> Iterator[nn.Module | PartwiseAssembly]:
        """The assembled full model (BatchNorm statistics averaged over the workers that ran each
        layer), each unit scaled per ``parallelism.rescale`` (block level its branch, neuron level only
        what its split hidden units produce: :meth:`~sdp.models.base.ResidualBlock.set_scale`); the
        trainer applies the evaluation protocol (``eval.bn``) to it as to every strategy's model. It comes part by part
        (:class:`~sdp.subnet.assemble.PartwiseAssembly`: stem, each block, head, each built from its holders, run and
        dropped), so no rank ever holds the full model; one that cannot be cut (tied weights, a custom forward) is whole."""
        s: Any = self
        scale, gates = s.eval_factor()  # after calibration: no factor, its gates folded in (sdp_calibrate)
        assert s.groups is not None
        parts = PartwiseAssembly(skeleton=s.skeleton, pieces=s.pieces, layout=s.layout, plan=s.plan,
                                 masking=s.mode, groups=s.groups, ctx=s.ctx, scale=scale, gates=gates)
        if len(parts):  # no parts: the model cannot be cut (partwise_names)
            try:
                yield parts
            finally:
                self.eval_copy_bytes = max(self.eval_copy_bytes, parts.part_bytes)
            return
        with s.ctx.comm.phase_as("eval"):
            full = self._assemble()
            set_branch_scales(full, s.plan, scale=scale, gates=gates)
        self.eval_copy_bytes = max(self.eval_copy_bytes, sum(t.numel() * t.element_size() for t in tensor_map(full).values()))
        full.eval()
        try:
            yield full
        finally:
            del full

    @contextmanager
    def subnetwork_module(self) -> Iterator[nn.Module | None]:
        """Under forward masking, the subnetwork this worker trained, evaluated as trained (its own
        units, its ``rescale=train`` scales, no k/n): the model whose quality the assembly gap compares
        the assembled one with; under ``eval.bn=average`` with the statistics of its units in the assembled
        model (:func:`~sdp.subnet.assemble.own_evaluated`). Backward masking trains the full model on every worker: None."""
        s: Any = self
        if s.mode != "forward":
            yield None
            return
        assert s.module is not None and s.groups is not None
        with own_evaluated(module=s.module, pieces=s.pieces, layout=s.layout, masking=s.mode, groups=s.groups,
                           ctx=s.ctx, average=s.job.eval_bn == "average") as own:
            yield own
