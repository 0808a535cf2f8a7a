"""A griffe extension for the API reference: constructors declared only in a stub.

A stub declares `KVCache.__new__` (and other methods) as `@overload`s with no
implementation, so griffe records the overloads but no member to render them under. This
adds that member: the last overload's signature, the others attached as its overloads.

The compiled classes are built by `__new__` (PyO3), but mkdocstrings merges only an
`__init__` into its class's heading (`merge_init_into_class`), so a class with a `__new__`
and no `__init__` also gets an `__init__` with the same parameters (`self` for `cls`) and
overloads: the reference shows each class's constructor signatures under its name, and
hides the dunders themselves.
"""

from __future__ import annotations

from typing import Any

import griffe


def _as_init(function: griffe.Function, parent: griffe.Class) -> griffe.Function:
    params = list(function.parameters)
    if params and params[0].name == "cls":
        params[0] = griffe.Parameter("self", kind=params[0].kind)
    init = griffe.Function(
        "__init__",
        lineno=function.lineno,
        endlineno=function.endlineno,
        parameters=griffe.Parameters(*params),
        returns=None,
        decorators=[],
        docstring=function.docstring,
        parent=parent,
    )
    init.labels = set(function.labels)
    return init


class StubOverloads(griffe.Extension):
    def on_class_members(self, *, cls: griffe.Class, **kwargs: Any) -> None:
        for name, overloads in cls.overloads.items():
            if name in cls.members or not overloads:
                continue
            last = overloads[-1]
            member = griffe.Function(
                name,
                lineno=last.lineno,
                endlineno=last.endlineno,
                parameters=last.parameters,
                returns=last.returns,
                decorators=[],
                parent=cls,
            )
            member.overloads = list(overloads[:-1])
            cls.set_member(name, member)
        new = cls.members.get("__new__")
        if isinstance(new, griffe.Function) and "__init__" not in cls.members:
            init = _as_init(new, cls)
            if new.overloads:
                init.overloads = [_as_init(o, cls) for o in new.overloads]
            cls.set_member("__init__", init)
