"""NVRTC through ctypes: the calls a compile makes, without importing cuda-python.

``from cuda.bindings import nvrtc`` imports cuda.pathfinder and cuda-python's driver module
before NVRTC is loaded: on a cold first call that import runs before the compile starts,
holding the GIL (121 ms with the load on the H200 host, 2026-12-02, pathfinder 81 ms of it;
118-140 ms in a bare process here, against 15 ms for the wheel's metadata and the load).
Here the library is the one cuda-bindings loads: the NVRTC wheel of cuda-bindings' CUDA
major (its file from the wheel's metadata, which cuda.pathfinder searches first), else the
one cuda.pathfinder finds (what cuda-bindings itself asks). The compile is NVRTC's own, so
the cubin is; ctypes releases the GIL in each call, so threads compile in parallel.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import os
from collections.abc import Iterator, Sequence

_P = ctypes.POINTER
_PROGRAM = ctypes.c_void_p
# name -> argument types; every function returns an nvrtcResult (0: NVRTC_SUCCESS)
_SIGNATURES = {
    "nvrtcVersion": (_P(ctypes.c_int), _P(ctypes.c_int)),
    "nvrtcCreateProgram": (
        *(_P(_PROGRAM), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int),
        *(_P(ctypes.c_char_p), _P(ctypes.c_char_p)),
    ),
    "nvrtcDestroyProgram": (_P(_PROGRAM),),
    "nvrtcAddNameExpression": (_PROGRAM, ctypes.c_char_p),
    "nvrtcCompileProgram": (_PROGRAM, ctypes.c_int, _P(ctypes.c_char_p)),
    "nvrtcGetProgramLogSize": (_PROGRAM, _P(ctypes.c_size_t)),
    "nvrtcGetProgramLog": (_PROGRAM, ctypes.c_char_p),
    "nvrtcGetLoweredName": (_PROGRAM, ctypes.c_char_p, _P(ctypes.c_char_p)),
    "nvrtcGetPTXSize": (_PROGRAM, _P(ctypes.c_size_t)),
    "nvrtcGetPTX": (_PROGRAM, ctypes.c_char_p),
    "nvrtcGetCUBINSize": (_PROGRAM, _P(ctypes.c_size_t)),
    "nvrtcGetCUBIN": (_PROGRAM, ctypes.c_char_p),
    "nvrtcGetNumSupportedArchs": (_P(ctypes.c_int),),
    "nvrtcGetSupportedArchs": (_P(ctypes.c_int),),
}
# NVRTC wheel -> the CUDA major of the library it ships (libnvrtc.so.<major>)
WHEEL_MAJORS = {"nvidia-cuda-nvrtc": "13", "nvidia-cuda-nvrtc-cu12": "12"}


def _wheel_files(major: str | None = None) -> Iterator[tuple[str, str]]:
    """(wheel, its library file) of each installed NVRTC wheel (of CUDA ``major`` only,
    when given)."""
    for wheel, wheel_major in WHEEL_MAJORS.items():
        if major not in (None, wheel_major):
            continue
        try:
            dist = importlib.metadata.distribution(wheel)
        except importlib.metadata.PackageNotFoundError:
            continue
        soname = f"libnvrtc.so.{wheel_major}"
        found = [f for f in dist.files or () if f.name == soname]
        if found:
            yield wheel, str(dist.locate_file(found[0]))


def wheel_library() -> str | None:
    """The installed NVRTC wheel's library for cuda-bindings' CUDA major; None without one."""
    try:
        major = importlib.metadata.version("cuda-bindings").split(".")[0]
    except importlib.metadata.PackageNotFoundError:
        return None
    return next((path for _, path in _wheel_files(major)), None)


@functools.cache
def _load() -> tuple[ctypes.CDLL, str | None]:
    """The NVRTC library, loaded, and its file (None where the loader does not say)."""
    path = wheel_library()
    if path is not None:
        return ctypes.CDLL(path), path
    # where cuda-bindings would look: conda, the system, CUDA_HOME
    from cuda.pathfinder import load_nvidia_dynamic_lib

    loaded = load_nvidia_dynamic_lib("nvrtc")
    return ctypes.CDLL(loaded.abs_path or "libnvrtc", handle=loaded._handle_uint), loaded.abs_path


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded NVRTC, its functions typed (the first call loads it)."""
    lib = _load()[0]
    for name, argtypes in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int
    lib.nvrtcGetErrorString.argtypes = (ctypes.c_int,)
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        name = library().nvrtcGetErrorString(result) or b"unknown"
        raise RuntimeError(f"{what} failed: {name.decode()} ({result})")


