"""Writes the wgmma wrappers at the end of wgmma.cuh, below its GENERATED line: one inline-asm
statement per shape in SHAPES, for fp16 and bf16. A wgmma names each of a thread's N/2 accumulator
registers as an operand (up to 128), which is why they are written by a script.

    python -m stages.common.gen_wgmma            # rewrites wgmma.cuh from its GENERATED line on
    python -m stages.common.gen_wgmma --check    # exit status 1 if wgmma.cuh is not what it writes

tests/test_wgmma_header.py checks that the committed wgmma.cuh is this script's output.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HEADER = Path(__file__).with_name("wgmma.cuh")
GENERATED = "// ---- written by gen_wgmma.py from here on: add a shape to its SHAPES, then run it ----"

# (A from shared memory "ss" -- "ss_a_mn" with A MN-major -- or registers "rs", N, B's layout) -- what
# the kernels multiply:
SHAPES = (
    ("ss", 64, "K_MAJOR"),    # stage 9, Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ over 64-query tiles
    ("ss", 128, "K_MAJOR"),   # stage 4, S = Q·Kᵀ with 128-key tiles (D = 128)
    ("ss", 192, "K_MAJOR"),   # stage 4, S = Q·Kᵀ with 192-key tiles (D = 64)
    ("ss", 256, "MN_MAJOR"),  # stage 6, x·W1 and h·W2 with 256-column tiles
    ("rs", 64, "MN_MAJOR"),   # stage 4, O += P·V at D = 64; stage 9, dV += Pᵀ·dO and dK += dSᵀ·Q at D = 64
    ("rs", 128, "MN_MAJOR"),  # stage 4, O += P·V at D = 128; stage 9, dV += Pᵀ·dO and dK += dSᵀ·Q (both D)
    ("ss_a_mn", 64, "MN_MAJOR"),  # stage 9, dQ = dS·K with dS stored as dSᵀ [key][query] (A MN-major)
)
TRANSPOSE_B = {"K_MAJOR": 0, "MN_MAJOR": 1}  # imm-trans-b


def wrapper(kind: str, n: int, major: str) -> list[str]:
    """The explicit specialization of wgmma_ss or wgmma_rs for (T, n, major), as lines of a macro
    body over T and PTX (the element type's name in the instruction)."""
    accumulators = n // 2  # per thread: operands %0 .. %(n/2 - 1)
    registers = ", ".join(f"%{i}" for i in range(accumulators))
    if kind.startswith("ss"):  # then desc_a, desc_b, accumulate; scale-d, imm-scale-a, -b, imm-trans-a, -b
        parameters, inputs = "u64 desc_a, u64 desc_b, int accumulate", '"l"(desc_a), "l"(desc_b), "r"(accumulate)'
        operands = f"%{accumulators}, %{accumulators + 1}"
        immediates = f"1, 1, {1 if kind == 'ss_a_mn' else 0}, {TRANSPOSE_B[major]}"
    else:  # then a[0..3], desc_b, accumulate; scale-d, imm-scale-a, -b, imm-trans-b
        parameters = "const unsigned (&a)[4], u64 desc_b, int accumulate"
        inputs = '"r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate)'
        operands = "{" + ", ".join(f"%{accumulators + i}" for i in range(4)) + f"}}, %{accumulators + 4}"
        immediates = f"1, 1, {TRANSPOSE_B[major]}"
    accumulate = accumulators + (2 if kind.startswith("ss") else 5)
    return [
        f"template <> __device__ __forceinline__ void wgmma_{kind}<T, {n}, {major}>(float (&d)[{n // 8}][4], {parameters}) {{",
        f'    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{accumulate}, 0;\\n"',
        f'                 "wgmma.mma_async.sync.aligned.m64n{n}k16.f32." PTX "." PTX '
        f'" {{{registers}}}, {operands}, p, {immediates};\\n}}\\n"',
        "                 : " + ", ".join(f"ACC4({j})" for j in range(n // 8)),
        f"                 : {inputs});",
        "}",
    ]


def generated() -> str:
    body = [line for kind, n, major in SHAPES for line in wrapper(kind, n, major)]
    return "\n".join([
        GENERATED,
        '#define ACC4(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])',
        "#define DEFINE_WGMMA_WRAPPERS(T, PTX) \\",
        *(f"{line} \\" for line in body[:-1]), body[-1],
        "",
        'DEFINE_WGMMA_WRAPPERS(__half, "f16")',
        'DEFINE_WGMMA_WRAPPERS(__nv_bfloat16, "bf16")',
        "#undef DEFINE_WGMMA_WRAPPERS",
        "#undef ACC4",
    ]) + "\n"


def render(current: str) -> str:
    """wgmma.cuh as it should be: `current` up to its GENERATED line, then the wrappers."""
    written_by_hand = current.split(GENERATED)[0]
    return written_by_hand + generated()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args(argv)
    current = HEADER.read_text()
    if args.check:
        sys.exit(0 if render(current) == current else f"{HEADER} is not gen_wgmma.py's output: run it")
    HEADER.write_text(render(current))


if __name__ == "__main__":
    main()
