"""ONNX front end: ``cube.onnx.load(path) -> nn.Module``, trained like any module; ``cube.onnx.save``
writes the trained weights back into the original graph.

The package needs ``onnx`` only when used (``pip install 'cube-compiler[onnx]'``); ``import cube``
never imports it. Operators: ``python -m cube.onnx ops`` (the table in docs/onnx.md).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Collection, Optional, Union

import torch

__all__ = ["load", "save", "supported_ops", "ops_table"]


def load(src, *, trainable: Union[None, Collection[str], Callable] = None) -> torch.nn.Module:
    """An ONNX model as an ordinary ``nn.Module`` whose forward equals onnxruntime's.

    Args:
        src: a path to an ``.onnx`` file (external data next to it is read), its bytes, or an
            ``onnx.ModelProto`` (not modified).
        trainable: which float initializers become parameters. Default: those torch's exporter
            marked as parameters; in other files (and constants the exporter folded, such as a
            transposed weight) those with more than one element and no mask-like value (infinite
            or beyond 1e30). The others are buffers; running statistics of batch norm are buffers
            and values an operator needs while tracing are constants either way. Or a collection
            of initializer names, or ``fn(name, tensor) -> bool``.

    Returns:
        A ``cube.onnx.module.OnnxModule``: ``forward(*inputs)`` takes the graph's inputs in order and
        returns its output (a tuple when several). Parameters and buffers are named after the
        initializers (``blocks.0.linear1.weight``), characters other than letters, digits, ``_`` and
        the dots replaced by ``_``.

    Raises:
        ImportError: ``onnx`` is not installed.
        FileNotFoundError: no file at ``src``.
        ValueError: ``src`` is not a valid ONNX model (naming the file), or nodes cube cannot import
            (all of them, each with its operator, node name and opset).
    """
    from cube.onnx import graph
    return graph.load(src, trainable)


def save(module: torch.nn.Module, path, *, state_dict: Optional[dict] = None, strip_prefix: str = "") -> Path:
    """Writes the model ``module`` was loaded from to ``path`` with its initializers replaced by the
    module's weights (or ``state_dict``'s, e.g. ``cube.merge_checkpoint(dir)`` of a distributed run,
    ``strip_prefix`` dropping a wrapper's prefix such as ``"m."``). Each tensor keeps its ONNX dtype;
    above 2 GiB the weights go to ``<path>.data`` beside it."""
    from cube.onnx import graph
    return graph.save(module, path, state_dict, strip_prefix)


def supported_ops():
    """``[(operator, opset versions, note)]`` of every ONNX operator the importer reads."""
    from cube.onnx import graph
    from cube.onnx.ops import OPS
    return [(name, sorted(graph.known_versions(name)), OPS[name].note) for name in sorted(OPS)]


def ops_table() -> str:
    """The markdown table of ``supported_ops()`` (docs/onnx.md's)."""
    lines = ["| ONNX operator | versions (opsets 13-21) | notes |", "|---|---|---|"]
    for name, versions, note in supported_ops():
        lines.append(f"| {name} | {', '.join(map(str, versions))} | {note} |")
    return "\n".join(lines)
