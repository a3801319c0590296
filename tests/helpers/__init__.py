"""The test harness, one package (import from ``tests.helpers``):

- jobs (:mod:`tests.helpers.jobs`): ``run_job`` runs one job in this process through ``sdp.driver.train.run``
  (validation and preflight, budget, resume, config.yaml, the elastic launcher), ``run_train`` runs
  ``python -m sdp.driver.train`` (the whole Hydra app: multirun, callbacks, exit codes); ``compose`` and
  ``config_dict`` give the config sdp-train composes; ``TrainProcess``, ``sdp_env``, ``survivors``, ``train_losses``.
- ranks (:mod:`tests.helpers.ranks`): ``spawn`` runs a function on spawned gloo ranks (free port,
  timeouts) and returns each rank's value; ``make_strategy`` and ``batch`` build a rank's strategy and
  data as the worker does.
- grads (:mod:`tests.helpers.grads`): single-process gradient references.
- marks (:mod:`tests.helpers.marks`): ``CORE`` / ``core_cases`` (the default multi-rank tier) and ``run_if``.
"""

from tests.helpers.grads import CapturingSGD, global_batch, reference_grads, small_mlp
from tests.helpers.jobs import REPO, TrainProcess, compose, config_dict, run_job, run_train, sdp_env, survivors, train_losses
from tests.helpers.marks import CORE, core_cases, run_if
from tests.helpers.ranks import batch, free_port, make_strategy, rank_process_group, spawn

__all__ = ["CORE", "REPO", "CapturingSGD", "TrainProcess", "batch", "compose", "config_dict", "core_cases", "free_port",
           "global_batch", "make_strategy", "rank_process_group", "reference_grads", "run_if", "run_job", "run_train",
           "sdp_env", "small_mlp", "spawn", "survivors", "train_losses"]
