"""Loads NVRTC 13 from the ``nvidia-cuda-nvrtc`` wheel (a dependency of mla_rs) before the
extension needs it: mla's CUDA backend opens ``libnvrtc.so.13`` by name with dlopen, and a
library of that soname already loaded with RTLD_GLOBAL is the one dlopen returns. So no
LD_LIBRARY_PATH and no torch import are needed. Where the wheel is missing nothing is loaded,
and the system's NVRTC (if any) is found the usual way."""

import ctypes
import importlib.util
import os

# Where the CUDA 13 wheels put it (nvidia/cu13/lib), and the older per-package layout.
_CANDIDATES = (("cu13", "lib"), ("cuda_nvrtc", "lib"))
_SONAME = "libnvrtc.so.13"


def wheel_path():
    """The wheel's libnvrtc.so.13, or None."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for parts in _CANDIDATES:
            path = os.path.join(root, *parts, _SONAME)
            if os.path.isfile(path):
                return path
    return None


def preload():
    """Loads the wheel's NVRTC globally; returns its path (None if there is no such wheel)."""
    path = wheel_path()
    if path is not None:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    return path
