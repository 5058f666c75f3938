"""megatron_p2p.verify.check, at the path it had before the tools moved into megatron_p2p.verify:
the same module object, so old imports (and `python -m megatron_p2p.check`) keep working."""
import sys
from typing import TYPE_CHECKING

from .verify import check as _moved

if TYPE_CHECKING:  # what this module is, once it has replaced itself below
    from .verify.check import *  # noqa: F403

if __name__ == "__main__":  # python -m megatron_p2p.check
    sys.exit(_moved.main())
sys.modules[__name__] = _moved
