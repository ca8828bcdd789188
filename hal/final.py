"""Final methods: which public methods of a base class a subclass may not redefine (`hal.Vendor`'s ops)."""

from __future__ import annotations


def final_methods(*bases: type) -> frozenset[str]:
    """The public callables defined on `bases` themselves (not inherited from elsewhere)."""
    return frozenset(
        name for base in bases for name, value in vars(base).items() if callable(value) and not name.startswith("_")
    )


def redefined_methods(cls: type, owner: type, bases: tuple[type, ...]) -> list[str]:
    """The final methods of `bases` that `cls`, a subclass of `owner`, or a class between the two redefines."""
    final = final_methods(*bases)
    between = [c for c in cls.__mro__ if c is not owner and isinstance(c, type) and issubclass(c, owner)]
    return sorted({name for c in between for name in vars(c) if name in final})
