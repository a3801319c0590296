"""Old name of the harness, kept only so that tests written against it before tests/helpers/ keep
working through a merge; new tests import :mod:`tests.helpers`. ``compose_cfg`` is ``compose``;
``spawn(fn, world=..., args=...)`` and ``run_job(overrides, world=..., run_dir=...)`` are the same calls."""

from tests.helpers import (  # noqa: F401 (re-exported)
    CapturingSGD,
    compose as compose_cfg,
    free_port,
    global_batch,
    rank_process_group,
    reference_grads,
    run_job,
    small_mlp,
    spawn,
    train_losses,
)
