"""A tiny name -> factory registry, shared by strategies (and anything else looked up by name), and
:func:`build`, which instantiates a config node (a model, a dataset, an optimizer) by its ``_target_``.

Why a registry rather than ``if name == ...`` ladders: the trainer must never name a strategy, and
a new strategy must be one new module, nothing else edited.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Generic, TypeVar

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to objects; errors name the key, the value and the allowed names."""

    def __init__(self, *, kind: str, key: str) -> None:
        self.kind = kind
        self.key = key
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            assert name not in self._items, f"{self.kind} {name!r} registered twice"
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        if name not in self._items:
            raise KeyError(
                f"{self.key}={name!r} is not a known {self.kind}; allowed: {', '.join(sorted(self._items))}"
            )
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items


META_KEYS = ("name",)


def build(node: DictConfig, **overrides: Any) -> Any:
    """Instantiate a config node's ``_target_``, leaving out documentation-only keys (``name``)."""
    resolved = OmegaConf.to_container(node, resolve=True)
    assert isinstance(resolved, dict), f"expected a config mapping with _target_, got {resolved!r}"
    kwargs = {k: v for k, v in resolved.items() if k not in META_KEYS}
    return instantiate(kwargs, **overrides, _convert_="all")


def import_plugins(cfg: Any) -> None:
    """Import the modules of the job config's ``plugins`` key: a strategy defined outside ``sdp``
    registers itself (``@register``) on import, so the driver and every rank import it before looking a
    name up. Absent from configs written before the key (``sdp-rerun`` of an old run): nothing to import."""
    modules = [str(m) for m in (cfg.get("plugins") or ())]
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ImportError(f"plugins={modules!r}: {name!r} cannot be imported ({exc}); is its directory on "
                              "PYTHONPATH?") from exc
