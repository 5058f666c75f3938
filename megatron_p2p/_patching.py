"""The mechanism of patch_megatron() and patch_pipelining(): objects swapped, by identity, in every
loaded module of one package, and put back.

    swap = Swap("torch.distributed.pipelining", [(torch.distributed, proxy)])
    swap.apply()      # every module attribute holding an original now holds its replacement
    swap.swapped      # [(module name, attribute)], in the order they were swapped
    swap.restore()    # put back, in reverse order, and in the package's modules imported since

apply() is all-or-nothing (an error midway restores what it had swapped, then propagates) and
refuses a second apply() before restore(); restore() is idempotent. Whether a second
patch_*() call is an error or returns the active patch is the caller's choice."""
from __future__ import annotations

import sys
from collections.abc import Iterable
from types import ModuleType
from typing import Any


def package_modules(package: str) -> list[tuple[str, ModuleType]]:
    """(name, module) of every loaded module that is `package` or inside it."""
    prefix = package + "."
    return [(n, m) for n, m in list(sys.modules.items())
            if (n == package or n.startswith(prefix)) and isinstance(m, ModuleType)]


class Swap:
    """originals -> replacements, wherever a module of `package` binds an original. A module
    attribute is swapped only while it holds the original itself (identity, not equality)."""

    def __init__(self, package: str, pairs: Iterable[tuple[Any, Any]]):
        self.package = package
        self.pairs = list(pairs)  # (original, replacement)
        self._done: list[tuple[ModuleType, str, str, Any, Any]] = []  # (module, its name, attribute, original, ours)
        self._applied = False

    @property
    def applied(self) -> bool:
        """True between apply() and restore()."""
        return self._applied

    @property
    def swapped(self) -> list[tuple[str, str]]:
        """(module name, attribute) of each binding apply() swapped, in order; empty once restored."""
        return [(name, attr) for _, name, attr, _, _ in self._done]

    def apply(self) -> None:
        """Swaps every binding of an original in the package's loaded modules for its
        replacement. RuntimeError if already applied; on any error midway, what was swapped is
        restored before it propagates."""
        if self._applied:
            raise RuntimeError(f"the patch of {self.package} is already applied; restore it first")
        by_id = {id(original): (original, ours) for original, ours in self.pairs}
        try:
            for mod_name, mod in package_modules(self.package):
                for attr, value in list(vars(mod).items()):
                    pair = by_id.get(id(value))
                    if pair is not None:
                        setattr(mod, attr, pair[1])
                        self._done.append((mod, mod_name, attr, pair[0], pair[1]))
        except BaseException:
            self._put_back()
            raise
        self._applied = True

    def restore(self) -> None:
        """Puts the originals back: the bindings apply() swapped, in reverse order (each only if
        it still holds the replacement), then any binding of a replacement in the package's
        modules, which covers modules imported while applied. Idempotent."""
        if self._applied:
            self._put_back()
            self._applied = False

    def _put_back(self) -> None:
        for mod, _, attr, original, ours in reversed(self._done):
            if vars(mod).get(attr) is ours:
                setattr(mod, attr, original)
        self._done.clear()
        # Modules imported while applied bound the replacements too: restore them wherever they are.
        back = {id(ours): original for original, ours in self.pairs}
        for _, mod in package_modules(self.package):
            for attr, value in list(vars(mod).items()):
                if id(value) in back:
                    setattr(mod, attr, back[id(value)])
