"""megatron_p2p.verify.megatron_recording, at the path it had before the tools moved into megatron_p2p.verify:
the same module object, so old imports (and `python -m megatron_p2p.megatron_recording`) keep working."""
import sys
from typing import TYPE_CHECKING

from .verify import megatron_recording as _moved

if TYPE_CHECKING:  # what this module is, once it has replaced itself below
    from .verify.megatron_recording import *  # noqa: F403

sys.modules[__name__] = _moved
