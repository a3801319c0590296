"""``parallelism=ddp_ac``: a preset, DDP with activation checkpointing on (label DDP+AC).

Activation checkpointing is a training option of every strategy (``train.ac``, :mod:`sdp.parallel.ac`); this
preset is plain DDP whose ``parallelism`` node declares ``ac_every``, which :func:`sdp.parallel.job.ac_every`
reads as ``train.ac=full`` with that stride. It stays registered so the comparison tables keep their DDP+AC
row and runs recorded with ``parallelism.name=ddp_ac`` still load and report as DDP+AC.
"""

from __future__ import annotations

from dataclasses import dataclass

from sdp.core.fields import key
from sdp.parallel.ddp import DDPConfig, DDPSpec, DDPStrategy
from sdp.parallel.spec import register


@dataclass
class DDPACConfig(DDPConfig):
    """``parallelism=ddp_ac``: a preset, DDP (its keys, :class:`~sdp.parallel.ddp.DDPConfig`) with ``train.ac=full`` at
    its own ``ac_every`` (sdp.parallel.job.ac_every)."""

    ac_every: int = key(at_least=1)
    """Checkpoint blocks 0, k, 2k, ... (1: every block); read as train.ac_every."""


@register("ddp_ac")
class DDPActivationCheckpointSpec(DDPSpec):
    """DDP+AC in the driver: DDP's runtime and prediction; the checkpointing comes from the job (``JobFacts.ac_every``)."""

    label = "DDP+AC"
    runtime = DDPStrategy
    schema = DDPACConfig  # every key's rule is its own (``ac_every`` >= 1, DDP's keys): no validate of several keys
