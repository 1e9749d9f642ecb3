"""Guards on the Python attributes a traced forward read, as ``torch.compile`` guards them.

A trace bakes every plain Python value the forward reads into the graphs: a
``self.scale = 2.0`` set after the first step would otherwise be ignored for
good, and training would silently differ from eager and DDP. While
``fxshard.compile`` traces, each module of the model records the attributes
its code reads from its own ``__dict__`` whose values are constants (bool, int,
float, str, bytes, None, a torch dtype or device, an enum, and tuples and
lists of those). Before each call the values are compared with the current
ones; a step whose guards fail is traced again, and kept beside the first (at
most ``MAX_VARIANTS`` per input signature, Dynamo's ``recompile_limit``).

Module-level values are guarded too (``global_guards``): the globals that the
model's own code names (each module class's functions, and the plain Python
functions they name, three calls deep), where the value is a constant, and
the items of a global ``dict`` under the string keys that code spells out
(``SETTINGS["shift"]``). torch's and fxshard's own modules are not scanned.
The scan reads names from the code, so it guards a global that an untaken
branch names as well; a change of that one retraces needlessly, once.

What is not guarded, as in Dynamo's defaults where they differ:
- nn.Module's own bookkeeping (``_parameters``, hooks, ...) and ``training``,
  which is part of the input signature already;
- attributes of objects that are not modules, such as a Hugging Face
  ``config``: fxshard sees the read of ``self.config``, not of its fields.
  Dynamo guards those too; change them before ``fxshard.compile``;
- a global dict's item under a key the code computes (``SETTINGS[key]``);
- a class attribute read through an instance (``self.scale`` where ``scale`` is set on
  the class, not in ``__init__``): only the instance's own ``__dict__`` is recorded.
  Dynamo guards it; change it before ``fxshard.compile``, or set it on the instance.

Recording swaps each module's class for a subclass with a recording
``__getattribute__`` for the length of the trace only; nothing is recorded,
and nothing costs anything, while steps run.
"""

from __future__ import annotations

import contextlib
import enum
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.nn as nn

MAX_VARIANTS = 8  # traces kept per input signature (torch._dynamo.config.recompile_limit)

# What every nn.Module holds in its __dict__: bookkeeping, not values a forward computes with.
_BOOKKEEPING = frozenset(nn.Module().__dict__) | {"training"}
_MISSING = object()


def is_constant(value: Any) -> bool:
    """A value a trace bakes in as it is (Dynamo guards on these by value)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.dtype, torch.device,
                                            enum.Enum)):
        return True
    if type(value) in (tuple, list):
        return all(is_constant(v) for v in value)
    return False


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False  # True and 1 trace alike only by accident
    if type(a) in (tuple, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a is b or a == b)


def _frozen(value: Any) -> Any:
    """A copy that later in-place changes of a list do not reach."""
    if type(value) in (tuple, list):
        return type(value)(_frozen(v) for v in value)
    return value


@dataclass(frozen=True)
class Guard:
    module: nn.Module
    path: str  # the module's name in the model ("" for the root)
    name: str
    value: Any

    def current(self) -> Any:
        return self.module.__dict__.get(self.name, _MISSING)

    def holds(self) -> bool:
        return _same(self.current(), self.value)

    def __str__(self) -> str:
        where = f"{self.path}.{self.name}" if self.path else self.name
        return f"{type(self.module).__name__} attribute {where!r}"


@dataclass(frozen=True)
class GlobalGuard:
    """A module-level value the model's code names: ``name`` in ``namespace`` (a module's
    globals), or with ``key``, that global dict's item."""

    namespace: dict[str, Any]
    module_name: str
    name: str
    key: str | None
    value: Any

    def current(self) -> Any:
        value = self.namespace.get(self.name, _MISSING)
        if self.key is None:
            return value
        return value.get(self.key, _MISSING) if type(value) is dict else _MISSING

    def holds(self) -> bool:
        return _same(self.current(), self.value)

    def __str__(self) -> str:
        item = f"[{self.key!r}]" if self.key is not None else ""
        return f"global {self.module_name}.{self.name}{item}"


class AnyGuard(Protocol):
    def holds(self) -> bool: ...


@dataclass(frozen=True)
class Guards:
    """The constant attributes and globals one trace read, with the values it baked in."""

    guards: tuple[AnyGuard, ...] = ()

    def hold(self) -> bool:
        return all(g.holds() for g in self.guards)

    def failed(self) -> list[AnyGuard]:
        return [g for g in self.guards if not g.holds()]


