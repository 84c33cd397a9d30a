"""What a kernel specialization is: a hashable value that fully determines its binary."""

from __future__ import annotations

import dataclasses
import hashlib

import torch

ParamValue = int | bool | str | torch.dtype

# C++ spellings of the dtypes a template may be specialized on. Templates include no
# CUDA headers (compile time), so these are the package's own storage types.
_CXX_TYPES: dict[torch.dtype, str] = {
    torch.float32: "float",
    torch.float16: "fij::half_t",
    torch.bfloat16: "fij::bf16_t",
    torch.float8_e4m3fn: "fij::e4m3_t",
    torch.int32: "int",
    torch.int64: "long long",
    torch.uint8: "unsigned char",
}


def render_param(value: ParamValue) -> str:
    """The C++ template-argument spelling of one parameter value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, torch.dtype):
        return _CXX_TYPES[value]
    if isinstance(value, str):
        return value
    raise TypeError(f"unsupported template parameter {value!r}")


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One specialization of a kernel family.

    ``compiler`` is ``"nvrtc"`` (``template`` is a CUDA C++ header defining the
    ``__global__`` function template ``kernel``) or ``"cute"`` (``template`` is a Python
    file whose ``build(params, arch)`` compiles a CuTe-DSL kernel). ``params`` are the
    ordered template arguments. ``archs`` names the only targets the template supports
    (e.g. ``("sm_90a",)`` for a wgmma kernel); empty means every arch. ``ptx_twins``:
    (arch, the arch whose PTX it takes) pairs beyond jit_kernels.ptxas.PTX_TWINS, where the
    family found NVRTC's PTX of the two the same (prebuild then compiles it once); derived
    from the family, so not compared.
    """

    family: str
    template: str
    kernel: str
    params: tuple[tuple[str, ParamValue], ...]
    compiler: str = "nvrtc"
    archs: tuple[str, ...] = ()
    ptx_twins: tuple[tuple[str, str], ...] = dataclasses.field(default=(), compare=False)

    def supports(self, arch: str) -> bool:
        return not self.archs or arch in self.archs

    @property
    def param_dict(self) -> dict[str, ParamValue]:
        return dict(self.params)

    @property
    def name_expression(self) -> str:
        """The NVRTC name expression that instantiates this specialization."""
        args = ", ".join(render_param(v) for _, v in self.params)
        return f"&{self.kernel}<{args}>" if self.params else f"&{self.kernel}"

    @property
    def label(self) -> str:
        """A short human-readable name for logs and tables."""
        parts = ",".join(f"{k}={_short(v)}" for k, v in self.params)
        return f"{self.family}[{parts}]"


def _short(value: ParamValue) -> str:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return str(value)


def sha256_hex(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()
