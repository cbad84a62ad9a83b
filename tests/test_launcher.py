"""The launch path's packing (stages/common/launcher.py), without a GPU: each argument in its slot, a parameter
struct laid out as a C compiler lays out the struct, and the grader's check that the kernel's struct is the
one the launch packs (grader/run.py's param_struct_checks), a mismatch said in one line."""
import ctypes
import struct

import numpy as np
import pytest
import torch

import stages
from grader.run import GraderError, compile_stage
from stages import Stage
from stages.common.launcher import PackedParameters, param_struct, parameter_types

# int, then a pointer (4 bytes of padding before it), float, long long (4 more), int, then the tail padding that
# keeps an array of them aligned: 40 bytes, as `sizeof` says (checked below by the compiler itself).
DemoParams = param_struct("DemoParams", [("rows", "int"), ("x", "const float*"), ("scale", "float"),
                                         ("stride", "long long"), ("cols", "int")])
DEMO_SOURCE = """
struct DemoParams {
    int rows;
    const float* x;
    float scale;
    long long stride;
    int cols;
};
extern "C" __global__ void demo(const __grid_constant__ DemoParams p) {
    if (threadIdx.x < p.rows) printf("%f\\n", p.x[threadIdx.x * p.stride + p.cols] * p.scale);
}
"""


def slot_offsets(packed: PackedParameters) -> list[int]:
    """Where the driver reads each parameter, from the start of the packed buffer."""
    base = ctypes.c_void_p.from_address(packed.pointers).value
    return [address - base for address in (ctypes.c_void_p * packed.count).from_address(packed.pointers)]


def test_c_parameter_lists_are_read_as_the_types_passed():
    assert parameter_types("const elem_t* __restrict__, long long, int, const TmaMap, float") == \
        ["pointer", "long long", "int", "TmaMap", "float"]


def test_packed_parameters_lay_each_argument_in_its_own_slot():
    """8 bytes per scalar or pointer, 128 per tensor map, each at the address the pointer array gives the driver."""
    packed = PackedParameters(parameter_types("const elem_t*, long long, int, const TmaMap, float, unsigned"))
    tensor = torch.zeros(4)
    packed.pack((tensor, -5, 7, bytes(range(128)), 0.5, 3))
    raw = packed.raw()
    assert slot_offsets(packed) == [0, 8, 16, 24, 152, 160]
    assert struct.unpack_from("<Q", raw, 0)[0] == tensor.data_ptr()
    assert struct.unpack_from("<q", raw, 8)[0] == -5 and struct.unpack_from("<i", raw, 16)[0] == 7
    assert raw[24:152] == bytes(range(128))
    assert struct.unpack_from("<f", raw, 152)[0] == 0.5 and struct.unpack_from("<I", raw, 160)[0] == 3
    with pytest.raises(TypeError, match="no way to pass a parameter of type 'double'"):
        PackedParameters(["double"])


def test_a_param_struct_is_laid_out_as_c_lays_out_its_fields():
    """Each field aligned to its size (a pointer or a long long after an int: 4 bytes of padding), the size a
    multiple of the largest field's."""
    assert DemoParams._offsets == {"rows": 0, "x": 8, "scale": 16, "stride": 24, "cols": 32}
    assert DemoParams._size == 40
    with pytest.raises(TypeError, match="DemoParams: no way to pack a field of type 'double'"):
        param_struct("DemoParams", [("x", "double")])


def test_a_param_structs_layout_is_not_hidden_by_its_fields():
    """A field may be called as a layout attribute would be: those are named as a named tuple's own are."""
    Sized = param_struct("Sized", [("size", "int"), ("offsets", "const int*")])
    sized = Sized(size=3, offsets=None)
    assert (sized.size, sized.offsets, Sized._size, Sized._offsets) == (3, None, 16, {"size": 0, "offsets": 8})


