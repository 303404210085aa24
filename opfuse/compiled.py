"""What opfuse.compile returns for a model in eval mode: CompiledModule, which captures,
compiles and serves each input signature, compiling again where none serves a call."""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .frontend import structure
from .frontend.capture import Captured, CaptureError, capture_module
from .frontend.grad import THROUGH, GradOutputs, with_grad
from .frontend.structure import describe_mismatch, signature
from .frontend.symbolic import DimSpec, Family, changed_dims, export_family, given_dims
from .frontend.watch import TRAINING, ParameterWatch, modeless
from .options import Options
from .pipeline import CompiledGraph, compile_graph, warn_once
from .report.tables import FusionReport
from .runtime.heap import collector_paused
from .runtime.sized import check, note, serve, unserved

log = logging.getLogger("opfuse")


# Exports with symbolic sizes one compiled module tries: a second one when inputs change
# dims the first kept static (a batch size after sequence lengths).
MAX_EXPORTS = 2
# Signatures remembered as served by an export's generic run (each is checked once).
GENERIC_SIGNATURES = 4096


def _autocast() -> tuple[Any, ...]:
    """The autocast state a capture traces under (its dtype per device where enabled)."""
    return tuple(
        torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d) else None
        for d in ("cpu", "cuda")
    )


class RecompileError(RuntimeError):
    """Inputs differ from every compiled signature and recompiling is switched off."""


@dataclass
class _Entry:
    captured: Captured
    compiled: CompiledGraph | None  # None: compiling failed, torch.compile runs this one
    report: FusionReport
    family: Family | None = None  # the export with symbolic sizes it was captured from


