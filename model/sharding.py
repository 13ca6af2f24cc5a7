"""Sharding as data: logical axis names (see llama.PARAM_AXES / CACHE_AXES) map to mesh axes by a rules table.

A dimension that the mesh axis does not divide is replicated instead (e.g. SmolLM2's 3 KV heads on 4 devices)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tpuserve.model.config import ModelConfig
from tpuserve.model.llama import BLOCK_AXES, CACHE_AXES, PARAM_AXES, param_shapes, pool_shape
from tpuserve.model.quant import is_quantized

DEFAULT_RULES = {
    "heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "experts": None,  # MoE experts: each device holds a slice of every expert (its "mlp" axis)
    "vocab": None,
    "embed": None,
    "layers": None,
    "batch": "data",
    "sequence": None,
}


@dataclass(frozen=True)
class ShardingRules:
    rules: dict[str, str | None] = field(default_factory=lambda: dict(DEFAULT_RULES))

    def spec(self, mesh: Mesh, axes: tuple[str | None, ...], shape: tuple[int, ...]) -> PartitionSpec:
        out = []
        for name, dim in zip(axes, shape):
            mesh_axis = self.rules.get(name) if name else None
            if mesh_axis is None or mesh_axis not in mesh.shape or dim % mesh.shape[mesh_axis]:
                out.append(None)
            else:
                out.append(mesh_axis)
        return PartitionSpec(*out)


def make_mesh(model_parallel: int = 1, data_parallel: int = 1, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    need = model_parallel * data_parallel
    if need > len(devices):
        raise ValueError(
            f"mesh data={data_parallel} x model={model_parallel} needs {need} devices, have {len(devices)}"
        )
    return Mesh(np.array(devices[:need]).reshape(data_parallel, model_parallel), ("data", "model"))


def param_shardings(
    cfg: ModelConfig, mesh: Mesh, rules: ShardingRules | None = None
) -> dict[str, NamedSharding]:
    rules = rules or ShardingRules()
    return {
        name: NamedSharding(mesh, rules.spec(mesh, PARAM_AXES[name], shape))
        for name, shape in param_shapes(cfg).items()
    }


def field_sharding(sharding: NamedSharding, name: str, shape: tuple[int, ...]) -> NamedSharding:
    """Where one field of a quantized parameter goes (tpuserve.model.quant: its values, scales and offsets keep the
    parameter's axes; the last one is shorter)."""
    return NamedSharding(sharding.mesh, ShardingRules().spec(sharding.mesh, PARAM_AXES[name], shape))


def module_shardings(
    mesh: Mesh, params: dict[str, Any], rules: ShardingRules | None = None
) -> dict[str, Any]:
    """Shardings for parameters in the module layout (`llama.module_params`), the same tree (a quantized matrix:
    one sharding per field, by the matrix's axes)."""
    rules = rules or ShardingRules()

    def place(axes: tuple[str | None, ...], arr) -> Any:
        if is_quantized(arr):
            return arr.map(lambda a: NamedSharding(mesh, rules.spec(mesh, axes, a.shape)))
        return NamedSharding(mesh, rules.spec(mesh, axes, arr.shape))

    out: dict[str, Any] = {n: place(PARAM_AXES[n], a) for n, a in params.items() if n != "layers"}
    layers = params["layers"]
    if isinstance(layers, dict):  # stacked
        out["layers"] = {n: place(("layers", *BLOCK_AXES[n]), a) for n, a in layers.items()}
    else:
        out["layers"] = [{n: place(BLOCK_AXES[n], a) for n, a in layer.items()} for layer in layers]
    return out


def cache_sharding(cfg: ModelConfig, mesh: Mesh, pages: int, page: int, rules: ShardingRules | None = None):
    """Where a pool of `pages` pages of `page` positions lives on the mesh (split over KV heads)."""
    rules = rules or ShardingRules()
    return NamedSharding(mesh, rules.spec(mesh, CACHE_AXES, pool_shape(cfg, pages, page)))
