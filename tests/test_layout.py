"""The architecture's one rule that code can break silently: a stage (stages/) is how a kernel computes a
problem, the grader judges it, and stages never import the grader (nor a problem the grader's worker)."""
import re

from conftest import REPO


def test_stages_never_import_the_grader():
    offenders = [str(path.relative_to(REPO)) for path in (REPO / "stages").rglob("*.py")
                 if re.search(r"^\s*(from|import)\s+grader\b", path.read_text(), re.MULTILINE)]
    assert not offenders, f"stages/ imports grader/ in {offenders}"
