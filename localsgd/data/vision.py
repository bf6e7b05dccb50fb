"""Import torchvision on a CPU-only torch.

The only torchvision 0.28.0 on PyPI (the build for torch 2.13.0) is the CUDA one: with torch's CPU
wheel its compiled ops library cannot load, which torchvision tolerates, except that its import
then registers fake kernels for `torchvision::nms` and `qnms` unconditionally and fails with
"operator torchvision::nms does not exist". Declaring those two schemas first (as the ops library
would) lets the import finish. localsgd uses only the pure-Python parts (datasets, transforms v2);
the detection ops stay unavailable, as torchvision itself reports when one is called.
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

import torch

_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_library = None  # kept alive: dropping a Library object unregisters its definitions


def _ops_library_loads() -> bool:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    folder = list(spec.submodule_search_locations)[0]
    path = next((os.path.join(folder, f) for f in os.listdir(folder) if f.startswith("_C.")), None)
    if path is None:
        return False
    try:
        torch.ops.load_library(path)
        return True
    except (OSError, RuntimeError):
        return False


def import_torchvision() -> ModuleType:
    global _library
    if _library is None and not _ops_library_loads():
        _library = torch.library.Library("torchvision", "DEF")
        for schema in _SCHEMAS.values():
            _library.define(schema)
    import torchvision

    return torchvision
