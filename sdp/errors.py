"""Config errors and the check helpers every module uses to refuse a value (key, value, what is allowed).

Imports nothing from ``sdp``, so any module can raise a :class:`ConfigError` without importing the
validation pass (:mod:`sdp.driver.config`), which imports most of the package: it is the bottom layer of the
``layers`` contract (``pyproject.toml``), beside :mod:`sdp.registry`.
"""

from __future__ import annotations

from typing import Any, Iterable


class ConfigError(ValueError):
    """A config value that cannot work; the message names key, value and what is allowed."""


def fail(key: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"{key}={value!r} is invalid: {allowed}")


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        fail(key, value, allowed)


def one_of(key: str, value: Any, allowed: Iterable[Any]) -> None:
    allowed = tuple(allowed)
    require(value in allowed, key, value, f"allowed: {', '.join(map(str, allowed))}")


def positive_int(key: str, value: Any, *, minimum: int = 1) -> None:
    require(isinstance(value, int) and not isinstance(value, bool) and value >= minimum, key, value,
            f"must be an integer >= {minimum}")


def positive_float(key: str, value: Any, *, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (value >= 0 if allow_zero else value > 0)
    require(ok, key, value, f"must be a number {'>=' if allow_zero else '>'} 0")


def boolean(key: str, value: Any) -> None:
    require(isinstance(value, bool), key, value, "must be true or false")


def unit_interval(key: str, value: Any) -> None:
    """A fraction of the model (SDP's coverage C, a survival probability p): a number in (0, 1]."""
    require(isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1, key, value,
            "must be a number in (0, 1]")
