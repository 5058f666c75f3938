"""megatron_p2p.verify.torch_schedules, at the path it had before the tools moved into megatron_p2p.verify:
the same module object, so old imports (and `python -m megatron_p2p.torch_schedules`) keep working."""
import sys
from typing import TYPE_CHECKING

from .verify import torch_schedules as _moved

if TYPE_CHECKING:  # what this module is, once it has replaced itself below
    from .verify.torch_schedules import *  # noqa: F403

sys.modules[__name__] = _moved
