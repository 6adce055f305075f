"""Replica groups (sharding/replica_groups.py): every form XLA prints, and the mesh axes they
span."""

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sharding.replica_groups import parse_replica_groups


def test_replica_group_forms():
    assert parse_replica_groups("{{0,1},{2,3}}") == [[0, 1], [2, 3]]
    assert parse_replica_groups("{}", 4) == [[0, 1, 2, 3]]
    assert parse_replica_groups("[2,2]<=[4]") == [[0, 1], [2, 3]]
    assert parse_replica_groups("[2,2]<=[2,2]T(1,0)") == [[0, 2], [1, 3]]
    # XLA's mesh-axes form: mesh (a=2, b=2), groups over b -> rows of the iota mesh.
    assert parse_replica_groups("mesh['a'=2,'b'=2] {'b'}") == [[0, 1], [2, 3]]
    assert parse_replica_groups("mesh['a'=2,'b'=2] {'a'}") == [[0, 2], [1, 3]]
    assert parse_replica_groups("mesh['a'=1,'b'=4]", None, "([2,2]T(1,0)) {'b'}") == [[0, 2, 1, 3]]


@st.composite
def iota_case(draw):
    dims = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    perm = draw(st.permutations(range(len(dims))))
    n = math.prod(dims)
    group = draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
    return dims, list(perm), n // group, group


@settings(max_examples=200, deadline=None)
@given(iota_case())
def test_iota_groups_partition_the_devices(case):
    dims, perm, g, s = case
    text = f"[{g},{s}]<=[{','.join(map(str, dims))}]T({','.join(map(str, perm))})"
    groups = parse_replica_groups(text)
    assert len(groups) == g and all(len(x) == s for x in groups)
    assert sorted(i for x in groups for i in x) == list(range(g * s))
    expected = np.arange(g * s).reshape(dims).transpose(perm).reshape(g, s).tolist()
    assert groups == expected


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4095), min_size=1, max_size=6), min_size=1, max_size=6))
def test_explicit_groups_round_trip(groups):
    text = "{" + ",".join("{" + ",".join(map(str, g)) + "}" for g in groups) + "}"
    assert parse_replica_groups(text) == groups


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.data())
def test_mesh_axes_groups_vary_only_along_their_axes(sizes, data):
    names = [f"axis_{i}" for i in range(len(sizes))]
    chosen = data.draw(st.lists(st.sampled_from(names), min_size=1, unique=True))
    text = "mesh[" + ",".join(f"'{n}'={s}" for n, s in zip(names, sizes)) + "] {" + \
        ",".join(f"'{c}'" for c in chosen) + "}"
    groups = parse_replica_groups(text)
    assert sorted(i for g in groups for i in g) == list(range(math.prod(sizes)))
    for g in groups:
        coords = np.stack(np.unravel_index(g, sizes), axis=1)
        fixed = [i for i, n in enumerate(names) if n not in chosen]
        assert (coords[:, fixed] == coords[0, fixed]).all()
