"""A griffe extension for the API reference: constructors declared only as overloads.

A stub declares `KVCache.__new__` (and other methods) as `@overload`s with no
implementation, so griffe records the overloads but no member to render them under. This
adds that member: the last overload's signature, the others attached as its overloads, so
mkdocstrings shows the constructor's signatures.
"""

from __future__ import annotations

from typing import Any

import griffe


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
