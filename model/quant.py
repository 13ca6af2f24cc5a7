"""Weights kept quantized on the device and dequantized inside the jitted programs.

One representation covers every mode: `QuantizedMatrix` holds integer values `q` and, per group of `group`
consecutive inputs of a row, a `scale` and an optional `offset`, so that a weight is

    w[o, i] = q[o, i] * scale[o, i // group] + offset[o, i // group]      (fp32 arithmetic)

- GGUF blocks (`--quantization keep`): Q8_0 (int8, group 32), Q4_0 / Q4_1 (4-bit, group 32; Q4_0's -8 is its
  offset), Q4_K (4-bit, group 32 with the super-block's d*sc and -dmin*m folded in), Q6_K (int8 values q-32,
  group 16). Every product in the formula is exact in fp32 for these types, so the dequantized weights are
  bit-identical to `gguf.quants.dequantize` (tests/model/test_quant.py); the integer values are read with the
  gguf package itself (its dequantizer run over blocks whose scales are set to one).
- int8 weight-only per output channel (`--quantization int8`): symmetric, group = the whole row, no offset; the
  scale is applied to the product's output instead of to the weight.
- W8A8 (`--quantization w8a8`): int8 matrices per output channel (kind "w8a8", `quantize_w8a8`), multiplied by
  activations quantized to int8 per row inside the program: an int8 x int8 -> int32 dot, then the int32 result
  times the row's and the output channel's scales (`integer_product`). A `rotated` matrix holds W R (R: the fixed
  orthogonal rotation of its input axis, model/rotation.py) and its products quantize x R: the same product,
  rounded far less (docs/engine.md "W8A8"). The logprobs are those of the quantized computation, not the model's.

4-bit values are packed two per byte within each block of 32 inputs (byte j holds input j in its low nibble and
input j + 16 in its high one, GGUF's Q4_0 order), so a shard of the input axis holds whole blocks. On XLA:CPU an
unsharded model holds them in row halves instead (`planar`, see `to_planar`): byte j holds input j and input
j + in/2, which XLA dequantizes faster there.

Matrices are [*lead, out, in] (lead: the stacked layer axis, or the fused Q/K/V and gate/up axes of
`llama.module_params`); every field keeps the same leading and `out` axes, so stacking, concatenating and
reshaping the `out` axes act field by field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tpuserve.model import rotation

PACK = 32  # inputs per packed 4-bit block
# The matrices that int8 quantizes (norms and biases stay in the model's dtype).
INT8_PARAMS = ("embed", "lm_head", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down",
               "we_gate", "we_up", "we_down")  # fmt: skip
W8A8 = "w8a8"  # the kind of an int8 per-channel matrix whose products are integer (`integer_product`)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantizedMatrix:
    q: Any  # [*lead, out, in] int8, or [*lead, out, in // 2] uint8 (bits == 4)
    scale: Any  # [*lead, out, in // group] float32
    offset: Any  # [*lead, out, in // group] float32, or None
    bits: int = dataclasses.field(metadata={"static": True}, default=8)
    group: int = dataclasses.field(metadata={"static": True}, default=32)
    kind: str = dataclasses.field(metadata={"static": True}, default="int8")  # Q4_1, Q8_0, ..., int8, w8a8
    dtype: Any = dataclasses.field(
        metadata={"static": True}, default=np.dtype(np.float32)
    )  # dequantized dtype
    # bits == 4 only: byte j of a row holds input j (low nibble) and input j + in/2 (high), not GGUF's block order
    planar: bool = dataclasses.field(metadata={"static": True}, default=False)
    # W8A8 only: the values are those of W R (rotation.rotate of each row); the matrix is still W (`dequantize`)
    rotated: bool = dataclasses.field(metadata={"static": True}, default=False)

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, out, packed = self.q.shape
        return (*lead, out, packed * 2 if self.bits == 4 else packed)

    @property
    def ndim(self) -> int:
        return len(self.q.shape)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.q, self.scale, self.offset) if a is not None)

    def map(self, fn) -> QuantizedMatrix:
        """The same matrix with `fn` applied to each field (fn must keep the `out` axis and the last axis)."""
        off = None if self.offset is None else fn(self.offset)
        return dataclasses.replace(self, q=fn(self.q), scale=fn(self.scale), offset=off)

    def values(self) -> jax.Array:
        """The integer values as int8 [*lead, out, in]."""
        if self.bits == 8:
            return self.q
        if self.planar:
            xp = _xp(self.q)
            return xp.concatenate([self.q & 0x0F, self.q >> 4], axis=-1).astype(np.int8)
        return unpack4(self.q)

    def dequantize(self, dtype: Any = None) -> jax.Array:
        *lead, out, n = self.shape
        v = self.values().astype(jnp.float32).reshape(*lead, out, n // self.group, self.group)
        w = v * self.scale[..., None]
        if self.offset is not None:
            w = w + self.offset[..., None]
        w = w.reshape(*lead, out, n)
        if self.rotated:  # (W R) R^T
            w = rotation.unrotate(w)
        return w.astype(dtype or self.dtype)


def is_quantized(w: Any) -> bool:
    return isinstance(w, QuantizedMatrix)


def _xp(*arrays: Any) -> Any:
    """numpy when every array (a quantized matrix: its values) is a host array, else jax.numpy: the host builds
    and combines matrices at load, the programs on the device."""
    return np if all(isinstance(getattr(a, "q", a), np.ndarray) for a in arrays) else jnp


def unpack4(packed: Any) -> Any:
    """uint8 [..., n // 2] (two 4-bit values per byte, per block of 32) -> int8 [..., n] in 0..15; numpy in, numpy
    out. Written as one broadcast shift (not a concatenation of the two nibbles) so that XLA fuses it into the
    dequantization loop: on XLA:CPU a concatenation makes a kept 4-bit layer's product 2.8x slower than fp32's."""
    xp = _xp(packed)
    *lead, half = packed.shape
    b = packed.reshape(*lead, half // (PACK // 2), 1, PACK // 2)
    shifts = xp.array([0, 4], np.uint8).reshape(2, 1)
    return ((b >> shifts) & 0x0F).reshape(*lead, half * 2).astype(np.int8)


def pack4(values: np.ndarray) -> np.ndarray:
    """Host side of `unpack4`: integers 0..15 [..., n] (n a multiple of 32) -> uint8 [..., n // 2]."""
    *lead, n = values.shape
    v = values.astype(np.uint8).reshape(*lead, n // PACK, 2, PACK // 2)
    return (v[..., 0, :] | (v[..., 1, :] << 4)).reshape(*lead, n // 2)


def to_planar(w: Any) -> Any:
    """A 4-bit matrix (block order) stored in row halves: byte j of a row holds input j in its low nibble and input
    j + in/2 in its high one; the same bytes, values and scales, so its dequantized weights and its products are
    bit-identical (tests/model/test_quant.py). Anything else is returned as it is.

    Why: XLA:CPU turns the block order's unpacking (a shift chosen by the position in each block of 32) into
    index arithmetic per weight, which dominates small decode steps: on the embedded model's layer products row
    halves are about a quarter faster at 2 rows and 7 % at 64; one byte per value would be faster still, but in
    1.5x the bytes. Row halves keep the input axis whole, so only an unsharded model uses them (a shard of the
    input axis needs whole blocks)."""
    if not is_quantized(w) or w.bits != 4 or w.planar:
        return w
    v = unpack4(w.q).astype(np.uint8)
    half = v.shape[-1] // 2
    return dataclasses.replace(w, q=v[..., :half] | (v[..., half:] << 4), planar=True)


def nbytes(w: Any) -> int:
    return w.nbytes if is_quantized(w) else int(np.prod(w.shape)) * jnp.dtype(w.dtype).itemsize


def tree_nbytes(tree: Any) -> int:
    """Bytes of every weight in a parameter tree (quantized matrices counted as stored)."""
    leaves = jax.tree.leaves(tree, is_leaf=is_quantized)
    return sum(nbytes(w) for w in leaves if hasattr(w, "shape"))


# -- products and lookups inside the jitted programs ---------------------------------------------------------


# XLA:CPU: a quantized matrix whose fp32 form is larger than this is multiplied in row chunks of about this size,
# each dequantized while it stays in the cache: on the embedded model's tied Q8_0 embedding (the logits, 49152 x
# 576), chunks of 4096 rows (9 MiB) are 7x faster than one product and faster than the fp32 matrix; bit-identical.
CPU_CHUNK_BYTES = 9 << 20


def precision(dtype: Any) -> jax.lax.Precision | None:
    """The precision every product of the model asks for: HIGHEST for fp32 operands, else the backend's default.
    JAX's default lets a GPU multiply fp32 in TF32 and a TPU in bf16 passes: on an H200 that moves the embedded
    model's logprobs by up to 4.1e-2 from the CPU's, against 8.8e-5 at HIGHEST (bench/device.py).
    A fp32 config asks for fp32 results; bf16 configs are unaffected. XLA:CPU computes fp32 products the same
    either way."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def linear(x: jax.Array, w: Any, out_dtype: Any = None, rows: int | None = None) -> jax.Array:
    """x: [..., in], w: [*out, in] (array or QuantizedMatrix) -> [..., *out] in out_dtype (default x's): one
    [out, in] product with fp32 accumulation, whatever the rank of `out`. A quantized matrix is dequantized inside
    the program, next to its product (on CPU, in row chunks that stay in the cache: CPU_CHUNK_BYTES); with one
    scale per row (int8 per channel) the scale multiplies the product's output instead; a W8A8 matrix is multiplied
    in integers (`integer_product`).

    The product is `x @ w.T` with w [out, in]: XLA:CPU's dot computes a row of it with the same arithmetic
    whatever the number of rows (2 or more; tests/sampler/test_batch_invariance.py).

    `rows` (static): only x[:rows] (leading axis) matters; the product runs on those rows and the others read as
    zeros. The scales (int8's per channel, W8A8's per row and channel) multiply after that padding, on every row, so
    the program around the product is the same whatever `rows` is: XLA:CPU contracts a multiply and the add that
    follows it in one fusion into one FMA (a residual add after the output's scale), which rounds once where the
    two operations round twice, and a pad between them would keep them apart in one bucket and not in another."""
    out = w.shape[:-1]
    live = x if rows is None or rows >= x.shape[0] else x[:rows]
    y, row_scale, channel_scale = _product_parts(live, w)
    if live is not x:
        y = _pad_lead(y, x.shape[0])
        row_scale = None if row_scale is None else _pad_lead(row_scale, x.shape[0])
    if row_scale is not None:
        y = y * row_scale
    if channel_scale is not None:
        y = y * channel_scale
    return y.reshape(*x.shape[:-1], *out).astype(out_dtype or x.dtype)


def _pad_lead(a: jax.Array, size: int) -> jax.Array:
    """a [n, ...] followed by zero rows up to `size`."""
    return jnp.concatenate([a, jnp.zeros((size - a.shape[0], *a.shape[1:]), a.dtype)])


def _product_parts(x: jax.Array, w: Any) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """x [..., in] @ w[*out, in].T as (fp32 [..., rows of w], a scale per row of x [..., 1] or None, a scale per
    row of w [rows of w] or None): the product is the first times the others, left to the caller (`linear`)."""
    n = w.shape[-1]
    rows = math.prod(w.shape[:-1])
    if not is_quantized(w):
        y = jnp.einsum("...i,oi->...o", x, w.reshape(rows, n), preferred_element_type=jnp.float32,
                       precision=precision(x.dtype))  # fmt: skip
        return y, None, None
    flat = reshape_out(w, rows)
    if w.kind == W8A8:
        return integer_product(x, flat)
    chunk = _chunk_rows(rows, n) if jax.default_backend() == "cpu" else rows
    if chunk == rows and flat.group == n and flat.offset is None:  # per output channel: scale the product
        return _unscaled_product(x, flat), None, flat.scale[:, 0]
    if chunk == rows:
        return _quantized_product(x, flat), None, None
    parts = flat.map(lambda a: a.reshape(rows // chunk, chunk, a.shape[-1]))
    y = jax.lax.map(lambda part: _quantized_product(x, part), parts)  # [chunks, ..., chunk]
    return jnp.moveaxis(y, 0, -2).reshape(*x.shape[:-1], rows), None, None


def _quantized_product(x: jax.Array, w: QuantizedMatrix) -> jax.Array:
    """x [..., in] @ w[out, in].T in fp32, whole (the scale of an int8 row chunk included)."""
    if w.group == w.shape[-1] and w.offset is None:  # per output channel: scale the product
        return _unscaled_product(x, w) * w.scale[:, 0]
    return jnp.einsum("...i,oi->...o", x, w.dequantize(x.dtype), preferred_element_type=jnp.float32,
                      precision=precision(x.dtype))  # fmt: skip


def _unscaled_product(x: jax.Array, w: QuantizedMatrix) -> jax.Array:
    """x [..., in] @ the values of a per-channel matrix w [out, in], before its scale, in fp32."""
    return jnp.einsum("...i,oi->...o", x, w.values().astype(x.dtype), preferred_element_type=jnp.float32,
                      precision=precision(x.dtype))  # fmt: skip


def quantize_rows(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """fp32 activations [m, in] -> int8 values [m, in] and one fp32 scale per row [m, 1]: symmetric, values
    round(a * 127 / max |a[r]|) (to nearest, ties to even; clipped to +-127), scale max |a[r]| * fp32(1 / 127); a row
    of zeros gets values 0. A row's values and scale depend on that row only. Written as the multiplications XLA
    would make of `a / scale` and `amax / 127` anyway (its simplifier turns a division by a constant or a
    broadcast into a product with the reciprocal), so a numpy reference computes the same bits."""
    amax = jnp.max(jnp.abs(a), axis=-1, keepdims=True)
    amax = jnp.where(amax > 0, amax, 1.0)
    q = jnp.clip(jnp.rint(a * (127.0 / amax)), -127, 127).astype(jnp.int8)
    return q, amax * np.float32(1 / 127)


def integer_product(x: jax.Array, w: QuantizedMatrix) -> tuple[jax.Array, jax.Array, jax.Array]:
    """W8A8: x [..., in] (float) times a per-channel int8 matrix w [out, in], as int8 x int8 -> int32
    (`quantize_rows`, then one `dot_general` contracting `in`), returned as its parts: (int32 -> fp32 [..., out],
    row scale [..., 1], channel scale [out]), whose product `linear` takes after any padding of the rows. A
    `rotated` matrix holds W R: the activations are rotated first (fp32, rotation.rotate), x R (W R)^T = x W^T, and
    both sides' int8 steps are far finer (model/rotation.py).

    One scale per output channel, not per group of inputs: then the whole input axis is one int32 dot and one
    rescale; a scale per group would need a dot (or a rescale of partial sums) per group, 2-5x slower than fp32 on
    XLA:CPU (docs/engine.md "W8A8"); the rotation buys more accuracy than groups of 32 would, at a few percent of
    the product's cost. Integer sums are exact (|sum| <= in * 127^2, far below 2^31), and the rotation and the
    rescale act on each row alone, so a row's result does not depend on the other rows nor on how XLA tiles the
    dot (tests/model/test_w8a8.py).

    A single row is padded to two (a zero row, scale 1) before the rotation: XLA:CPU multiplies one row by another
    kernel, 2-4x (layers) to 33x (logits) slower than two rows (docs/engine.md "W8A8"); the row's result is the
    same."""
    *lead, n = x.shape
    a = x.reshape(-1, n).astype(jnp.float32)
    m = a.shape[0]
    if m == 1:
        a = jnp.concatenate([a, jnp.zeros_like(a)])
    if w.rotated:
        a = rotation.rotate(a)
    aq, ascale = quantize_rows(a)
    acc = jax.lax.dot_general(aq, w.q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    y = acc[:m].astype(jnp.float32).reshape(*lead, w.q.shape[0])
    return y, ascale[:m].reshape(*lead, 1), w.scale[:, 0]


def _chunk_rows(rows: int, n: int) -> int:
    """The largest divisor of `rows` whose fp32 chunk fits CPU_CHUNK_BYTES (all rows when they fit, or when only
    tiny chunks would divide them)."""
    fit = max(1, CPU_CHUNK_BYTES // (4 * n))
    if rows <= fit:
        return rows
    best = max(d for d in range(1, fit + 1) if rows % d == 0)
    return best if best * 8 >= fit else rows


def take_rows(w: Any, ids: jax.Array) -> jax.Array:
    """Rows `ids` of a [V, H] matrix (an embedding lookup), dequantizing only those rows (a rotated matrix's rows
    rotated back: a tied W8A8 embedding holds E R for the logits, and the lookup reads E)."""
    if not is_quantized(w):
        return jnp.take(w, ids, axis=0)
    rows = w.map(lambda a: jnp.take(a, ids.reshape(-1), axis=0))
    return rows.dequantize().reshape(*ids.shape, w.shape[-1])


# -- host side: building, combining ------------------------------------------------------------------------


def widen(w: QuantizedMatrix, group: int, offset: bool) -> QuantizedMatrix:
    """The same weights (bit-identical when dequantized) stored as int8 values with a smaller `group` (a divisor of
    w.group) and an offset (zeros) if asked: so matrices of different GGUF types can be stacked or fused."""
    xp = _xp(w.q)
    rep = w.group // group
    scale = xp.repeat(w.scale, rep, axis=-1)
    off = w.offset
    if off is not None:
        off = xp.repeat(off, rep, axis=-1)
    elif offset:
        off = xp.zeros_like(scale)
    return dataclasses.replace(w, q=w.values().astype(np.int8), scale=scale, offset=off, bits=8, group=group,
                               planar=False)  # fmt: skip


def compatible(parts: Sequence[QuantizedMatrix]) -> list[QuantizedMatrix]:
    """Bring matrices to one storage (bits, group, offset) so their fields can be stacked or concatenated."""
    first = parts[0]
    if all(
        (p.bits, p.group, p.offset is None) == (first.bits, first.group, first.offset is None) for p in parts
    ):
        return list(parts)
    group = math.gcd(*(p.group for p in parts))
    offset = any(p.offset is not None for p in parts)
    return [widen(p, group, offset) for p in parts]


def kind_of(parts: Sequence[QuantizedMatrix]) -> str:
    kinds = sorted({p.kind for p in parts})
    return kinds[0] if len(kinds) == 1 else "+".join(kinds)


def combine(parts: Sequence[Any], fn) -> Any:
    """fn(list of arrays) -> array, applied field by field when the parts are quantized (mixed types are first
    brought to one storage); a mix of quantized and plain matrices is dequantized to plain ones."""
    if not any(is_quantized(p) for p in parts):
        return fn(list(parts))
    if not all(is_quantized(p) for p in parts):
        return fn([p.dequantize() if is_quantized(p) else p for p in parts])
    if len({p.rotated for p in parts}) > 1:
        raise ValueError("cannot combine rotated and unrotated W8A8 matrices")
    parts = compatible(parts)
    first = parts[0]
    off = None if first.offset is None else fn([p.offset for p in parts])
    return dataclasses.replace(first, q=fn([p.q for p in parts]), scale=fn([p.scale for p in parts]), offset=off,
                               kind=kind_of(parts))  # fmt: skip


def stack(parts: Sequence[Any], axis: int = 0) -> Any:
    """Stack matrices along a new leading axis (`axis` counts from the front, before `out`)."""
    xp = _xp(*parts)
    return combine(parts, lambda arrs: xp.stack(arrs, axis=axis))


def concat_out(parts: Sequence[Any]) -> Any:
    """Concatenate along the `out` axis (the second to last)."""
    xp = _xp(*parts)
    return combine(parts, lambda arrs: xp.concatenate(arrs, axis=-2))


def map_fields(w: Any, fn) -> Any:
    """fn applied to a plain matrix, or to each field of a quantized one (fn must act on the leading and `out`
    axes only: index a layer, permute rows, reshape, place on a device)."""
    return w.map(fn) if is_quantized(w) else fn(w)


def reshape_out(w: Any, *out: int) -> Any:
    """Reshape the leading + `out` axes (the last axis stays)."""
    return map_fields(w, lambda a: a.reshape(*out, a.shape[-1]))


# -- int8 weight-only, per output channel ---------------------------------------------------------------------


def quantize_int8(w: Any, kind: str = "int8") -> QuantizedMatrix:
    """Symmetric int8 per output channel: scale = max |w[o]| / 127, q = round(w / scale). A numpy array stays on
    the host; a jax array is quantized where it lives (e.g. on the device). kind: "int8" (weight-only) or W8A8
    (integer products)."""
    xp = _xp(w)
    w = xp.asarray(w, xp.float32)
    amax = xp.abs(w).max(axis=-1, keepdims=True)
    scale = xp.where(amax > 0, amax / 127.0, 1.0).astype(xp.float32)
    q = xp.clip(xp.rint(w / scale), -127, 127).astype(xp.int8)
    return int8_matrix(q, scale, kind=kind)


def int8_matrix(q: Any, scale: Any, dtype: Any = np.float32, kind: str = "int8") -> QuantizedMatrix:
    """int8 values [..., out, in] with one scale per row [..., out, 1] (what int8 checkpoints store)."""
    return QuantizedMatrix(q, scale, None, bits=8, group=q.shape[-1], kind=kind, dtype=np.dtype(dtype))


# -- W8A8 -----------------------------------------------------------------------------------------------------

# The fractions of max |w[o]| tried as a W8A8 row's largest int8 value (`quantize_w8a8`)
W8A8_CLIPS = tuple(np.round(np.arange(0.80, 1.0001, 0.01), 2))


def rotates(n: int) -> bool:
    """Whether W8A8 matrices with n inputs are rotated: when the rotation's two factors cost at most about a
    quarter of a product with n outputs (every size of the common models; not a large prime, whose only
    factoring is one dense n x n matrix)."""
    _, A, B = rotation.factors(n)
    return A.shape[0] + B.shape[0] <= max(64, n // 4)


def quantize_w8a8(w: Any, chunk_rows: int = 4096) -> QuantizedMatrix:
    """A W8A8 matrix from float weights [..., out, in] (host side): each row rotated (`rotates`, model/rotation.py)
    then int8 per output channel, symmetric, with the scale that minimizes the row's squared rounding error among
    W8A8_CLIPS x max |w[o]| / 127 (values beyond clipped to +-127).

    Why search the scale: the drift of the embedded model's logprobs grows linearly with the int8 step; rotated
    rows are close to Gaussian, and at 8 bits a step a few percent finer than max / 127, which clips the one or
    two largest values of a row, rounds the other 500 or so enough better to lower their squared error: measured
    mean |d logprob| 0.081 -> 0.071 (docs/engine.md "W8A8"). The int8 values are as fast either way."""
    w = np.asarray(w, np.float32)
    *lead, out, n = w.shape
    rotated = rotates(n)
    flat = w.reshape(-1, n)
    q = np.empty(flat.shape, np.int8)
    scale = np.empty((flat.shape[0], 1), np.float32)
    for start in range(0, flat.shape[0], chunk_rows):
        rows = flat[start : start + chunk_rows]
        if rotated:
            rows = rotation.rotate(rows)
        amax = np.abs(rows).max(axis=-1, keepdims=True)
        amax = np.where(amax > 0, amax, np.float32(127))
        best_err = best = None
        for clip in W8A8_CLIPS:
            s = (amax * np.float32(clip / 127)).astype(np.float32)
            v = np.clip(np.rint(rows / s), -127, 127)
            err = np.square(v * s - rows).sum(axis=-1, keepdims=True)
            if best is None:
                best, best_err = s, err
            else:
                better = err < best_err
                best, best_err = np.where(better, s, best), np.where(better, err, best_err)
        q[start : start + len(rows)] = np.clip(np.rint(rows / best), -127, 127).astype(np.int8)
        scale[start : start + len(rows)] = best
    m = int8_matrix(q.reshape(*lead, out, n), scale.reshape(*lead, out, 1), kind=W8A8)
    return dataclasses.replace(m, rotated=rotated)
