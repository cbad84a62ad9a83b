"""Grade bands, the goal of a stage, and the suspect flags."""
import pytest

from grader import grading
from grader.gpus import slug_for, spec_for
from stages import Goal


@pytest.mark.parametrize("score,letter", [(0.95, "A"), (0.81, "A"), (0.80, "B"), (0.71, "B"), (0.65, "C"),
                                          (0.45, "D"), (0.40, "F"), (0.1, "F")])
def test_bands(score, letter):
    assert grading.letter(score) == letter


def test_geomean():
    assert grading.geomean([0.5, 2.0]) == pytest.approx(1.0)
    assert grading.geomean([]) == 0.0


def test_grade_is_against_the_goal_fraction():
    benches = [{"ms": 2.0, "baselines": {"flash": 1.2, "cudnn": 0.8, "naive": 10.0}},
               {"ms": 4.0, "baselines": {"flash": 2.4, "cudnn": 1.6, "naive": 20.0}}]
    g = grading.grade(Goal("flash", 0.6), benches)
    assert g["score"] == pytest.approx(1.0) and g["grade"] == "A"
    g = grading.grade(Goal("reference", 1.0), benches)   # cudnn, the fastest library
    assert g["score"] == pytest.approx(0.4) and g["grade"] == "F"
    g = grading.grade(Goal("naive", 1.0), benches)
    assert g["score"] == pytest.approx(5.0)


def test_missing_goal_baseline_falls_back_to_the_reference():
    g = grading.grade(Goal("flash", 1.0), [{"ms": 1.0, "baselines": {"cudnn": 0.9, "naive": 5.0}}])
    assert g["goal"]["baseline"] == "reference" and g["score"] == pytest.approx(0.9)


def test_naive_is_never_the_reference():
    assert grading.reference_of({"naive": 0.1, "flash": 1.0}) == ("flash", 1.0)


def test_figures_and_suspect_flags():
    spec = spec_for("NVIDIA H100 80GB HBM3")
    shape = {}
    flops, nbytes = 1e12, 1e9
    fig = grading.benchmark_figures(shape, 2.0, {"cudnn": 1.5, "naive": 10.0}, flops, nbytes, spec)
    assert fig["tflops"] == pytest.approx(500.0)
    assert fig["pct_of_reference"] == pytest.approx(75.0)
    assert fig["speedup_vs_naive"] == pytest.approx(5.0)
    assert fig["pct_peak"] == pytest.approx(100 * 500 / 989.4)
    assert fig["flags"] == []
    too_fast = grading.benchmark_figures(shape, 0.5, {"cudnn": 1.5}, flops, nbytes, spec)
    assert any("roofline" in f for f in too_fast["flags"])
    too_slow = grading.benchmark_figures(shape, 20.0, {"cudnn": 1.5}, flops, nbytes, spec)
    assert any("10x slower" in f for f in too_slow["flags"])
    unknown = grading.benchmark_figures(shape, 2.0, {"cudnn": 1.5}, flops, nbytes, None)
    assert "pct_peak" not in unknown


@pytest.mark.parametrize("name,slug", [("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"),
                                       ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
                                       ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA A10", "a10"),
                                       ("NVIDIA L4", "l4"), ("NVIDIA L40S", "l40s"),
                                       ("NVIDIA GeForce RTX 4090", "rtx-4090"), ("Some Future GPU", "some-future-gpu")])
def test_gpu_table(name, slug):
    assert slug_for(name) == slug


def test_arch_choice_and_too_old_gpus():
    from grader.device import GpuInfo
    from stages import arch_for
    every = ("sm_80", "sm_86", "sm_89", "sm_90a")

    def gpu(major, minor):
        return GpuInfo("GPU", major, minor, 100, 1 << 20, 1500, 1 << 30, "13.0")

    assert arch_for(gpu(9, 0), every) == "sm_90a"
    assert arch_for(gpu(8, 6), every) == "sm_86"
    assert arch_for(gpu(8, 7), every) == "sm_87"          # newer than sm_80: runs
    assert arch_for(gpu(12, 0), every) == "sm_120"
    with pytest.raises(ValueError, match="needs sm_90a"):
        arch_for(gpu(8, 0), ("sm_90a",))
    with pytest.raises(ValueError, match="needs sm_90a"):
        arch_for(gpu(10, 0), ("sm_90a",))
    with pytest.raises(ValueError, match="sm_80 or newer"):
        arch_for(gpu(7, 5), every)
