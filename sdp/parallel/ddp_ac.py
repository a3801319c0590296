"""``parallelism=ddp_ac``: a preset, DDP with activation checkpointing on (label DDP+AC).

Activation checkpointing is a training option of every strategy (``train.ac``, :mod:`sdp.parallel.ac`); this
preset is plain DDP whose ``parallelism`` node declares ``ac_every``, which :func:`sdp.parallel.job.ac_every`
reads as ``train.ac=full`` with that stride. It stays registered so the comparison tables keep their DDP+AC
row and runs recorded with ``parallelism.name=ddp_ac`` still load and report as DDP+AC.
"""

from __future__ import annotations

from omegaconf import DictConfig

from sdp.driver.fields import conform
from sdp.driver.schema_parallel import DDPAC
from sdp.parallel.ddp import DDPSpec, DDPStrategy
from sdp.parallel.job import JobFacts
from sdp.parallel.spec import register


@register("ddp_ac")
class DDPActivationCheckpointSpec(DDPSpec):
    """DDP+AC in the driver: DDP's runtime and prediction; the checkpointing comes from the job (``JobFacts.ac_every``)."""

    label = "DDP+AC"
    runtime = DDPStrategy

    @classmethod
    def validate(cls, *, cfg: DictConfig, job: JobFacts) -> None:
        """Each key's own rule (``ac_every`` >= 1, DDP's keys) is its schema's:
        :class:`sdp.driver.schema_parallel.DDPAC`; no rule here involves several keys."""
        conform(cfg, schema=DDPAC, prefix="parallelism")