def test_a_param_struct_is_packed_in_its_slot_with_its_pointers_converted():
    """After a tensor map, the struct's bytes at the C offsets (a tensor's address for a pointer, None a null
    pointer), then the next parameter in the next 8-byte slot: one struct.pack_into for all."""
    packed = PackedParameters(parameter_types("const TmaMap, const DemoParams, int"), (DemoParams,))
    tensor = torch.zeros(4)
    packed.pack((bytes(128), DemoParams(rows=3, x=tensor, scale=0.5, stride=-2**40, cols=9), 11))
    raw = packed.raw()
    assert slot_offsets(packed) == [0, 128, 168]
    assert struct.unpack_from("<i4xQf4xqi4x", raw, 128) == (3, tensor.data_ptr(), 0.5, -2**40, 9)
    assert struct.unpack_from("<i", raw, 168)[0] == 11
    packed.pack((bytes(128), DemoParams(rows=3, x=None, scale=0.5, stride=1, cols=9), 11))
    assert struct.unpack_from("<Q", packed.raw(), 136)[0] == 0


def test_a_struct_argument_must_be_the_structs_values():
    packed = PackedParameters(["DemoParams"], (DemoParams,))
    with pytest.raises(TypeError, match="argument 0 must be a DemoParams"):
        packed.pack(((3, 0, 0.5, 1, 9),))
    with pytest.raises(TypeError, match="at most one parameter struct"):
        PackedParameters(["DemoParams", "DemoParams"], (DemoParams,))


@pytest.mark.parametrize("name", stages.stage_names())
def test_every_struct_a_kernel_takes_is_declared_by_its_stage(name):
    """Each kernel's parameters can be packed: every struct its list names is one of the stage's param_structs
    (no other is declared), and it takes at most one."""
    stage = stages.load(name)
    for signature in stage.kernels.values():
        PackedParameters(parameter_types(signature), stage.param_structs)
    named = {t for signature in stage.kernels.values() for t in parameter_types(signature)}
    assert {s.__name__ for s in stage.param_structs} <= named


@pytest.mark.parametrize("name", ["stage12", "stage13"])
@pytest.mark.parametrize("mask", ["causal", "documents"])
def test_block_sparse_launches_pass_what_their_kernels_declare(name, mask, monkeypatch):
    """Stages 12 and 13 give each kernel what its C signature declares (their parameter structs' values, each field
    of its kind), on a small case, without a GPU: the tensor maps and the SM count, which need a driver, replaced.
    (The dense attention stages' launches: tests/test_attention_launch.py.)"""
    import importlib

    import reference

    stage = stages.load(name)
    module = importlib.import_module(f"stages.{stage.name}")
    monkeypatch.setattr(module, "tensor_map", lambda x, box: x)
    monkeypatch.setattr(module, "sm_count", lambda device: 132, raising=False)
    problem = reference.load(stage.problem)
    case = min((c for c in problem.cases(0) if mask in c.name), key=lambda c: c.shape["S"])
    assert_case_launches_as_declared(stage, problem, case)


def assert_case_launches_as_declared(stage, problem, case) -> None:
    """problem.run_stage of `case` on the CPU, its kernels recorded, not run: every kernel the stage declares is
    launched, each with the arguments its C signature declares (assert_arguments_declared)."""
    from test_attention_launch import RecordingKernels

    inputs = problem.make_inputs(case.shape, case.dtype, case.seed, case.input_scale, device="cpu")
    kernels = RecordingKernels()
    problem.run_stage(stage, kernels, inputs, problem.allocate_outputs(inputs))
    assert {kernel for kernel, *_ in kernels.launches} == set(stage.kernels)
    for kernel, _, _, args in kernels.launches:
        assert_arguments_declared(stage, kernel, args)


def assert_arguments_declared(stage, kernel: str, args: tuple) -> None:
    """A launch's arguments are what the kernel's C signature declares: as many, each of its kind (a tensor or
    an address for a pointer, an integer within 32 bits for an `int`, an integer for a `long long`, a float for
    a `float`), a struct's values, each field of its kind, for a parameter struct."""
    types = parameter_types(stage.kernels[kernel])
    structs = {s.__name__: s for s in stage.param_structs}
    assert len(args) == len(types), f"{kernel}: {len(args)} arguments for {types}"
    for arg, c_type in zip(args, types):
        if c_type in structs:
            assert type(arg) is structs[c_type], f"{kernel}: {arg!r} for a {c_type}"
            fields = parameter_types(", ".join(t for _, t in structs[c_type]._c_fields))
            for value, field_type in zip(arg, fields):
                assert_of_kind(value, field_type, f"{kernel}'s {c_type}")
        else:
            assert_of_kind(arg, c_type, kernel)


