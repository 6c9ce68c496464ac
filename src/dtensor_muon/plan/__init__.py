"""The plan: which matrices are computed together, where, which pieces move where, and in which buckets.

Matrices (see :mod:`dtensor_muon.plan.views`) are grouped into **units**, computed as one batch: consecutive
matrices of one parameter (its experts, or the equal blocks of a split), of a shape where batching pays
(:mod:`..kernels.batching`), in groups of G, the largest power of two ≤ min(:data:`MAX_BATCH`, n /
:data:`UNITS_PER_PARAMETER`) for a parameter of n such matrices (64 experts: units of 8; 4 experts: one by
one). A unit never spans parameters and depends only on its parameter's shape and split, never on the world
size or on which other parameters an optimizer holds (a pipeline stage, a param group), so every placement
computes the same batches as one process: the same bits.

A unit whose matrices every holder holds whole is :class:`~.placement.Local` (its cost is pinned load on
each holder). The others get :class:`~.placement.GatherAll` when asked, else an :class:`~.placement.Owned`
rank from :func:`.balance.assign_owners` (longest-processing-time, refined toward the lower bound, with
owner-state bytes as a second constraint); before them, the units of parameters whose ``tp_mode`` computes
them on a tensor-parallel group get a :class:`~.placement.TensorParallelGroup`, the group whose busiest
member is least loaded (:func:`tensor_parallel_mode` says which form each matrix takes). Buckets group the
owned units in parameter (forward-execution) order up to a byte budget. The plan is a pure function of names, shapes, boxes, options and world size, so
every rank builds the same one; its digest is compared across ranks.

An optimizer builds one plan per device mesh. Meshes over the same ranks (torchtitan's dense mesh and its
(dp, ep) expert mesh) are planned in a fixed order, each given the per-rank load of the plans before it
(``build_plan(base_load=...)``), so that owners and tensor-parallel groups balance the ranks' total work.
"""

from .balance import assign_owners, lower_bound, simple_lower_bound
from .builder import UNITS_PER_PARAMETER, build_plan, chunk_by_budget, group_units
from .model import MatrixRoute, MatrixSpec, Plan, Unit, matrices_of, matrix_shape
from .placement import GatherAll, Local, Owned, Placement, TensorParallelGroup
from .tensor_parallel import (
    AUTO_ALL_REDUCE_BYTES_PER_SECOND,
    AUTO_ALL_REDUCE_LATENCY_SECONDS,
    AUTO_FLOPS_PER_SECOND,
    AUTO_ITERATIONS,
    distributed_pays,
    tensor_parallel_mode,
)
from .views import MatrixSplit, parameter_matrices

__all__ = [
    "AUTO_ALL_REDUCE_BYTES_PER_SECOND",
    "AUTO_ALL_REDUCE_LATENCY_SECONDS",
    "AUTO_FLOPS_PER_SECOND",
    "AUTO_ITERATIONS",
    "UNITS_PER_PARAMETER",
    "GatherAll",
    "Local",
    "MatrixRoute",
    "MatrixSpec",
    "MatrixSplit",
    "Owned",
    "Placement",
    "Plan",
    "TensorParallelGroup",
    "Unit",
    "assign_owners",
    "build_plan",
    "chunk_by_budget",
    "distributed_pays",
    "group_units",
    "lower_bound",
    "matrices_of",
    "matrix_shape",
    "parameter_matrices",
    "simple_lower_bound",
    "tensor_parallel_mode",
]
