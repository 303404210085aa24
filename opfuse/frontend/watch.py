"""Which of the tensors an eval-mode compile froze have changed since.

A compiled module follows its model's live parameters, as torch.compile does: kernels that
read a weight's storage would see an in-place update while folded and prepacked copies
would not, so any change sends the next call through a new compile. A change is seen when
it moves the tensor's version counter (an optimizer step, `load_state_dict`, `p.add_()`
under no_grad), replaces the tensor (assignment, `load_state_dict(..., assign=True)`,
a new submodule) or moves its data (`p.data = t`). Writes that bypass the version counter
in place (`p.data.add_()`, through numpy) cannot be seen cheaply; `CompiledModule.refresh()`
is for those.

Checked on every call: one sum of version counters, the tensors' data addresses, an epoch
that module registration hooks move, so that replacements cost nothing until one happens,
and the count of the submodules' children (a deletion moves no hook). The sum is read in C from
the tensors' TensorImpls where the helper builds (`Watched`): right after a call (the
counters out of cache), MobileNetV3-Large's 266 tensors took 62 us through Python's
`_version` (3% of its batch-1 call) and 13 us in C, ResNet-50's 267 131 us and 29 us.

The submodules' modes are watched too (MODELESS: those whose mode changes nothing).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..ir.graph import version
from ..runtime.execute import packs_epoch

log = logging.getLogger("opfuse")

_VERSION = operator.attrgetter("_version")  # of a tensor that is no inference tensor
_ADDRESS = torch.Tensor.data_ptr
_MODULES = operator.attrgetter("_modules")

_SUM_SOURCE = r"""
#include <c10/core/TensorImpl.h>
#include <cstdint>

/* The sum of n tensors' version counters, from their TensorImpls (an inference tensor,
   which has none, counts 0). */
extern "C" int64_t opfuse_version_sum(int64_t n, c10::TensorImpl *const *impls) {
  int64_t s = 0;
  for (int64_t i = 0; i < n; i++)
    if (!impls[i]->is_inference()) s += (int64_t)impls[i]->version_counter().current_version();
  return s;
}

/* 0 if each of n tensors' data is still at addresses[i], 1 if one moved (`p.data = t`),
   -1 if one's storage cannot be read here (the caller then compares through Python). */
