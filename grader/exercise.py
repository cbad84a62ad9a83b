"""Exercise copies of a stage's kernel, generated from the solution by its markers.

In a stage's `.cu` file the key idea sits between two marker comments:

    // EXERCISE: what to write here (the hint may go on over several // lines)
    // STUB: float row_max = 0.0f;      <- kept as code in the exercise, so that it compiles
    ...the solution...                  <- removed in the exercise
    // END EXERCISE

`python -m grader init stage1` writes the exercise copy to workspace/stage1_tiled/, with each
marked block replaced by `// TODO(exercise): hint` and its stubs; the grader then grades that copy.
FLASHMOE_WORKSPACE names another workspace folder (the tests use a temporary one).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from stages.common.compiler import REPO

BEGIN = re.compile(r"^(\s*)// EXERCISE: ?(.*)$")
END = re.compile(r"^\s*// END EXERCISE\s*$")
STUB = re.compile(r"^\s*// STUB: ?(.*)$")
HINT = re.compile(r"^\s*// ?(.*)$")


class MarkerError(ValueError):
    pass


def make_exercise(source: str) -> str:
    out, block = [], None  # block: the indent of the open EXERCISE, or None outside one
    in_hint = False
    for number, line in enumerate(source.splitlines(), 1):
        if block is None:
            if m := BEGIN.match(line):
                block, in_hint = m.group(1), True
                out.append(f"{block}// TODO(exercise): {m.group(2)}")
            elif END.match(line):
                raise MarkerError(f"line {number}: END EXERCISE without EXERCISE")
            else:
                out.append(line)
            continue
        if END.match(line):
            block = None
        elif m := STUB.match(line):
            in_hint = False
            out.append(f"{block}{m.group(1)}")
        elif in_hint and (m := HINT.match(line)):
            out.append(f"{block}//   {m.group(1)}")
        else:
            in_hint = False  # solution code: left out
        if BEGIN.match(line):
            raise MarkerError(f"line {number}: EXERCISE inside another EXERCISE")
    if block is not None:
        raise MarkerError("EXERCISE without END EXERCISE")
    return "\n".join(out) + "\n"


def count_exercises(source: str) -> int:
    return sum(1 for line in source.splitlines() if BEGIN.match(line))


# A line of the solution that is not logic of its own: blank, a comment, a preprocessor line (`#pragma
# unroll`), or braces and parentheses alone.
NOT_LOGIC = re.compile(r"^\s*(//.*|#.*|[{}();\s]*)$")


def removed_lines(source: str) -> int:
    """The lines of the solution's code that the exercise copy leaves out: between each block's markers,
    after its hint and stubs, the lines that are not blank, a comment, a preprocessor line or braces alone."""
    removed, block, in_hint = 0, False, False
    for line in source.splitlines():
        if not block:
            block = in_hint = bool(BEGIN.match(line))
        elif END.match(line):
            block = False
        elif STUB.match(line):
            in_hint = False
        elif not (in_hint and HINT.match(line)):
            in_hint = False
            removed += not NOT_LOGIC.match(line)
    return removed


def shown(path: Path) -> str:
    """A path as the report and the messages show it: relative to the repository where it is inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def workspace_dir() -> Path:
    return Path(os.environ.get("FLASHMOE_WORKSPACE") or REPO / "workspace").resolve()


def workspace_path(stage) -> Path:
    return workspace_dir() / stage.name / stage.source


def init(stage, force: bool = False) -> Path:
    path = workspace_path(stage)
    if path.exists() and not force:
        raise FileExistsError(f"{shown(path)} exists (your work); --force overwrites it")
    source = stage.source_path.read_text()
    if count_exercises(source) == 0:
        raise MarkerError(f"{shown(stage.source_path)} has no EXERCISE markers")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(make_exercise(source))
    return path
