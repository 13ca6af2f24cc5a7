"""Orbax checkpoints: the fast loading path. A converted directory holds

  params/               Orbax checkpoint of the parameter dict (names and layouts of `llama.Llama`)
  tpuserve_model.json   {"format": 1, "config": ModelConfig, "source": ..., "model_id": ...}
  tokenizer.json, tokenizer_config.json   the tokenizer (tpuserve.model.tokenizer round-trips these)

With `"quantization": "int8"` in the manifest, each matrix of quant.INT8_PARAMS is stored as {"q": int8 [..., out,
in], "scale": float32 [..., out, 1]} (tpuserve.model.quant, per output channel).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from tpuserve.model.config import ModelConfig, ModelLoadError
from tpuserve.model.llama import param_shapes
from tpuserve.model.quant import INT8_PARAMS, int8_matrix, is_quantized
from tpuserve.model.sharding import field_sharding

MANIFEST = "tpuserve_model.json"
FORMAT = 2  # 2: matrices [out, in] (format 1 kept them [in, out]); convert again


def is_checkpoint(path: pathlib.Path) -> bool:
    return path.is_dir() and (path / MANIFEST).is_file()


def _stored(v: Any) -> Any:
    if is_quantized(v):
        if v.kind != "int8":
            raise ModelLoadError(f"a checkpoint stores int8 or unquantized weights, not {v.kind} blocks")
        return {"q": np.asarray(v.q), "scale": np.asarray(v.scale)}
    return np.asarray(v)


def save_checkpoint(
    directory: pathlib.Path,
    cfg: ModelConfig,
    params: dict[str, Any],
    model_id: str,
    source: str,
    quantization: str = "none",
) -> None:
    directory = directory.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(directory / "params", {k: _stored(v) for k, v in params.items()}, force=True)
        ckptr.wait_until_finished()
    manifest = {"format": FORMAT, "config": cfg.to_json(), "model_id": model_id, "source": source,
                "quantization": quantization}  # fmt: skip
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2))


def read_manifest(directory: pathlib.Path) -> dict[str, Any]:
    file = directory / MANIFEST
    try:
        manifest = json.loads(file.read_text())
        if manifest.get("format") != FORMAT:
            raise ModelLoadError(f"{file}: unknown checkpoint format {manifest.get('format')!r}")
        manifest["config"] = ModelConfig.from_json(manifest["config"])
        return manifest
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{file}: not a valid tpuserve manifest ({e})") from None


def restore_params(
    directory: pathlib.Path,
    cfg: ModelConfig,
    dtype: Any,
    shardings: dict[str, jax.sharding.Sharding] | None,
    quantization: str = "none",
) -> dict[str, Any]:
    """Restore straight into the target dtype and layout: the abstract tree carries each leaf's sharding (int8
    matrices: their values and scales, rebuilt into QuantizedMatrix)."""
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def leaf(name: str, shape: tuple[int, ...], leaf_dtype: Any) -> jax.ShapeDtypeStruct:
        where = device if not shardings else field_sharding(shardings[name], name, shape)
        return jax.ShapeDtypeStruct(shape, leaf_dtype, sharding=where)

    abstract: dict[str, Any] = {}
    for name, shape in param_shapes(cfg).items():
        if quantization == "int8" and name in INT8_PARAMS:
            abstract[name] = {
                "q": leaf(name, shape, np.int8),
                "scale": leaf(name, (*shape[:-1], 1), np.float32),
            }
        else:
            abstract[name] = leaf(name, shape, dtype)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            restored = ckptr.restore(directory.resolve() / "params", abstract)
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise ModelLoadError(f"{directory / 'params'}: cannot restore the Orbax checkpoint: {e}") from None
    return {
        name: int8_matrix(v["q"], v["scale"], dtype) if isinstance(v, dict) else v
        for name, v in restored.items()
    }
