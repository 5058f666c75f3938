"""patch_megatron(): megatron-core's pipeline communication swapped for this package's, wherever
megatron-core has bound it, and put back by unpatch_megatron() (or on leaving a `with`).

What is swapped, in every loaded `megatron.*` module that holds megatron-core's own object:
the class `P2PCommunicator`, the module-level functions of megatron-core <= 0.13 where the
installed version has them, `_communicate`, `_communicate_shapes`, `_p2p_ops` and
`_batched_p2p_ops`. Schedules that construct `P2PCommunicator(pp_group=..., config=...)`
therefore get this package's class; its communicator over the pipeline group is created the
first time (collectively: every stage enters the schedule) and reused afterwards."""
from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from . import p2p_communication as ours
from ._patching import Swap

if TYPE_CHECKING:
    import torch.distributed as dist

logger = logging.getLogger(__name__)

_TARGET = "megatron.core.pipeline_parallel.p2p_communication"
_PRELOAD = ("megatron.core.pipeline_parallel.schedules",)
_SWAPPABLE = ("P2PCommunicator", "_p2p_ops", "_batched_p2p_ops", "_communicate", "_communicate_shapes",
              *ours.LEGACY_FUNCTIONS)


class MegatronPatch:
    """The active swap: `swapped` lists (module name, attribute) pairs. A context manager whose
    exit calls unpatch_megatron()."""

    def __init__(self, originals: dict[str, Any], replacements: dict[str, Any]):
        self.originals = originals          # name -> megatron-core's object
        self.replacements = replacements    # name -> ours
        self._swap = Swap("megatron", [(obj, replacements[name]) for name, obj in originals.items()])

    @property
    def swapped(self) -> list[tuple[str, str]]:
        return self._swap.swapped

    def __enter__(self) -> MegatronPatch:
        return self

    def __exit__(self, *exc: Any) -> None:
        unpatch_megatron()


_active: MegatronPatch | None = None


def _configured_class(options: dict[str, Any]) -> type:
    """Our class, or a subclass whose keyword-only options default to `options`."""
    if not options:
        return ours.P2PCommunicator

    class P2PCommunicator(ours.P2PCommunicator):
        __doc__ = ours.P2PCommunicator.__doc__

        def __init__(self, pp_group: dist.ProcessGroup | None, config: Any, **kwargs: Any) -> None:
            super().__init__(pp_group, config, **{**options, **kwargs})

    P2PCommunicator.__module__ = ours.__name__
    return P2PCommunicator


def patch_megatron(
    *,
    backend: str | None = None,
    mode: str | None = None,
    timeout: float | None = None,
    lanes: int | None = None,
) -> MegatronPatch:
    """Swaps megatron-core's pipeline communication for megatron_p2p's (see the module doc).
    The options become the defaults of the P2PCommunicator that megatron-core constructs.
    Idempotent while patched; returns the active patch, usable as a context manager."""
    global _active
    if _active is not None:
        return _active
    target = importlib.import_module(_TARGET)
    for name in _PRELOAD:
        importlib.import_module(name)
    options = {k: v for k, v in dict(backend=backend, mode=mode, timeout=timeout, lanes=lanes).items()
               if v is not None}
    originals, replacements = {}, {}
    for name in _SWAPPABLE:
        original = getattr(target, name, None)
        if original is None:
            continue  # this megatron-core version does not have it
        originals[name] = original
        replacements[name] = _configured_class(options) if name == "P2PCommunicator" else getattr(ours, name)
    patch = MegatronPatch(originals, replacements)
    patch._swap.apply()
    logger.info("patch_megatron: swapped %d bindings in %d modules", len(patch.swapped),
                len({m for m, _ in patch.swapped}))
    _active = patch
    return patch


def unpatch_megatron() -> None:
    """Puts megatron-core's own objects back everywhere patch_megatron() swapped them (and in
    modules imported since). Idempotent."""
    global _active
    if _active is None:
        return
    _active._swap.restore()
    _active = None
    logger.info("unpatch_megatron: megatron-core's pipeline communication restored")


def is_patched() -> bool:
    """True between patch_megatron() and unpatch_megatron()."""
    return _active is not None
