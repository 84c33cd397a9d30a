"""The op contract's structure, checked without a GPU: the module graph (ops -> engine, no
cycle), the registry, each kernel family's declared parameters against its compiled
entry's (ELF .nv.info), generated sources against their generator, and the size rules."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
import torch

from flashinfer_jit._jit import FAMILIES, TEMPLATE_ROOT
from flashinfer_jit.registry import OPS
from jit_kernels import compile_cubin, render
from jit_kernels.params import cuobjdump, entry_param_sizes

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jit_kernels", "flashinfer_jit")


# -- the module graph -----------------------------------------------------------------------
def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports anywhere in it (function-level imports too: an
    import moved into a function to dodge a cycle is still a cycle)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from package import module`` needs the module; anything else, ``base`` itself
            # (a submodule's parent package is already being imported: not an edge).
            names = {f"{base}.{alias.name}" for alias in node.names}
            found.update(names & modules or {base})
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph = {}
    for module, path in files.items():
        imported = _imports(path, module, set(files))
        graph[module] = {m for m in imported if m in files and m != module}
    return graph


def test_no_import_cycles():
    graph, state, cycles = _graph(), {}, []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(" -> ".join([*stack[stack.index(dep) :], dep]))
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_ops_depend_on_the_engine_never_the_reverse_nor_on_each_other():
    graph = _graph()
    engine = {m for m in graph if m.startswith("jit_kernels")}
    for module in engine:
        assert not {d for d in graph[module] if d.startswith("flashinfer_jit")}, module
    ops = {op.name for op in OPS.values()}
    for module, deps in graph.items():
        mine = module.split(".")[1] if module.count(".") else ""
        if mine in ops:
            others = {d.split(".")[1] for d in deps if d.count(".") and d.split(".")[1] in ops}
            assert others <= {mine}, f"{module} imports another op: {others - {mine}}"


# -- the registry ---------------------------------------------------------------------------
def test_registry_ops_are_registered_custom_ops():
    for name, op in OPS.items():
        assert op.name == name
        assert hasattr(torch.ops.flashinfer_jit, op.custom_op)
        assert op.load_workloads()["op"] == name
        assert op.prebuild_specs(op.load_workloads(), op.default.options)


# -- kernel parameters: the declaration against the compiled entry --------------------------
def _one_spec_per_family() -> dict:
    specs = {}
    for op in OPS.values():
        for spec in op.prebuild_specs(op.load_workloads(), op.default.options):
            if spec.supports("sm_90a"):
                specs.setdefault(spec.family, spec)
    # The single pass's plain loop form: QsaOptions(tmma=False, lean=False) launches it.
    from flashinfer_jit.qsa import OP as QSA
    from flashinfer_jit.qsa.op import with_options

    for spec in QSA.prebuild_specs(QSA.load_workloads(), with_options(tmma=False, lean=False)):
        specs.setdefault(spec.family, spec)
    # The short single pass: prebuilt for sm_90a only (Qsa.prebuilt_on), so not met above.
    from flashinfer_jit.qsa import short

    family, params = short.short_plan(16, 128, True, short.SHORT_DEFAULT, True, False)
    specs.setdefault(family.family, family.spec(params))
    return specs


@pytest.mark.slow
def test_kernel_signatures_match_the_compiled_entries():
    """Every family's typed parameter list has the sizes, in order, of its compiled entry's
    parameters (cuobjdump -elf, EIATTR_KPARAM_INFO): a parameter added, dropped or retyped
    on one side fails here, not as a misread argument on the GPU."""
    tool = cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (pip install nvidia-cuda-cuobjdump)")
    specs = _one_spec_per_family()
    families = set(FAMILIES)
    assert families == set(specs), f"families without a checked spec: {families ^ set(specs)}"
    for name, spec in sorted(specs.items()):
        if spec.compiler == "cute" and importlib.util.find_spec("cutlass") is None:
            continue
        compiled = compile_cubin(render(spec, TEMPLATE_ROOT), "sm_90a")
        sizes = entry_param_sizes(compiled.cubin, tool)[compiled.entry]
        declared = [p.size for p in FAMILIES[name].signature]
        assert sizes == declared, f"{spec.label}: compiled {sizes}, declared {declared}"


# -- generated sources ----------------------------------------------------------------------
def test_generated_wgmma_wrappers_match_their_generator():
    """templates/mqa_logits/wgmma.cuh is what tools/gen_mqa_logits_wgmma.py writes."""
    path = ROOT / "tools" / "gen_mqa_logits_wgmma.py"
    spec = importlib.util.spec_from_file_location("gen_mqa_logits_wgmma", path)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    committed = (TEMPLATE_ROOT / "mqa_logits" / "wgmma.cuh").read_text()
    assert committed == gen.render(), "regenerate: python tools/gen_mqa_logits_wgmma.py"


# -- size rules -----------------------------------------------------------------------------
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60
REASON = "# size:"  # a file or function over the limit says why, at its top


def _python_files():
    for folder in ("jit_kernels", "flashinfer_jit", "tests", "tools", "templates"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_files_and_functions_are_small_or_say_why():
    problems = []
    for path in _python_files():
        lines = path.read_text().splitlines()
        if len(lines) > MAX_FILE_LINES and not any(REASON in line for line in lines[:30]):
            problems.append(f"{path.relative_to(ROOT)}: {len(lines)} lines")
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            length = node.end_lineno - node.lineno + 1
            head = lines[max(0, node.lineno - 3) : node.lineno + 3]
            if length > MAX_FUNCTION_LINES and not any(REASON in line for line in head):
                problems.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length}")
    assert not problems, "over the size limits without a '# size:' reason:\n" + "\n".join(problems)


# -- constants the host mirrors from the kernel sources ---------------------------------------
def _mirrors() -> list[tuple[int, str, str]]:
    """(the Python value, the template, the C++ constexpr it mirrors)."""
    from flashinfer_jit.mla_kv_pack import specialized
    from flashinfer_jit.mqa_logits import checks as mqa_checks
    from flashinfer_jit.qsa import kernels as qsa_kernels

    return [
        (specialized.WARPS_PER_BLOCK, "mla_kv_pack/sm90_warp_cvt.cuh", "kWarpsPerBlock"),
        (mqa_checks.TILE, "mqa_logits/util.cuh", "kTile"),
        (qsa_kernels.CHUNK, "qsa/util.cuh", "kChunk"),
        (qsa_kernels.SLOT_THREADS, "qsa/sm89_slot_pass.cuh", "kSlotThreads"),
        (qsa_kernels._RED_PAD, "qsa/util.cuh", "kRedPad"),
        (qsa_kernels._BULK_STAGE_BYTES, "qsa/bulk.cuh", "kBulkStageBytes"),
    ]


@pytest.mark.parametrize("value, template, name", _mirrors())
def test_host_mirrors_of_kernel_constants_agree(value, template, name):
    """A launch shape or shared-memory size computed on the host from a constant the kernel
    defines: the two must agree (the kernel's is the definition)."""
    import re

    text = (TEMPLATE_ROOT / template).read_text()
    found = re.findall(rf"constexpr int {name} = (\d+);", text)
    assert found == [str(value)], f"{name} in {template}: {found}, the host uses {value}"


def test_entries_pass_their_own_fixed_arguments(monkeypatch):
    """Two public functions of one op (QSA's decode and attention entry points) each pass
    their own fixed ``dispatch``, with every argument in the declared order."""
    from flashinfer_jit import qsa

    seen = []

    def prepare(args):
        seen.append(args[8:])
        raise RuntimeError("stop")

    monkeypatch.setattr(qsa.OP, "prepare", prepare)
    q = torch.zeros(1, 8, 64, dtype=torch.bfloat16)
    args = (q, None, None, None, None, None, q, q, 0.5, 2.0)
    for fn in (qsa.qsa_sparse_paged_decode, qsa.qsa_sparse_paged_attention):
        with pytest.raises(RuntimeError, match="stop"):
            fn(*args)
    assert seen == [(0.5, 2.0, False), (0.5, 2.0, True)]


# -- a fourth op, as docs/adding_an_op.md says to write one -----------------------------------
class _ScalePlan:
    """The "kernel" of the toy op: out = x * scale, counted."""

    __slots__ = ("replay", "launches")

    def __init__(self):
        self.replay, self.launches = True, 0

    def run(self, x, out, scale):
        out = torch.empty_like(x) if out is None else out
        self.launches += 1
        return out.copy_(x * scale)


def _toy_op():
    from flashinfer_jit.contract import Op, ScalarArg, TensorArg

    class Scale(Op):
        name = log_name = "contract_toy_scale"
        custom_op = "contract_toy_scale"
        args = (
            TensorArg("x"),
            TensorArg("out", optional=True, mutated=True),
            ScalarArg("scale", "float", 1.0),
        )
        prepared = 0

        def prepare(self, args):
            x, out, scale = args
            if not isinstance(x, torch.Tensor):
                raise TypeError("x must be a tensor")
            self.prepared += 1
            return x, torch.empty_like(x) if out is None else out, scale

        def kernel_call(self, args):
            return True  # the toy's kernel runs on CPU tensors

        def refusal(self, args):
            return None

        def plan(self, args, options):
            return _ScalePlan()

        def reference(self, args):
            args[1].copy_(args[0] * args[2])

        def result(self, args):
            return args[1]

    return Scale()


def test_a_new_op_gets_the_call_path_from_its_declaration():
    """The contract alone gives a new op its replay, checks, entry point and custom op."""
    import inspect

    op = _toy_op()

    @op.entry()
    def scale(x: torch.Tensor, out: torch.Tensor | None = None, *, scale: float = 1.0):
        """x * scale."""

    assert list(inspect.signature(scale).parameters) == ["x", "out", "scale"]
    assert scale.__doc__ == "x * scale."
    x = torch.arange(4.0)
    assert torch.equal(scale(x, scale=2.0), x * 2) and op.prepared == 1
    assert torch.equal(scale(torch.ones(4), scale=2.0), torch.full((4,), 2.0))
    assert op.prepared == 1  # the repeat call replayed the plan
    scale(x, scale=3)  # another scalar type: the full path
    assert op.prepared == 2
    with pytest.raises(TypeError, match="x must be a tensor"):
        scale([1.0, 2.0])
    out = torch.empty(4)
    op.traced(x, out, 5.0)  # the registered custom op
    assert torch.equal(out, x * 5)


def test_the_guard_reads_the_given_tensors_of_each_none_pattern():
    """The replay guard's tensors are the required ones and the optional ones not None, in
    one order per None pattern (the scalars, compared first, fix the pattern)."""
    import itertools

    from flashinfer_jit.contract_args import present

    source = present(["a", "b"], ["c", "d", "e"])
    for pattern in itertools.product(*((None, name) for name in "cde")):
        names = dict(zip("cde", pattern, strict=True), a="a", b="b")
        want = ("a", "b", *(name for name in pattern if name is not None))
        assert eval(source, {}, names) == want, pattern  # noqa: S307 (our own expression)