def version() -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(library().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


@functools.cache
def supported_archs() -> tuple[int, ...]:
    """The compute capabilities the library compiles for, as NVRTC numbers them (89: 8.9,
    100: 10.0). Loads the library."""
    count = ctypes.c_int()
    _check(library().nvrtcGetNumSupportedArchs(ctypes.byref(count)), "nvrtcGetNumSupportedArchs")
    archs = (ctypes.c_int * count.value)()
    _check(library().nvrtcGetSupportedArchs(archs), "nvrtcGetSupportedArchs")
    return tuple(archs)


@functools.cache
def release() -> str:
    """The loaded library's full release: nvrtcVersion names major.minor only, and a patch
    release may compile other cubins. Its wheel's version where the library is a wheel's
    file, else major.minor with the file's size and mtime (major.minor alone where the
    loader names no file). Loads the library; once per process."""
    major, minor = version()
    path = _load()[1]
    if path is None:
        return f"{major}.{minor}"
    for wheel, file in _wheel_files():
        if os.path.exists(file) and os.path.samefile(file, path):
            return importlib.metadata.version(wheel)
    st = os.stat(path)
    return f"{major}.{minor}+{st.st_size}.{st.st_mtime_ns}"


def _strings(items: Sequence[bytes]):
    return (ctypes.c_char_p * max(1, len(items)))(*items)


def compile_program(
    source: bytes,
    filename: bytes,
    headers: Sequence[tuple[bytes, bytes]],
    expression: bytes,
    options: Sequence[bytes],
    kind: str,
) -> tuple[bytes | None, str, str]:
    """(``kind`` "PTX" or "CUBIN" of the program, or None where the compile failed; the
    expression's lowered name, "" then; the compile log). ``headers``: (name, text)."""
    lib = library()
    program = _PROGRAM()
    names, texts = _strings([n for n, _ in headers]), _strings([t for _, t in headers])
    _check(
        lib.nvrtcCreateProgram(ctypes.byref(program), source, filename, len(headers), texts, names),
        "nvrtcCreateProgram",
    )
    try:
        _check(lib.nvrtcAddNameExpression(program, expression), "nvrtcAddNameExpression")
        result = lib.nvrtcCompileProgram(program, len(options), _strings(options))
        size = ctypes.c_size_t()
        _check(lib.nvrtcGetProgramLogSize(program, ctypes.byref(size)), "nvrtcGetProgramLogSize")
        log = ctypes.create_string_buffer(size.value)
        _check(lib.nvrtcGetProgramLog(program, log), "nvrtcGetProgramLog")
        log_text = log.raw.rstrip(b"\0").decode(errors="replace")
        if result != 0:
            return None, "", log_text
        lowered = ctypes.c_char_p()
        _check(
            lib.nvrtcGetLoweredName(program, expression, ctypes.byref(lowered)),
            "nvrtcGetLoweredName",
        )
        get_size, get = f"nvrtcGet{kind}Size", f"nvrtcGet{kind}"
        _check(getattr(lib, get_size)(program, ctypes.byref(size)), get_size)
        binary = ctypes.create_string_buffer(size.value)
        _check(getattr(lib, get)(program, binary), get)
        return binary.raw, lowered.value.decode(), log_text
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))
