"""The architecture's one rule that code can break silently: a stage (stages/) is how a kernel computes a
problem, the grader judges it, and stages never import the grader (nor a problem the grader's worker)."""
import re
import subprocess
import sys

from conftest import REPO


def test_stages_never_import_the_grader():
    offenders = [str(path.relative_to(REPO)) for path in (REPO / "stages").rglob("*.py")
                 if re.search(r"^\s*(from|import)\s+grader\b", path.read_text(), re.MULTILINE)]
    assert not offenders, f"stages/ imports grader/ in {offenders}"


def test_the_ops_load_nothing_of_the_grader():
    """What a learner's own code imports (stages.ops) needs no part of the grader, not even indirectly."""
    loaded = subprocess.run([sys.executable, "-c", "import sys, stages.ops; print(*sorted(sys.modules))"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split()
    assert not [name for name in loaded if name == "grader" or name.startswith("grader.")]
