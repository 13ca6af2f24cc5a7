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
        self.experts: dict[tuple[str, int], list[Any]] = {}  # (name, layer) -> one tensor per expert

    def add_expert(self, index: int, expert: int, name: str, tensor: Any) -> None:
        """One expert's matrix of layer `index`: a layer's experts are stacked into one [E, ...] tensor."""
        if not 0 <= expert < self.cfg.num_experts:
            raise ModelLoadError(f"expert index {expert} out of range (num_experts={self.cfg.num_experts})")
        self.experts.setdefault((name, index), [None] * self.cfg.num_experts)[expert] = tensor

    def add_top(self, name: str, tensor: Any) -> None:
        self.top[name] = tensor

    def add_layer(self, index: int, name: str, tensor: Any) -> None:
        if not 0 <= index < self.cfg.num_layers:
            raise ModelLoadError(f"layer index {index} out of range (num_layers={self.cfg.num_layers})")
        self.layers.setdefault(name, [None] * self.cfg.num_layers)[index] = tensor

    def finish(self, source: str) -> dict[str, object]:
        for (name, index), parts in sorted(self.experts.items()):
            gaps = [e for e, p in enumerate(parts) if p is None]
            if gaps:
                raise ModelLoadError(
                    f"{source}: tensor {name} of layer {index} missing for experts {gaps[:8]}"
                )
            self.add_layer(index, name, stack(parts))
        self.experts.clear()
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
