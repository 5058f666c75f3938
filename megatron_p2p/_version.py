"""The package's version, in one place: `megatron_p2p.__version__`, the tools' `--version` and
pip's metadata (pyproject.toml reads it from here)."""
__version__ = "0.1.0"