def assert_of_kind(value, c_type: str, where: str) -> None:
    integral = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if c_type == "pointer":
        assert isinstance(value, torch.Tensor) or integral or value is None, f"{where}: {value!r} for a pointer"
    if c_type == "long long":
        assert integral, f"{where}: {value!r} for a long long"
    if c_type == "int":
        assert integral and -2**31 <= int(value) < 2**31, f"{where}: {value!r} for an int"
    if c_type == "float":
        assert isinstance(value, float), f"{where}: {value!r} for a float"


# ---- the grader's check of the C struct against its Python class -------------------------------------------

def demo_stage(tmp_path, source: str):
    """A stage of one kernel, `demo`, taking DemoParams, its source `source` (compiled for fp16 and bf16, as an
    attention stage is)."""
    kernel = tmp_path / "demo.cu"
    kernel.write_text(source)
    stage = Stage(name="stage0_naive", problem="attention", source="demo.cu", kernels={"demo": "const DemoParams"},
                  launch=None, param_structs=(DemoParams,))
    return stage, kernel


def graded_compile_error(tmp_path, source: str) -> str:
    stage, kernel = demo_stage(tmp_path, source)
    with pytest.raises(GraderError) as error:
        compile_stage(stage, kernel, "sm_80", with_sass=False)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{kernel}: "), message
    return message.removeprefix(f"{kernel}: ")


def test_the_compiler_lays_the_struct_out_as_the_launch_packs_it(tmp_path):
    stage, kernel = demo_stage(tmp_path, DEMO_SOURCE)
    assert len(compile_stage(stage, kernel, "sm_80", with_sass=False)) == 2  # no GraderError: the checks hold


LAYOUT = "{int rows; const float* x; float scale; long long stride; int cols;}"


def test_a_field_of_another_type_is_one_line(tmp_path):
    said = graded_compile_error(tmp_path, DEMO_SOURCE.replace("long long stride;", "int stride;"))
    assert said == f"DemoParams.stride is not the long long the launch packs: {LAYOUT}"


def test_fields_in_another_order_are_one_line(tmp_path):
    said = graded_compile_error(tmp_path, DEMO_SOURCE.replace("    int rows;\n    const float* x;",
                                                              "    const float* x;\n    int rows;"))
    assert said == f"the fields of DemoParams are not in the order the launch packs them: {LAYOUT}"


def test_a_missing_field_is_one_line(tmp_path):
    said = graded_compile_error(tmp_path, DEMO_SOURCE.replace("    float scale;\n", "").replace(" * p.scale", ""))
    assert said == f"struct DemoParams has no field scale: the launch packs {LAYOUT}"


def test_a_field_the_launch_does_not_pack_is_one_line(tmp_path):
    said = graded_compile_error(tmp_path, DEMO_SOURCE.replace("    int cols;\n", "    int cols;\n    long long spare;\n"))
    assert said == f"struct DemoParams has more fields than the launch packs: {LAYOUT}"


def test_fields_of_one_type_swapped_are_one_line(tmp_path):
    """Two ints trading places: each field has its type, only their places say the struct is not the launch's."""
    swapped = DEMO_SOURCE.replace("    int rows;\n", "    int cols;\n", 1).replace("    int cols;\n};", "    int rows;\n};")
    assert swapped.index("int cols") < swapped.index("int rows")
    said = graded_compile_error(tmp_path, swapped)
    assert said == f"the fields of DemoParams are not in the order the launch packs them: {LAYOUT}"


def test_a_struct_of_another_size_is_one_line(tmp_path):
    said = graded_compile_error(tmp_path, DEMO_SOURCE.replace("struct DemoParams {", "struct alignas(16) DemoParams {"))
    assert said == f"struct DemoParams is 48 bytes, the launch packs 40 bytes: {LAYOUT}"
