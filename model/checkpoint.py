"""Orbax checkpoints: the fast loading path. A converted directory holds

  params/               Orbax checkpoint of the parameter dict (names and layouts of `llama.Llama`)
  tpuserve_model.json   {"format": 1, "config": ModelConfig, "source": ..., "model_id": ...}
  tokenizer.json, tokenizer_config.json   the tokenizer (tpuserve.model.tokenizer round-trips these)
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

MANIFEST = "tpuserve_model.json"
FORMAT = 2  # 2: matrices [out, in] (format 1 kept them [in, out]); convert again


def is_checkpoint(path: pathlib.Path) -> bool:
    return path.is_dir() and (path / MANIFEST).is_file()


def save_checkpoint(
    directory: pathlib.Path, cfg: ModelConfig, params: dict[str, Any], model_id: str, source: str
) -> None:
    directory = directory.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(directory / "params", {k: np.asarray(v) for k, v in params.items()}, force=True)
        ckptr.wait_until_finished()
    manifest = {"format": FORMAT, "config": cfg.to_json(), "model_id": model_id, "source": source}
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
    directory: pathlib.Path, cfg: ModelConfig, dtype: Any, shardings: dict[str, jax.sharding.Sharding] | None
) -> dict[str, jax.Array]:
    """Restore straight into the target dtype and layout: the abstract tree carries each leaf's sharding."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = {
        name: jax.ShapeDtypeStruct(shape, dtype, sharding=(shardings or {}).get(name, device))
        for name, shape in param_shapes(cfg).items()
    }
    try:
        with ocp.StandardCheckpointer() as ckptr:
            return ckptr.restore(directory.resolve() / "params", abstract)
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise ModelLoadError(f"{directory / 'params'}: cannot restore the Orbax checkpoint: {e}") from None
