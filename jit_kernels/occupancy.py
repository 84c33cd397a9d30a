"""How many thread block clusters of a launch shape a device runs at once.

A cluster's CTAs must share one GPC, so how many clusters fit at once is set by the GPCs'
SM counts, not by ``sm_count / cluster_size`` (the H200, one CTA per SM: 15 clusters of 8,
not 16). Dispatch rules that want a grid to finish in one wave ask here. The answer
depends on the cluster size, threads and shared memory only, so it is read once per shape
through an empty kernel the driver compiles from PTX (no NVRTC needed) and memoized.

The queries do not wait for the compiled launcher's build (``wait=False``): a first call
asks them before it compiles its kernel, and the build (~0.45 s) then runs beside that
compile instead of before it (the H200's cold QSA cluster row: 1994 ms, NVRTC 1.47 s of it).
"""

from __future__ import annotations

import functools
import threading

import torch

from . import driver as cu
from .arch import capability

# An empty kernel: only its launch shape matters to the occupancy query. sm_90 is the first
# target with clusters; the driver compiles the PTX for the device it runs on.
_PROBE_PTX = b"""
.version 7.8
.target sm_90
.address_size 64
.visible .entry fij_cluster_probe() { ret; }
\x00"""
# The probe's shared-memory attribute is set per query: one query at a time.
_query_lock = threading.Lock()


@functools.cache
def _probe_function(device: int) -> int:
    with torch.cuda.device(device):
        torch.cuda.init()
        torch.cuda.current_stream(device)  # makes the primary context current here
        return cu.load_module(
            _PROBE_PTX, "fij_cluster_probe", "loading the cluster probe", wait=False
        )


@functools.cache
def max_active_clusters(device: int, cluster_size: int, threads: int, smem_bytes: int) -> int:
    """Clusters of ``cluster_size`` CTAs (``threads`` threads and ``smem_bytes`` of dynamic
    shared memory each) that can be resident on ``device`` at once; 0 before sm_90 (no
    clusters)."""
    if capability(device) < (9, 0):
        return 0
    function = _probe_function(device)
    what = f"cluster occupancy ({cluster_size} x {threads} threads, {smem_bytes} B)"
    with _query_lock, torch.cuda.device(device):
        cu.set_attribute(function, cu.MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes, what, wait=False)
        return cu.max_active_clusters(function, cluster_size, threads, smem_bytes, what, wait=False)
