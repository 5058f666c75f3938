"""megatron_p2p.verify.timeline, at the path it had before the tools moved into megatron_p2p.verify:
the same module object, so old imports (and `python -m megatron_p2p.timeline`) keep working."""
import sys
from typing import TYPE_CHECKING

from .verify import timeline as _moved

if TYPE_CHECKING:  # what this module is, once it has replaced itself below
    from .verify.timeline import *  # noqa: F403

sys.modules[__name__] = _moved
