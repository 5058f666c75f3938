"""megatron_p2p.verify.replay, at the path it had before the tools moved into megatron_p2p.verify:
the same module object, so old imports (and `python -m megatron_p2p.replay`) keep working."""
import sys

from .verify import replay as _moved

if __name__ == "__main__":  # python -m megatron_p2p.replay
    sys.exit(_moved.main())
sys.modules[__name__] = _moved
