"""The pass rule: at most 2x the library's error in the same dtype plus 2 ulp of the output's scale."""
import torch

from reference import load, tolerance

P = load("attention")


def _case(dtype="float16", scale=1.0, causal=True):
    shape = dict(B=1, H=2, Sq=64, Skv=80, D=64, causal=causal)
    inputs = P.make_inputs(shape, dtype, seed=11, input_scale=scale, device="cpu")
    return inputs, P.reference(inputs), P.library_output(inputs)


def test_tolerance_is_the_rule_computed_from_the_tensors():
    inputs, exact, library = _case()
    check = tolerance.relative_to_library("o", library["o"], exact["o"], library["o"])
    library_error = (library["o"].double() - exact["o"]).abs().max().item()
    assert check.tolerance == 2 * library_error + 2 * 2.0**-11 * exact["o"].abs().max().item()


def _with_error_at(exact, library, error: float):
    """The library's output, but one element (where the exact output is near 0, so that float16 holds
    it finely) set `error` away from the exact value: a kernel's output with a known worst error."""
    out = library.clone()
    where = exact.abs().argmin()
    out.view(-1)[where] = exact.view(-1)[where] + error
    return out, (out.double() - exact).abs().max().item()


def test_errors_just_inside_the_tolerance_pass_and_just_outside_fail():
    inputs, exact, library = _case()
    tol = tolerance.relative_to_library("o", library["o"], exact["o"], library["o"]).tolerance
    inside, inside_error = _with_error_at(exact["o"], library["o"], 0.99 * tol)
    outside, outside_error = _with_error_at(exact["o"], library["o"], 1.01 * tol)
    assert 0.98 * tol < inside_error <= tol < outside_error < 1.02 * tol  # float16 kept the planted errors
    assert tolerance.relative_to_library("o", inside, exact["o"], library["o"]).passed
    assert not tolerance.relative_to_library("o", outside, exact["o"], library["o"]).passed


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


def test_the_library_is_computed_without_cudnns_attention_and_the_switch_is_put_back():
    """cuDNN's per-shape plans took most of the attention stages' correctness time (tolerance.library_dispatch)."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    with tolerance.library_dispatch():
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
