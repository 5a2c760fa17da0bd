"""A count of the changes to an object that others keep a view of.

The pipeline keeps a device's snapshot, and the feature hub its features, while what they were built from
has not changed; each such object counts every call of a method that changes what they read
(``changes``), and a kept view is stale once the count moved.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar


class Counted(Protocol):
    changes: int


_S = TypeVar("_S", bound=Counted)
_P = ParamSpec("_P")
_R = TypeVar("_R")


def counted(method: Callable[Concatenate[_S, _P], _R]) -> Callable[Concatenate[_S, _P], _R]:
    """A method that changes what a kept view of its object reads: counted (``self.changes``)."""
    def changing(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        self.changes += 1
        return method(self, *args, **kwargs)
    functools.update_wrapper(changing, method)  # its name, docstring and __wrapped__
    return changing
