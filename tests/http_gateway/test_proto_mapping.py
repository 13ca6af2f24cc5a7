"""Request fields -> proto: the seed fold, the one place a request's int64 seed becomes the proto's uint64."""

from __future__ import annotations

import pytest
from tpuserve.http_gateway.proto_mapping import proto_seed, sampling

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@pytest.mark.parametrize(
    "seed, folded",
    [
        (0, 0),
        (1, 1),
        (INT64_MAX, 2**63 - 1),
        (-1, 2**64 - 1),
        (INT64_MIN, 2**63),
        (INT64_MIN + 5, 2**63 + 5),
    ],
)
def test_proto_seed_is_twos_complement(seed: int, folded: int) -> None:
    assert proto_seed(seed) == folded
    assert sampling(None, None, seed).seed == folded


def test_seeds_2_63_apart_stay_apart() -> None:
    """s and s - 2**63 are both valid request seeds: they reach the backend as s and s + 2**63, which the
    backend keeps apart (all 64 bits count); a fold mod 2**63 anywhere would make them one stream."""
    for s in (0, 1, 12345, INT64_MAX):
        assert proto_seed(s - 2**63) == proto_seed(s) + 2**63


def test_every_int64_seed_has_its_own_uint64() -> None:
    edges = [INT64_MIN, INT64_MIN + 1, -2, -1, 0, 1, INT64_MAX - 1, INT64_MAX]
    folded = [proto_seed(s) for s in edges]
    assert len(set(folded)) == len(edges) and all(0 <= f < 2**64 for f in folded)


def test_no_seed_leaves_the_field_absent() -> None:
    assert not sampling(None, None, None).HasField("seed")
