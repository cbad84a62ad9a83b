"""The pass rule: at most 2x the library's error in the same dtype plus 2 ulp of the output's scale."""
import torch

from reference import load, tolerance

P = load("attention")


def _case(dtype="float16", scale=1.0, causal=True):
    shape = dict(B=1, H=2, Sq=64, Skv=80, D=64, causal=causal)
    inputs = P.make_inputs(shape, dtype, seed=11, input_scale=scale, device="cpu")
    return inputs, P.reference(inputs), P.library_output(inputs)


def test_library_output_passes_and_tolerance_follows_the_rule():
    inputs, exact, library = _case()
    check = tolerance.relative_to_library("o", library["o"], exact["o"], library["o"])
    u = 2.0**-11
    assert check.passed
    assert check.tolerance == 2 * check.library.max_abs + 2 * u * exact["o"].abs().max().item()


def test_an_error_beyond_the_tolerance_fails():
    inputs, exact, library = _case()
    out = library["o"].clone()
    check = tolerance.relative_to_library("o", out, exact["o"], library["o"])
    out[0, 0, 3, 5] += 3 * check.tolerance + 0.01
    assert not tolerance.relative_to_library("o", out, exact["o"], library["o"]).passed


def test_a_nan_fails_whatever_the_tolerance():
    inputs, exact, library = _case()
    out = library["o"].clone()
    out[0, 1, 7, 0] = float("nan")
    check = tolerance.relative_to_library("o", out, exact["o"], library["o"])
    assert not check.passed and not check.kernel.finite


def test_bfloat16_gets_a_looser_tolerance_than_float16():
    _, exact16, lib16 = _case("float16")
    _, exact_bf, lib_bf = _case("bfloat16")
    t16 = tolerance.relative_to_library("o", lib16["o"], exact16["o"], lib16["o"]).tolerance
    tbf = tolerance.relative_to_library("o", lib_bf["o"], exact_bf["o"], lib_bf["o"]).tolerance
    assert tbf > 4 * t16


def test_quality_levels_only_where_the_dtype_can_meet_them():
    good = tolerance.ErrorStats(5e-5, 5e-6, 5e-4, True)
    ok = tolerance.ErrorStats(5e-4, 5e-5, 5e-3, True)
    bad = tolerance.ErrorStats(5e-3, 5e-4, 5e-2, True)
    assert tolerance.quality(good, good) == "excellent"
    assert tolerance.quality(ok, good) == "below excellent"
    assert tolerance.quality(ok, ok) == "acceptable"
    assert tolerance.quality(good, bad) == "n/a"


def test_lse_rule():
    exact = torch.tensor([1.0, -300.0, 40.0], dtype=torch.float64)
    close = (exact * (1 + 1e-6)).float()
    assert tolerance.absolute_and_relative("lse", close, exact, 4e-5).passed
    far = exact.float() + torch.tensor([0.0, 0.1, 0.0])
    assert not tolerance.absolute_and_relative("lse", far, exact, 4e-5).passed
