"""The other CPU inference engines users pick, as bench candidates: ONNX Runtime and
OpenVINO (`pip install opfuse[engines]`; without them their columns stay empty).

Both run the same ONNX graph, exported once per case with `torch.onnx.export`, with the
thread count torch uses and float32 arithmetic (OpenVINO would otherwise run bfloat16 on
CPUs that have it), and are checked against eager before they are timed. A case an engine
cannot export, load or match is left out for that engine with the reason."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ENGINES = ("onnxruntime", "openvino")


def available() -> list[str]:
    return [e for e in ENGINES if importlib.util.find_spec(e) is not None]


def prepare(
    model: torch.nn.Module, inputs: tuple[Any, ...], expected: Any, scratch: str | None = None
) -> tuple[dict[str, Callable[[], Any]], dict[str, str]]:
    """(engine -> zero-argument call, engine -> why it is not a candidate)."""
    engines = available()
    runners: dict[str, Callable[[], Any]] = {}
    why: dict[str, str] = {}
    if not engines or not all(isinstance(t, torch.Tensor) for t in inputs):
        return runners, {e: "inputs are not all tensors" for e in engines if inputs}
    folder = Path(scratch or tempfile.mkdtemp(prefix="opfuse-onnx-"))
    path = folder / "model.onnx"
    try:
        _export(model, inputs, path)
    except Exception as e:  # an export failure is the engines' gap, not the bench's
        return runners, {e2: f"torch.onnx.export failed: {_first_line(e)}" for e2 in engines}
    try:
        feeds = [t.detach().cpu().contiguous().numpy() for t in inputs]
    except TypeError as e:  # bfloat16 has no numpy dtype: the engines take numpy arrays
        return runners, {name: f"inputs have no numpy form ({_first_line(e)})" for name in engines}
    want = _flat(expected)
    for name in engines:
        try:
            run = (_onnxruntime if name == "onnxruntime" else _openvino)(path, feeds)
            problem = _mismatch(run(), want)
        except Exception as e:
            problem = f"{type(e).__name__}: {_first_line(e)}"
        if problem:
            why[name] = problem
        else:
            runners[name] = run
    return runners, why


def _export(model: torch.nn.Module, inputs: tuple[Any, ...], path: Path) -> None:
    names = [f"input{i}" for i in range(len(inputs))]
    quiet = io.StringIO()
    onnx_log = logging.getLogger("torch.onnx")
    level = onnx_log.level
    onnx_log.setLevel(logging.ERROR)  # one line per torchvision op it cannot register
    with (
        warnings.catch_warnings(),
        contextlib.redirect_stdout(quiet),
        contextlib.redirect_stderr(quiet),
        torch.no_grad(),
    ):
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(model, inputs, str(path), input_names=names, dynamo=True)
        except Exception:
            # the TorchScript exporter takes some models the dynamo one does not
            torch.onnx.export(model, inputs, str(path), input_names=names, dynamo=False)
        finally:
            onnx_log.setLevel(level)


def _onnxruntime(path: Path, feeds: list[Any]) -> Callable[[], Any]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = torch.get_num_threads()
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    bound = dict(zip(names, feeds))
    return lambda: sess.run(None, bound)


def _openvino(path: Path, feeds: list[Any]) -> Callable[[], Any]:
    import openvino as ov

    core = ov.Core()
    compiled = core.compile_model(
        core.read_model(str(path)),
        "CPU",
        {
            "INFERENCE_NUM_THREADS": torch.get_num_threads(),
            "PERFORMANCE_HINT": "LATENCY",
            "INFERENCE_PRECISION_HINT": "f32",
        },
    )
    request = compiled.create_infer_request()
    bound = dict(enumerate(feeds))

    def run() -> Any:
        request.infer(bound)
        return [request.get_output_tensor(i).data for i in range(len(compiled.outputs))]

    return run


def _flat(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _flat(v)]
    return []


def _mismatch(got: Any, want: list[torch.Tensor]) -> str:
    """Outputs as close to eager's as float32 engines get (their kernels sum in another
    order): the largest difference within 1e-3 of the output's largest magnitude."""
    outs = [torch.as_tensor(g) for g in (got if isinstance(got, (list, tuple)) else [got])]
    if len(outs) != len(want):
        return f"{len(outs)} outputs, eager has {len(want)}"
    for i, (g, w) in enumerate(zip(outs, want)):
        if tuple(g.shape) != tuple(w.shape):
            return f"output {i} has shape {list(g.shape)}, eager's {list(w.shape)}"
        if not w.is_floating_point():
            if not torch.equal(g.to(w.dtype), w):
                return f"output {i} differs from eager"
            continue
        scale = w.abs().max().item() or 1.0
        diff = (g.double() - w.double()).abs().max().item()
        if not diff <= 1e-3 * scale:
            return f"output {i} differs from eager by {diff:.2e} (largest value {scale:.2e})"
    return ""


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__