extern "C" int64_t opfuse_moved(int64_t n, c10::TensorImpl *const *impls,
                                const int64_t *addresses) {
  try {  /* (a subclass whose storage refuses access throws: no exception leaves C) */
    for (int64_t i = 0; i < n; i++) {
      if (!impls[i]->has_storage()) return -1;
      if ((int64_t)(intptr_t)impls[i]->data() != addresses[i]) return 1;
    }
  } catch (...) {
    return -1;
  }
  return 0;
}
"""


TRAINING = operator.attrgetter("training")
# The forwards of torch.nn's modules that never read `self.training` (inherited ones too:
# ReLU6 is Hardtanh's, torchvision's Conv2dNormActivation Sequential's): a module running
# one of them computes the same in either mode, so a call need not check its mode.
# BatchNorm, dropout, RNNs, attention and every class of the model's own are checked.
MODELESS = frozenset(
    c.forward
    for c in (
        nn.Module, nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.Identity,
        nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
        nn.ConvTranspose3d, nn.Linear, nn.Bilinear, nn.Flatten, nn.Unflatten,
        nn.ReLU, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU,
        nn.SiLU, nn.Mish, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Sigmoid,
        nn.Tanh, nn.Softmax, nn.LogSoftmax, nn.Softplus, nn.GLU,
        nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d,
        nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
        nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
        nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.LocalResponseNorm, nn.Embedding,
        nn.PixelShuffle, nn.PixelUnshuffle, nn.Upsample, nn.ZeroPad2d,
    )
)  # fmt: skip


@functools.cache
def modeless(cls: type[torch.nn.Module]) -> bool:
    """Does a module of class `cls` compute the same in either mode? Its forward is one of
    MODELESS and no class of its own (outside torch.nn) overrides a method that forward
    may call (a convolution's `_conv_forward` that reads `self.training`): it may only add
    a constructor."""
    return cls.forward in MODELESS and not any(
        callable(v) and k != "__init__"
        for c in cls.__mro__
        if c is not object and not c.__module__.startswith("torch.nn.")
        for k, v in vars(c).items()
    )


@functools.lru_cache(maxsize=1)
def _helpers() -> Any:
    """The library of opfuse_version_sum and opfuse_moved, or None where it does not build
    (no C++ compiler or headers)."""
    from ..backends.base import BuildError
    from ..backends.c.build import build_torch_extension

    try:
        lib = build_torch_extension(_SUM_SOURCE)
    except (BuildError, OSError) as e:
        log.info("opfuse: parameter versions are read through Python (%s)", e)
        return None
    lib.opfuse_version_sum.argtypes = [ctypes.c_int64, ctypes.c_void_p]
    lib.opfuse_version_sum.restype = ctypes.c_int64
    lib.opfuse_moved.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    lib.opfuse_moved.restype = ctypes.c_int64
    return lib


def _impls(tensors: Sequence[torch.Tensor]) -> Any:
    """The tensors' TensorImpl pointers (`_cdata`), valid while the tensors are held."""
    return (ctypes.c_void_p * len(tensors))(*(t._cdata for t in tensors))


class Watched:
    """`tensors`' version counters and data addresses. Their sum of versions moves whenever
    one counter does (they only grow); an address moves where `p.data = t` moves no
    counter. Both read in C from the TensorImpls (`_cdata`; the tensors are held, so the
    pointers stay valid), each through Python where the helper is missing or disagrees
    with Python at the start (MobileNetV2's 262 frozen tensors: addresses 47 us a call
    through Python)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        self.tracked = [t for t in self.tensors if not t.is_inference()]
        self.at = list(map(_ADDRESS, self.tensors))
        self.n = len(self.tensors)
        self.impls = _impls(self.tensors)
        self.want = (ctypes.c_int64 * self.n)(*self.at)
        lib = _helpers()
        self.sum_fn = lib.opfuse_version_sum if lib is not None else None
        if self.sum_fn is not None and self.sum_fn(self.n, self.impls) != self._version():
            self.sum_fn = None
        self.moved_fn = lib.opfuse_moved if lib is not None else None
        if self.moved_fn is not None and self.moved_fn(self.n, self.impls, self.want) != 0:
            self.moved_fn = None  # (a tensor without storage, or data() disagrees with data_ptr)

    def _version(self) -> int:
        return sum(map(_VERSION, self.tracked))

    def version(self) -> int:
        """The sum of the version counters (inference tensors have none)."""
        if self.sum_fn is None:
            return self._version()
        return int(self.sum_fn(self.n, self.impls))

    def moved(self) -> bool:
        """Has a tensor's data moved since the start?"""
        if self.moved_fn is None:
            return list(map(_ADDRESS, self.tensors)) != self.at
        return bool(self.moved_fn(self.n, self.impls, self.want))


# Moved by every parameter, buffer or submodule (re)assignment in the process: a watch
# looks for replaced tensors only when it moved.
_epoch = 0


def _moved(*_: Any) -> None:
    global _epoch
    # Inside a graph dynamo traces (a forward that slices a ModuleList builds a new one,
    # registering its modules) the increment would be a side effect dynamo guards on: every
    # call would fail the guard and recompile, up to dynamo's limit, then run eagerly --
    # for any torch.compile'd model in a process that imported opfuse. Modules built there
    # are temporaries, not the parameters of a compiled model.
    if torch.compiler.is_compiling():
        return
    _epoch += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_moved)
torch.nn.modules.module.register_module_buffer_registration_hook(_moved)
torch.nn.modules.module.register_module_module_registration_hook(_moved)


