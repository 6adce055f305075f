"""How NCCL's algorithms load the scale-out fabric: bytes through each node's NICs per byte of
the all-reduce buffer S, derived from the algorithms' structure (no measured constant here).

- A ring over n ranks sends S x 2(n - 1)/n from every rank; a node's NICs carry one such
  stream per channel crossing it, so ring bus bandwidth is the node's NIC rate.
- NCCL's tree all-reduce reduces inside a node first (a chain over NVLink) and sends one
  stream per node across the network, over a *double binary tree* (src/graph/trees.cc,
  `ncclGetBtree` / `ncclGetDtree`): each tree carries half of S; a node sends S/2 to its
  parent (reduce) and S/2 to each child (broadcast), and receives as much. Its NIC load per
  direction is (parent + children) x S/2 summed over both trees; the busiest node sets the
  time. On 2 nodes that is S (half what a ring sends, which is why 2-node trees beat the
  network: nccl-tests #196), on 3 nodes 1.5 S (a 3-node ring of 8-GPU nodes sends 1.92 S:
  nccl#1801 measures tree 1.19-1.23x ring on 3 GB200 racks), from 4 nodes on 2 S, what a
  ring sends, so rings win there on bandwidth and trees only on latency.
"""

from __future__ import annotations

import functools


def binary_tree(nranks: int, rank: int) -> tuple[int, list[int]]:
    """Parent (-1 for the root) and children of `rank` in NCCL's binary tree over `nranks`
    (trees.cc `ncclGetBtree`: a tree that alternates leaves and nodes)."""
    bit = 1
    while bit < nranks and not bit & rank:
        bit <<= 1
    if rank == 0:
        return -1, ([bit >> 1] if nranks > 1 else [])
    up = (rank ^ bit) | (bit << 1)
    if up >= nranks:
        up = rank ^ bit
    lowbit = bit >> 1
    if lowbit == 0:
        return up, []
    children = [rank - lowbit]
    down1 = rank + lowbit
    while down1 >= nranks and lowbit:  # the second child, brought within bounds
        lowbit >>= 1
        down1 = rank + lowbit
    if lowbit:
        children.append(down1)
    return up, children


def double_tree(nranks: int, rank: int) -> list[tuple[int, list[int]]]:
    """The two trees of NCCL's double binary tree at `rank` (trees.cc `ncclGetDtree`): the
    second is the first shifted by one rank (odd `nranks`) or mirrored (even)."""
    first = binary_tree(nranks, rank)
    if nranks % 2:
        up, kids = binary_tree(nranks, (rank - 1) % nranks)
        second = ((up + 1) % nranks if up >= 0 else -1, [(k + 1) % nranks for k in kids])
    else:
        up, kids = binary_tree(nranks, nranks - 1 - rank)
        second = (nranks - 1 - up if up >= 0 else -1, [nranks - 1 - k for k in kids])
    return [first, second]


@functools.cache
def tree_network_load(nodes: int) -> float:
    """Bytes the busiest node sends (and receives) across the network per byte of an
    all-reduce over NCCL's double binary tree of `nodes` nodes (each tree carries S/2)."""
    if nodes <= 1:
        return 0.0
    def load(rank: int) -> float:
        return sum(((up >= 0) + len(kids)) / 2 for up, kids in double_tree(nodes, rank))
    return max(load(r) for r in range(nodes))
