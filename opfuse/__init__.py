"""opfuse: an operator-fusion compiler for PyTorch that explains every decision it makes.

fast = opfuse.compile(model, example_inputs)      # eval: frozen, fused kernels
report = opfuse.explain(model, example_inputs)    # what fused, what did not, and why
torch.compile(model, backend="opfuse")            # inference and training
"""

from .api import CompiledModule, RecompileError, compile, explain
from .fold import fold_batchnorm
from .pipeline import Options
from .report import FusionReport

__version__ = "0.1.0"
__all__ = [
    "CompiledModule",
    "FusionReport",
    "Options",
    "RecompileError",
    "compile",
    "explain",
    "fold_batchnorm",
]
