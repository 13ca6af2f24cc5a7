"""The fixed orthogonal rotation of a W8A8 product's input axis (quant.integer_product, `rotated` matrices).

A product y = x W^T equals (x R)(W R)^T for any orthogonal R. W8A8 rounds both sides to int8 with one scale per
activation row and one per weight row, so its error grows with a row's max |value| over its root mean square:
the model's activations have a few channels far larger than the rest (after the norms' gains, and the MLP's
gated product even more), and a row's int8 step is set by them. A randomized Hadamard matrix R spreads every
channel over all the others: a rotated row looks Gaussian (max about 3.3x its rms at 576 inputs), so its int8
step is far finer for the same int8 values. The weights W R are rotated once, at load; the activations x R in
the program, per row (so a row's result still depends on that row only).

R = diag(signs) (A ⊗ B) with n = a * b, a the divisor of n nearest sqrt(n): A and B Hadamard matrices (Sylvester's
for powers of two, times Paley's construction for q + 1, q a prime = 3 mod 4: 12, 20, 24, 44, 48, ...), or, for
an order that has neither, a seeded random orthogonal matrix; all normalized. Applied as two small products over
x reshaped to [..., a, b] (n * (a + b) multiply-adds a row, a few percent of the product's own), never as an
n x n matrix. The signs are random (a fixed seed), so R is a function of n alone: every matrix with n inputs
has the same R, and a fused or stacked matrix is rotated as its parts are.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SEED = 20240601  # fixed: a matrix's rotation depends on its input size only


def _sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def _paley(q: int) -> np.ndarray:
    """Paley's construction I: a Hadamard matrix of order q + 1 for a prime q = 3 mod 4."""
    squares = {(i * i) % q for i in range(1, q)}
    chi = np.array([0.0] + [1.0 if i in squares else -1.0 for i in range(1, q)])
    s = np.zeros((q + 1, q + 1))
    s[0, 1:], s[1:, 0] = 1.0, -1.0
    s[1:, 1:] = chi[(np.arange(q)[None, :] - np.arange(q)[:, None]) % q]
    return s + np.eye(q + 1)


def _is_prime(q: int) -> bool:
    return q > 1 and all(q % d for d in range(2, int(q**0.5) + 1))


def hadamard(n: int) -> np.ndarray | None:
    """An n x n matrix of +-1 with H H^T = n I (Sylvester x Paley), or None when neither construction has order n."""
    two = n & -n  # the largest power of two dividing n
    for p in sorted({n // (two >> k) for k in range(two.bit_length())}):  # n / 2^k, smallest first
        if p == 1:
            return _sylvester(n)
        if p % 4 == 0 and _is_prime(p - 1) and (p - 1) % 4 == 3:
            return np.kron(_paley(p - 1), _sylvester(n // p))
    return None


def _orthogonal(n: int, rng: np.random.Generator) -> np.ndarray:
    """A normalized Hadamard matrix of order n, else a random orthogonal one."""
    h = hadamard(n)
    if h is not None:
        return h / np.sqrt(n)
    q, r = np.linalg.qr(rng.normal(size=(n, n)))
    return q * np.sign(np.diag(r))


@functools.cache
def factors(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(signs [n], A [a, a], B [b, b]) of R = diag(signs) (A ⊗ B), fp32, a * b = n, a <= b, a nearest sqrt(n)."""
    a = max(d for d in range(1, int(n**0.5) + 1) if n % d == 0)
    rng = np.random.default_rng(SEED + n)
    signs = rng.choice(np.array([-1.0, 1.0]), n)
    return tuple(np.asarray(m, np.float32) for m in (signs, _orthogonal(a, rng), _orthogonal(n // a, rng)))


def _right(x: Any, m: np.ndarray) -> Any:
    """x [..., i] @ m [i, o], written as a product with m^T [o, i] (`x @ w.T`, as every product of the model):
    XLA:CPU's dot computes a row of that form with the same arithmetic whatever the number of rows (2 or more),
    so a rotated row does not depend on the rows beside it; with m as [i, o] it rounds rows by their count."""
    if isinstance(x, np.ndarray):
        return x @ m
    # as one 2-D product: with the leading axes kept, XLA:CPU rounded a 2-row batch's rows differently
    y = jnp.einsum("ri,oi->ro", x.reshape(-1, x.shape[-1]), jnp.asarray(m.T), precision=jax.lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32)  # fmt: skip
    return y.reshape(*x.shape[:-1], m.shape[1])


def rotate(x: Any) -> Any:
    """x [..., n] (fp32) -> x R: numpy in, numpy out (weights at load); jax in the programs. The output's inputs
    come in the order [b, a] (each factor is applied to the last axis, with one transpose between them): R is
    defined with that order, and rows rotated by this function (weights and activations alike) agree on it."""
    *lead, n = x.shape
    signs, A, B = factors(n)
    a, b = A.shape[0], B.shape[0]
    z = _right((x * signs).reshape(*lead, a, b), B)  # [..., a, b]
    z = _right(z.swapaxes(-1, -2), A)  # [..., b, a]
    return z.reshape(*lead, n)


def unrotate(y: Any) -> Any:
    """y [..., n] -> y R^T (the inverse of `rotate`): rows of a rotated matrix back in the model's inputs."""
    *lead, n = y.shape
    signs, A, B = factors(n)
    a, b = A.shape[0], B.shape[0]
    z = _right(y.reshape(*lead, b, a), A.T)  # [..., b, a]
    z = _right(z.swapaxes(-1, -2), B.T)  # [..., a, b]
    return z.reshape(*lead, n) * signs
