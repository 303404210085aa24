"""opfuse: an operator-fusion compiler for PyTorch that explains every decision it makes.

fast = opfuse.compile(model, example_inputs)      # eval: frozen, fused kernels
report = opfuse.explain(model, example_inputs)    # what fused, what did not, and why
torch.compile(model, backend="opfuse")            # inference and training
"""

from .api import CompiledModule, RecompileError, compile, explain, refresh
from .frontend.fold import fold_batchnorm
from .options import Options
from .report.tables import FusionReport
from .runtime.heap import keep_freed_memory

__version__ = "0.1.0"


def _configure_logging() -> None:
    """OPFUSE_LOG=fusion (or autotune, triton, all; comma-separated): log those decisions
    to stderr."""
    import logging

    from .settings import names

    for w in names("OPFUSE_LOG", ("fusion", "autotune", "triton", "all")):
        logger = logging.getLogger("opfuse" if w == "all" else f"opfuse.{w}")
        logger.setLevel(logging.DEBUG)
        if not logger.handlers:
            h = logging.StreamHandler()
            h.setFormatter(logging.Formatter("%(name)s: %(message)s"))
            logger.addHandler(h)


def _register_backend() -> None:
    """torch.compile(backend="opfuse") also where no installed entry point names it (a
    checkout on PYTHONPATH). Where the entry point is known, torch loads it itself: this
    import may be that load, and a second registration is an error."""
    from torch._dynamo.backends import registry

    if "opfuse" not in registry._BACKENDS:
        from .frontend.dynamo import opfuse_backend

        registry.register_backend(opfuse_backend, name="opfuse")


_configure_logging()
_register_backend()
__all__ = [
    "CompiledModule",
    "FusionReport",
    "Options",
    "RecompileError",
    "compile",
    "explain",
    "fold_batchnorm",
    "keep_freed_memory",
    "refresh",
]
