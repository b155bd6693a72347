"""Asking an object whether it has a capability, cheaply enough for every round.

``isinstance(obj, P)`` against a runtime-checkable ``Protocol`` rebuilds P's member list
on every call (about 8 µs on CPython 3.11), and the engine asks several per row and
round. :func:`provides` asks the object's class instead: ``issubclass`` against a
protocol, which ABC answers from its per-class cache (about 0.2 µs). The answer is the
same for every object whose capabilities are its class's methods, which is how this
project's runtimes, drafters and policies are written. A protocol with data members
cannot be asked this way: ``issubclass`` raises ``TypeError``, so a misuse is loud.
"""

from __future__ import annotations

from typing import TypeGuard, TypeVar

P = TypeVar("P")


def provides(obj: object, protocol: type[P]) -> TypeGuard[P]:
    """Whether ``obj``'s class implements ``protocol`` (a runtime-checkable protocol whose
    members are all methods)."""
    return issubclass(type(obj), protocol)