class _CompileLock:
    """A compiled module's lock, which turns the one way a thread meets it again while
    holding it into the error eager gives: the model calling its own compiled module
    (`model.forward = opfuse.compile(model, ...)`) recurses forever."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None

    def __enter__(self) -> None:
        me = threading.get_ident()
        if self._owner == me:
            raise RecursionError(
                "opfuse: the compiled module was called again while compiling for a call "
                "to it: the model calls its own compiled module (as after `model.forward "
                "= opfuse.compile(model, ...)`, which eager would recurse on forever); "
                "call the compiled module instead of the model, or compile "
                "`model.forward` itself"
            )
        self._lock.acquire()
        self._owner = me

    def __exit__(self, *exc: object) -> None:
        self._owner = None
        self._lock.release()


class CompiledModule(torch.nn.Module):
    """What `opfuse.compile` returns for a model in eval mode: computes what the model
    computes with fused kernels. Parameters and buffers were frozen at compile time."""

    def __init__(
        self,
        model: torch.nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        options: Options,
        recompile: bool,
        cache_limit: int | None = None,
        dynamic_shapes: Any = None,
    ) -> None:
        super().__init__()
        # Not a registered submodule: .to()/.train() on this wrapper must not touch the
        # caller's model.
        self.__dict__["_model"] = model
        self._autocast = _autocast()  # the graphs' dtypes follow it
        self._options = options
        self._recompile = recompile
        self._cache_limit = cache_limit
        self._entries: dict[tuple[Any, ...], _Entry] = {}
        self._kw_order = list(kwargs)
        self._lock = _CompileLock()
        self._dynamo: Any = None
        self._watch: ParameterWatch | None = None
        self._followed = False  # warned that the parameters changed
        self._untraceable: set[tuple[Any, ...]] = set()  # signatures export cannot trace
        self._stale: set[tuple[Any, ...]] = set()  # signatures compiled before a change
        # captures to compile again after parameters changed in place (their constants
        # are the live tensors), by signature
        self._reuse: dict[tuple[Any, ...], Captured] = {}
        # the buffers the graphs update (eager updates the model's), shared by all entries
        self._state: dict[str, torch.Tensor] = {}
        # Exports with symbolic sizes serve input shapes that differ in tensor sizes
        # (frontend/symbolic.py): made with `dynamic_shapes`, or on the first shape that
        # differs from a compiled one, with the dims that changed; a later one (other dims
        # changed) does not replace the earlier, whose ranges may admit what it refuses
        # (batch 1 after a symbolic batch, whose range starts at 2). Latest last.
        self._dynamic_shapes = dynamic_shapes
        self._families: list[Family] = []
        self._exports = 0  # exports with symbolic sizes tried
        # signatures the family's generic run serves (Family.make_generic)
        self._generic_runs: dict[tuple[Any, ...], Callable[[Sequence[Any]], Any]] = {}
        self._grads = GradOutputs()
        self._first = self._compile(
            args, kwargs, self._family_for(model, args, kwargs, self._flat(args, kwargs))
        )

    @property
    def report(self) -> FusionReport:
        """The FusionReport of the first compiled signature."""
        return self._first.report

    def __deepcopy__(self, memo: dict[int, Any]) -> CompiledModule:
        """An independent copy (EMA weights, trainers that copy their model): the model and
        the buffers the graphs update are copied; the compiled kernels, which hold ctypes
        functions and change nothing, are shared until a parameter of either changes."""
        new = CompiledModule.__new__(CompiledModule)
        torch.nn.Module.__init__(new)
        new.__dict__["_model"] = copy.deepcopy(self.__dict__["_model"], memo)
        new._watch_modes(new.__dict__["_model"])  # (its modes are the original's)
        new._autocast = self._autocast
        new._options, new._recompile = self._options, self._recompile
        new._cache_limit = self._cache_limit
        # the export holds this module's weights: the copy exports its own when it needs one
        new._dynamic_shapes, new._families, new._exports = self._dynamic_shapes, [], 0
        new._generic_runs, new._grads = {}, GradOutputs()
        new._kw_order = list(self._kw_order)
        new._lock, new._dynamo = _CompileLock(), None
        new._entries, new.__dict__["_served"] = {}, list(self.__dict__.get("_served", []))
        new._state = {k: v.clone() for k, v in self._state.items()}
        for sig, e in self._entries.items():
            state = {k: new._state[k] for k in e.captured.state}
            entry = _Entry(dataclasses.replace(e.captured, state=state), e.compiled, e.report)
            new._entries[sig] = entry
            if e is self._first:
                new._first = entry
        new._reuse, new._followed = {}, False
        new._untraceable, new._stale = set(self._untraceable), set(self._stale)
        # The shared kernels read this module's weights, equal to the copy's until either
        # changes: then the copy compiles from its own.
        new._watch = ParameterWatch(new.__dict__["_model"], self._frozen(), borrowed=True)
        return new

    def _watch_modes(self, model: torch.nn.Module) -> None:
        """The graphs hold every submodule's mode at the compile (dropout off, BatchNorm
        with running statistics): each call compares them, the model's own and those of
        the submodules whose forward may read it (not torch's convolutions, linears,
        activations...: watch.MODELESS; MobileNetV2 71 of its 178 modules, MobileNetV3-Large 71
        of 184: b1 calls 0.985-0.995x and 0.98-0.99x the time). Taken at every compile,
        with the parameters the gradient path reads: a compile after a submodule was
        replaced watches the new one."""
        subs = list(model.modules())
        modal = [m for m in subs[1:] if not modeless(type(m))]  # type: ignore[arg-type]
        self.__dict__["_submodules"] = subs[:1] + modal
        self.__dict__["_params"] = list(model.parameters())
        self._modes = list(map(TRAINING, self.__dict__["_submodules"]))

    def _flat(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
            return list(args)  # the common call: pytree costs ~10 us of a small model's call
        return pytree.tree_leaves((tuple(args), self._ordered(kwargs)))

    def _ordered(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """kwargs in the first call's order (their leaves' order in a signature)."""
        ordered = {k: kwargs[k] for k in self._kw_order if k in kwargs}
        ordered.update({k: v for k, v in kwargs.items() if k not in ordered})
        return ordered

    @collector_paused()  # (runtime/heap.py: full collections cost compiles 15%)
    def _compile(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        family: Family | None,
        why: Sequence[str] = (),
    ) -> _Entry:
        """Compile these inputs' signature: captured from `family` (the export with
        symbolic sizes that admits them, _family_for) when there is one. `why`: why no
        earlier compile served these sizes (_serve), for the report."""
        model = self.__dict__["_model"]
        leaves = self._flat(args, kwargs)
        sig = signature(leaves)
        reused = self._reuse.pop(sig, None)
        captured = self._share_state(reused or self._capture(model, args, kwargs, leaves, family))
        compiled: CompiledGraph | None
        try:
            try:
                compiled = compile_graph(captured.graph, self._options, captured.eager_kernels)
            except Exception as e:
                if not captured.dynamic:
                    raise
                # the sizes as symbols are ours to get wrong: this shape exports on its own
                log.debug("compiling from the symbolic export failed: %s: %s", type(e).__name__, e)
                captured = self._share_state(capture_module(model, args, kwargs))
                compiled = compile_graph(captured.graph, self._options, captured.eager_kernels)
            report = compiled.report
            if captured.dynamic:
                report.dynamic.append(captured.dynamic)
            decided = note(compiled)
            if decided is not None:
                report.dynamic.append(decided)
            report.dynamic += why
        except Exception as e:  # a bug of ours must not stop a model eager runs
            message = fallback_message(e)
            warn_once(message)
            compiled, report = None, FusionReport(warnings=[message])
        entry = _Entry(captured, compiled, report, family if captured.dynamic else None)
        if not self._entries:
            self._first = entry
        self._entries[sig] = entry
        self._watch = ParameterWatch(model, self._frozen())
        self._watch_modes(model)
        return entry

    def _serve(
        self, family: Family, leaves: list[Any], sig: Any, why: list[str], evict: bool = False
    ) -> _Entry | None:
        """These inputs served by an earlier compile from `family` whose decisions hold at
        their sizes (runtime/sized.py): no capture, no compile. Appends to `why` what
        each compile tried decides otherwise here. `evict` (full): in place of the
        signature served longest ago, if there is one (_give_way)."""
        if family.asserts():
            return None
        values = family.values(leaves)
        tried: set[int] = set()
        for e in reversed(self._entries.values()):
            c = e.compiled
            if e.family is not family or c is None or id(c.decisions) in tried:
                continue
            tried.add(id(c.decisions))
            served = serve(c, values)
            if served is None:
                why.append(unserved(c, values))
                continue
            try:
                spec = family.out_spec(leaves)
            except CaptureError:
                return None  # (a size the model returns has no value here: captured, fails)
            captured = dataclasses.replace(e.captured, out_spec=spec)
            check(served, lambda: compile_graph(family.capture(leaves).graph, self._options))
            if evict and not self._give_way():
                return None
            entry = _Entry(captured, served, served.report, family)
            self._entries[sig] = entry
            self.__dict__.setdefault("_served", []).append(sig)
            return entry
        return None

    def _give_way(self) -> bool:
        """Drop the signature served longest ago (served again in milliseconds should it
        come back), if there is one: a full cache then keeps a new shape, never more."""
        served: list[Any] = self.__dict__.setdefault("_served", [])
        while served:
            if self._entries.pop(served.pop(0), None) is not None:
                return True
        return False

    def _share_state(self, captured: Captured) -> Captured:
        """The buffers the graph updates, one copy for every compiled signature."""
        for k, v in captured.state.items():
            captured.state[k] = self._state.setdefault(k, v)
        return captured

    def _capture(
        self,
        model: torch.nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        leaves: list[Any],
        family: Family | None,
    ) -> Captured:
        """The model traced for these inputs: from the export with symbolic sizes that
        admits them, else by an export of their own."""
        if family is not None:
            try:
                return family.capture(leaves)
            except CaptureError as e:
                if self._dynamic_shapes is not None:
                    warn_once(f"opfuse: {e}; this input shape is exported on its own")
                else:
                    log.debug("input shape not captured from the symbolic export: %s", e)
        return capture_module(model, args, kwargs)

    def _family_for(
        self,
        model: torch.nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        leaves: list[Any],
    ) -> Family | None:
        """The export with symbolic sizes to capture these inputs from: the latest that
        admits them, else one exported now, if there is none yet or if they change dims the
        latest keeps static (twice at most)."""
        for known in reversed(self._families):
            if known.admits(leaves):
                return known
        family = self._families[-1] if self._families else None
        ordered = self._ordered(kwargs)
        dims: list[DimSpec] | None
        if self._dynamic_shapes is not None and family is None:
            dims = given_dims(model, args, ordered, self._dynamic_shapes)
        elif self._entries:
            # the latest shape these inputs differ from in tensor sizes only (a decode
            # step's cache length: the step before, not the prompt)
            found = (changed_dims(sig, leaves) for sig in reversed(self._entries))
            dims = next((d for d in found if d is not None), None)
            if dims is not None and family is not None:
                if len(dims) != len(family.dims):
                    return None  # another structure of inputs: the export serves its own
                dims = [{**(a or {}), **(b or {})} or None for a, b in zip(dims, family.dims)]
                if dims == family.dims:
                    return None  # the export keeps these dims symbolic but refused the values
        else:
            return None
        if dims is None or not any(dims) or self._exports >= MAX_EXPORTS:
            return None
        self._exports += 1
        try:
            family = export_family(model, args, ordered, dims)
        except CaptureError as e:
            if self._dynamic_shapes is not None:  # asked for: say why it is not so
                warn_once(f"opfuse: {e.args[0]}; each input shape is exported on its own")
            else:
                log.debug("no export with symbolic sizes: %s", e)
            return None
        self._families.append(family)
        try:
            note = family.make_generic(self._options)
        except Exception as e:  # compiling per shape stays correct
            log.debug("no generic compile of the export: %s: %s", type(e).__name__, e)
            note = None
        if note is not None:
            family.note = f"{family.note}; {note}"
            first = self.__dict__.get("_first")
            if first is not None:  # where users look: what later shapes run
                first.report.dynamic.append(family.note)
        return family if family.admits(leaves) else None

    def _frozen(self) -> dict[str, torch.Tensor]:
        out = {k: v for f in self._families for k, v in f.frozen.items()}
        out.update((k, v) for e in self._entries.values() for k, v in e.captured.frozen.items())
        return out

    def refresh(self) -> None:
        """Compile again from the model's live parameters and buffers on the next call.
        Changes made through torch are seen by themselves; this is for writes that bypass
        torch's version counters (`p.data.add_()`, `p.data = t`, through numpy)."""
        with self._lock:
            forget_copies()
            self._invalidate(recapture=True)

    def _invalidate(self, recapture: bool) -> None:
        self._reuse = {} if recapture else {s: e.captured for s, e in self._entries.items()}
        if recapture:  # the export holds the tensors that were replaced
            self._families, self._exports, self._generic_runs = [], 0, {}
        # compiled before: they compile again even with recompile=False
        self._stale |= set(self._entries)
        self._entries, self.__dict__["_served"] = {}, []
        self._watch = None

    def _follow_parameters(self) -> None:
        """The model's parameters changed since the compile: compile again from them."""
        with self._lock:
            watch = self._watch
            why = watch.changed() if watch is not None else None
            if watch is None or why is None:
                return  # another thread got here first
            if not self._followed:  # once per compiled module: a training loop's evals
                self._followed = True
                warnings.warn(
                    f"opfuse: {why} since the model was compiled; compiling again from the "
                    "live values (a compiled module follows its parameters, as torch.compile "
                    "does)",
                    RuntimeWarning,
                    stacklevel=5,
                )
            self._invalidate(recapture=watch.borrowed or watch.replaced())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if list(map(TRAINING, self.__dict__["_submodules"])) != self._modes:
            # model.train() (or a submodule's) since the compile: eager would use batch
            # statistics and dropout, which the graphs do not; until the modes are back
            warn_once(
                "opfuse: the model's training mode changed since it was compiled; calls run "
                "through torch.compile(backend='opfuse') until it is back in the mode it "
                "was compiled in"
            )
            return self._through_dynamo(*args, **kwargs)
        if _autocast() != self._autocast:
            # eager would compute (and return) the autocast dtypes of this call's state
            warn_once(
                "opfuse: called under another autocast state than it was compiled in; "
                "such calls run through torch.compile(backend='opfuse')"
            )
            return self._through_dynamo(*args, **kwargs)
        watch = self._watch
        if watch is not None and watch.changed() is not None:
            self._follow_parameters()
        leaves = self._flat(args, kwargs)
        if torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in leaves
        ):
            return self._through_dynamo(*args, **kwargs)
        sig = signature(leaves)
        entry = self._entries.get(sig)
        generic = self._generic_runs.get(sig) if entry is None else None
        if generic is not None:
            out = generic(leaves)
            if not torch.is_grad_enabled():
                return out
            return self._with_grad(out, args, kwargs, self._first.captured)
        if entry is None:
            with self._lock:
                entry = self._entries.get(sig)
                if entry is None:
                    if (
                        not self._recompile
                        and sig not in self._stale
                        and not self._declared(leaves)
                    ):
                        known = next(iter(self._entries or self._stale))
                        raise RecompileError(
                            f"opfuse: {describe_mismatch(sig, known)}; recompiling is switched off"
                        )
                    family = self._family_for(self.__dict__["_model"], args, kwargs, leaves)
                    if family is not None and family.generic is not None:
                        served, out = self._serve_generic(sig, family.generic, leaves)
                        if served:
                            return out
                    if sig in self._untraceable:
                        return self._through_dynamo(*args, **kwargs)
                    full = self._full()
                    kept, unserved_why = (
                        None,
                        list[str](),
                    )  # (for the report of a compile made then)
                    if family is not None:  # (full: in place of a size served before)
                        kept = self._serve(
                            family, leaves, sig, unserved_why, evict=full is not None
                        )
                    if kept is None and full is not None and not self._give_way():
                        # Each input shape keeps its plan, memory pool and, for shapes
                        # exported on their own, its kernels: ever new shapes would grow
                        # without bound.
                        warn_once(
                            f"opfuse: {full}; new ones run with torch, unfused. Pad or "
                            "bucket the inputs to a few sizes, or raise cache_limit"
                        )
                        return self.__dict__["_model"](*args, **kwargs)
                    try:
                        entry = kept or self._compile(args, kwargs, family, unserved_why)
                    except CaptureError as e:
                        # as for the first compile: torch.compile runs what export cannot
                        # trace (data-dependent control flow at these sizes), and raises
                        # a model's own exception as the model does
                        self._untraceable.add(sig)
                        first = str(e).splitlines()[0]
                        warn_once(f"opfuse: {first}; these inputs run through torch.compile")
                        return self._through_dynamo(*args, **kwargs)
        if entry.compiled is None:
            return self._through_dynamo(*args, **kwargs)
        cap = entry.captured
        if (
            torch.is_grad_enabled()
            and id(cap) in self._grads.shared
            and self._grads.needs(cap, self.__dict__["_model"], self.__dict__["_params"])
            is not None
        ):
            return self._through_dynamo(*args, **kwargs)  # (seen: not run twice)
        inputs = [leaves[k] if role == "user" else cap.state[k] for role, k in cap.input_roles]
        outs = entry.compiled(inputs)
        user: list[Any] = []
        for (role, k), v in zip(cap.output_roles, outs):
            if role == "user":
                user.append(v)
            elif role == "input":
                leaves[k].copy_(v)  # eager mutated this input in place
            else:
                cap.state[k].copy_(v)
        assert cap.out_spec is not None
        out = structure.unflatten(cap.out_spec, user)
        return self._with_grad(out, args, kwargs, cap) if torch.is_grad_enabled() else out

    def _with_grad(
        self, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any], cap: Captured
    ) -> Any:
        """`out` with a backward where eager's would have one (frontend/grad.py)."""
        model = self.__dict__["_model"]
        got = with_grad(self._grads, out, cap, model, self.__dict__["_params"], args, kwargs)
        return self._through_dynamo(*args, **kwargs) if got is THROUGH else got

    def _declared(self, leaves: list[Any]) -> bool:
        """Do these inputs have the sizes `dynamic_shapes` declared (the export admits
        them)? They compile even with recompile=False."""
        return self._dynamic_shapes is not None and any(f.admits(leaves) for f in self._families)

    def _serve_generic(
        self, sig: tuple[Any, ...], generic: Callable[[Sequence[Any]], Any], leaves: list[Any]
    ) -> tuple[bool, Any]:
        """Run the export's generic compile: (True, outputs), or (False, None) when it
        refuses these inputs (an assertion the export left fails here; the graph writes
        nothing, so the shape then compiles on its own)."""
        try:
            out = generic(leaves)
        except Exception as e:
            log.debug("generic run refused: %s: %s", type(e).__name__, e)
            return False, None
        if len(self._generic_runs) >= GENERIC_SIGNATURES:
            self._generic_runs.clear()  # they are only a shortcut
        self._generic_runs[sig] = generic  # admitted: not checked again
        if self._watch is None:  # compiled shapes were dropped: follow the export's weights
            self._watch = ParameterWatch(self.__dict__["_model"], self._frozen())
        return True, out

    def _full(self) -> str | None:
        """Why no further input shape may compile (None: one may)."""
        from .frontend import dynamo

        n = len(self._entries)
        if self._cache_limit is not None:
            limit = self._cache_limit
        else:
            limit = dynamo.SIZES_LIMIT if self._families else dynamo.CACHE_LIMIT
        if n >= limit:
            return f"{n} input signatures compiled (cache_limit={limit})"
        if self._cache_limit is None and self._families:
            pooled = sum(
                sum(e.compiled.run.plan.pool_sizes)
                for e in self._entries.values()
                if e.compiled is not None
            )
            if pooled >= dynamo.POOL_BUDGET:
                return f"{n} input signatures compiled, whose memory pools reach {pooled >> 20} MiB"
        return None

    def _through_dynamo(self, *args: Any, **kwargs: Any) -> Any:
        """Run through the torch.compile backend: for inputs that require grad (eager
        semantics need autograd, which the frozen graph does not record) and for signatures
        whose compile failed."""
        if self._dynamo is None:
            self._dynamo = torch_compile(self.__dict__["_model"], self._options)
        return self._dynamo(*args, **kwargs)


def torch_compile(model: torch.nn.Module, options: Options, dynamic: bool | None = None) -> Any:
    """`model` through torch.compile with opfuse's backend and these options (but for
    `freeze`: the backend's graphs take the parameters as inputs)."""
    from .frontend.dynamo import backend_for

    return torch.compile(model, backend=backend_for(options), dynamic=dynamic)


def fallback_message(e: Exception) -> str:
    return (
        f"opfuse: compiling the captured graph failed ({type(e).__name__}: {e}); "
        "running it through torch.compile(backend='opfuse'), which falls back to torch "
        "graph by graph"
    )


def forget_copies() -> None:
    """Forget every copy made from a parameter (packed weights, folded BatchNorms): each
    graph packs or folds again from the live tensors on its next call (opfuse.refresh)."""
    from .rewrite.batchnorm import forget_folds
    from .runtime.execute import forget_packs

    forget_packs()
    forget_folds()
