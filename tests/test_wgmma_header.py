"""stages/common/wgmma.cuh ends in wrappers written by stages/common/gen_wgmma.py: the committed
header must be what the script writes (run `python -m stages.common.gen_wgmma` after changing it)."""
from stages.common import gen_wgmma


def test_committed_header_is_the_generators_output():
    current = gen_wgmma.HEADER.read_text()
    assert gen_wgmma.GENERATED in current
    assert gen_wgmma.render(current) == current, "wgmma.cuh differs from gen_wgmma.py's output: run it"


def test_every_shape_is_declared_once():
    generated = gen_wgmma.generated()
    for kind, n, major in gen_wgmma.SHAPES:
        assert generated.count(f"wgmma_{kind}<T, {n}, {major}>") == 1
