"""Collects per-layer tensors from any checkpoint format into the stacked [L, ...] layout of `llama.Llama`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tpuserve.model.config import ModelConfig, ModelLoadError
from tpuserve.model.llama import param_shapes
from tpuserve.model.quant import stack


class LayerStacker:
    def __init__(self, cfg: ModelConfig, cast: Callable[[str, Any], object]):
        self.cfg = cfg
        self.cast = cast
        self.shapes = param_shapes(cfg)
        self.top: dict[str, Any] = {}
        self.layers: dict[str, list[Any]] = {}

    def add_top(self, name: str, tensor: Any) -> None:
        self.top[name] = tensor

    def add_layer(self, index: int, name: str, tensor: Any) -> None:
        if not 0 <= index < self.cfg.num_layers:
            raise ModelLoadError(f"layer index {index} out of range (num_layers={self.cfg.num_layers})")
        self.layers.setdefault(name, [None] * self.cfg.num_layers)[index] = tensor

    def finish(self, source: str) -> dict[str, object]:
        out: dict[str, object] = {}
        for name, shape in self.shapes.items():
            if name in self.top:
                arr = self.top.pop(name)
            elif name in self.layers:
                parts = self.layers.pop(name)
                gaps = [i for i, p in enumerate(parts) if p is None]
                if gaps:
                    raise ModelLoadError(f"{source}: tensor {name} missing for layers {gaps[:8]}")
                arr = stack(parts)  # quantized matrices: field by field
            else:
                raise ModelLoadError(f"{source}: missing tensor for parameter {name}")
            if tuple(arr.shape) != shape:
                raise ModelLoadError(
                    f"{source}: parameter {name} has shape {tuple(arr.shape)}, expected {shape}"
                )
            out[name] = self.cast(name, arr)
        extra = sorted(set(self.top) | set(self.layers))
        if extra:
            raise ModelLoadError(f"{source}: tensors not used by the {self.cfg.architecture} config: {extra}")
        return out
