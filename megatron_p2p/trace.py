"""megatron_p2p.verify.trace, at the path it had before the tools moved into megatron_p2p.verify:
the same module object, so old imports (and `python -m megatron_p2p.trace`) keep working."""
import sys
from typing import TYPE_CHECKING

from .verify import trace as _moved

if TYPE_CHECKING:  # what this module is, once it has replaced itself below
    from .verify.trace import *  # noqa: F403

if __name__ == "__main__":  # python -m megatron_p2p.trace
    sys.exit(_moved.main())
sys.modules[__name__] = _moved