class ParameterWatch:
    """Watches `frozen` (the tensors the compiled graphs hold, by name in `model`). A deep
    copy of a compiled module shares its kernels, which read the original's tensors:
    `borrowed=True` watches those and the copy's own under the same names, and any change
    of either needs a new capture from the copy's model."""

    def __init__(
        self, model: torch.nn.Module, frozen: dict[str, torch.Tensor], borrowed: bool = False
    ) -> None:
        self.model = model
        self.borrowed = borrowed
        self.names = list(frozen)
        self.tensors = [_find(model, n, t) for n, t in frozen.items()]
        if borrowed:  # the kernels' tensors too: versions and addresses
            self.tensors += list(frozen.values())
        self.versions = list(map(version, self.tensors))
        self.version = sum(self.versions)
        self.watched = Watched(self.tensors)
        self.epoch = _epoch
        # The module tree: a submodule replaced by one without tensors (an activation
        # swapped) moves the epoch and no frozen tensor; one deleted (`del model[2]`) moves
        # neither, only the count of the children (~3 us a call for MobileNetV2's 37).
        self.modules = list(model.modules())
        self.parents = [m for m in self.modules if m._modules]
        self.children = self._children()
        # Plain tensor attributes (`self.scale = torch.rand(4)`) are reassigned without
        # a registration hook: their holders are compared on every call (models have few).
        self.plain = [
            (holder, key, t)
            for n, t in zip(self.names, self.tensors)
            for holder, key in [_plain_holder(model, n)]
            if holder is not None
        ]

    def changed(self) -> str | None:
        """What changed since the watch was made, or None. Runs on every call: one map
        over the tensors (version counters only grow: their sum moves whenever one does)."""
        if self.watched.version() != self.version:
            now = list(map(version, self.tensors))
            moved = [self._name(i) for i, (v, w) in enumerate(zip(self.versions, now)) if v != w]
            return f"{moved[0]} was modified in place" + _more(moved)
        if (
            _epoch == self.epoch
            and all(h.get(k) is t for h, k, t in self.plain)
            and self._children() == self.children
            and not self.watched.moved()
        ):
            return None
        gone = self.which_replaced()
        if gone:
            return f"{gone[0]} was replaced" + _more(gone)
        if self.regrown():
            return "a submodule was replaced"
        # a registration elsewhere, or a module's second name dropped: nothing of ours moved
        self.epoch, self.children = _epoch, self._children()
        return None

    def replaced(self) -> bool:
        """Is a tensor the graphs froze no longer the model's, or a submodule another (a
        new capture is needed)?"""
        return bool(self.which_replaced()) or self.regrown()

    def _children(self) -> int:
        return sum(map(len, map(_MODULES, self.parents)))

    def regrown(self) -> bool:
        """Is the model's module tree no longer the one the graphs were traced from?"""
        now = list(self.model.modules())
        return len(now) != len(self.modules) or any(a is not b for a, b in zip(now, self.modules))

    def which_replaced(self) -> list[str]:
        own = self.tensors[: len(self.names)]
        found = [_find(self.model, n, t) for n, t in zip(self.names, own)]
        now = list(map(_ADDRESS, self.tensors))
        return [n for n, t, f in zip(self.names, own, found) if f is not t] + [
            self._name(i) for i, (a, b) in enumerate(zip(self.watched.at, now)) if a != b
        ]

    def _name(self, i: int) -> str:
        n = len(self.names)
        return self.names[i] if i < n else f"{self.names[i - n]} (of the module copied from)"


def _more(names: list[str]) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


def _owner(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module | None, str]:
    """The submodule that holds `name`, and the attribute's name in it."""
    path, _, key = name.rpartition(".")
    try:
        return model.get_submodule(path), key
    except AttributeError:
        return None, key


def _find(model: torch.nn.Module, name: str, t: torch.Tensor) -> torch.Tensor:
    """The tensor the model holds under `name` now (a module's parameter, buffer or plain
    attribute, found by name: a deep copy of the model holds its own there); `t` itself
    where the name leads to none (a tensor a function closes over)."""
    mod, key = _owner(model, name)
    for d in () if mod is None else (mod._parameters, mod._buffers, mod.__dict__):
        v = d.get(key)
        if isinstance(v, torch.Tensor):
            return v
    return t


def _plain_holder(model: torch.nn.Module, name: str) -> tuple[dict[str, Any] | None, str]:
    """The __dict__ of the module holding `name` as a plain tensor attribute, else None."""
    mod, key = _owner(model, name)
    if mod is None or key in mod._parameters or key in mod._buffers:
        return None, key
    return (mod.__dict__, key) if isinstance(mod.__dict__.get(key), torch.Tensor) else (None, key)


class FrozenInputs:
    """Graph inputs a torch.compile inference graph was compiled with as constants (the
    parameters and buffers dynamo passes in): the compile serves a call only if the same
    tensors come, unchanged (identity, one sum of version counters, their addresses: a
    `p.data = t` moves no counter), and no `opfuse.refresh()` came in between."""

    def __init__(self, positions: Sequence[int], args: Sequence[Any]) -> None:
        self.positions = tuple(positions)
        self.tensors = [args[k] for k in self.positions]
        self.watched = Watched(self.tensors)
        self.version = self.watched.version()
        self.epoch = packs_epoch()

    def holds(self, args: Sequence[Any]) -> bool:
        given = [args[k] for k in self.positions]
        return (
            all(map(operator.is_, given, self.tensors))
            and self.watched.version() == self.version
            and not self.watched.moved()
            and self.epoch == packs_epoch()
        )