class Recorder:
    """The constant attributes read while it was active (``recording``)."""

    def __init__(self) -> None:
        self.reads: dict[tuple[int, str], tuple[nn.Module, str, Any]] = {}

    def record(self, module: nn.Module, name: str, value: Any) -> None:
        key = (id(module), name)
        if key not in self.reads:  # the value the trace read first is the one it baked in
            self.reads[key] = (module, name, _frozen(value))


_ACTIVE: list[Recorder] = []
_RECORDING_CLASSES: dict[type, type] = {}


def _recording_class(cls: type) -> type:
    found = _RECORDING_CLASSES.get(cls)
    if found is not None:
        return found

    # The class's own lookup (an unbound function on the class: mypy types it as bound).
    lookup = cast(Callable[[Any, str], Any], cls.__getattribute__)

    def __getattribute__(self: Any, name: str) -> Any:
        value = lookup(self, name)
        if _ACTIVE and name not in _BOOKKEEPING:
            own = object.__getattribute__(self, "__dict__")
            if own.get(name, _MISSING) is value and is_constant(value):
                _ACTIVE[-1].record(self, name, value)
        return value

    sub = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__,
                                     "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    _RECORDING_CLASSES[cls] = sub
    return sub


@contextlib.contextmanager
def recording(root: nn.Module, recorder: Recorder) -> Iterator[Recorder]:
    """Record into ``recorder`` the constant attributes that ``root``'s modules read from their
    own ``__dict__`` inside the block."""
    swapped: list[tuple[nn.Module, type]] = []
    try:
        for module in root.modules():
            cls = type(module)
            try:
                module.__class__ = _recording_class(cls)
            except TypeError:  # a layout __class__ assignment refuses: left unguarded
                continue
            swapped.append((module, cls))
        _ACTIVE.append(recorder)
        yield recorder
    finally:
        if _ACTIVE and _ACTIVE[-1] is recorder:
            _ACTIVE.pop()
        for module, cls in swapped:
            module.__class__ = cls


def _library(module_name: str) -> bool:
    return module_name.split(".")[0] in ("torch", "fxshard", "builtins", "typing")


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    """``code`` and the code of the lambdas, comprehensions and functions nested in it."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def global_guards(root: nn.Module, depth: int = 3) -> list[GlobalGuard]:
    """Guards on the module-level constants, and constant items of global dicts, that the
    code of ``root``'s module classes names (see the module docstring)."""
    found: dict[tuple[int, str, str | None], GlobalGuard] = {}
    seen: set[int] = set()

    def scan(fn: Any, level: int) -> None:
        code, namespace = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
        if not isinstance(code, types.CodeType) or type(namespace) is not dict or id(code) in seen:
            return
        module_name = str(namespace.get("__name__", "?"))
        if _library(module_name):
            return
        seen.add(id(code))
        codes = list(_codes(code))
        keys = {c for co in codes for c in co.co_consts if isinstance(c, str)}
        for name in dict.fromkeys(n for co in codes for n in co.co_names):
            if name not in namespace:
                continue
            value = namespace[name]
            if is_constant(value):
                found.setdefault((id(namespace), name, None),
                                 GlobalGuard(namespace, module_name, name, None, _frozen(value)))
            elif type(value) is dict:
                for key in keys:
                    item = value.get(key, _MISSING)
                    if item is not _MISSING and is_constant(item):
                        found.setdefault((id(namespace), name, key),
                                         GlobalGuard(namespace, module_name, name, key, _frozen(item)))
            elif isinstance(value, types.FunctionType) and level < depth:
                scan(value, level + 1)

    for cls in dict.fromkeys(type(m) for m in root.modules()):
        for klass in cls.__mro__:
            if _library(klass.__module__):
                continue
            for attr in vars(klass).values():
                fn = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
                if isinstance(fn, types.FunctionType):
                    scan(fn, 0)
    return list(found.values())


def guards_of(root: nn.Module, recorder: Recorder) -> Guards:
    paths = {id(m): name for name, m in root.named_modules(remove_duplicate=False)}
    attributes: list[AnyGuard] = [Guard(m, paths.get(id(m), "?"), name, value)
                                  for m, name, value in recorder.reads.values()]
    return Guards((*attributes, *global_guards(root)))
