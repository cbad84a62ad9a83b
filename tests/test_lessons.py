"""The lessons as a learner reads them: one shape for every lesson, a body short enough to read, an
exercise the page does not give away and whose markers are the ones in the learner's copy, the
history of the course's development kept out of the lessons (in the lab notebook, one page per stage),
and the setup page's CPU-only install the same as the README's. No GPU, no browser: see test_docs.py
for the site's build and its pages in Chromium.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STAGE_DIRS = sorted((d for d in (ROOT / "stages").glob("stage*_*") if d.is_dir() and re.fullmatch(r"stage\d+_\w+", d.name)),
                    key=lambda d: int(re.match(r"stage(\d+)", d.name)[1]))


def number(stage_dir: Path) -> int:
    return int(re.match(r"stage(\d+)", stage_dir.name)[1])


def lesson(stage_dir: Path) -> Path:
    return ROOT / "docs" / "stages" / f"stage{number(stage_dir)}.md"


def notebook(stage_dir: Path) -> Path:
    return ROOT / "docs" / "notebook" / f"stage{number(stage_dir)}.md"


def h2_sections(markdown: str) -> dict[str, str]:
    """The lesson's `## ` sections, heading -> text, outside fenced code."""
    sections, name = {}, None
    fenced = False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced and line.startswith("## "):
            name = line[3:].strip()
            sections[name] = ""
        elif name is not None:
            sections[name] += line + "\n"
    return sections


# ---------------------------------------------------------------- words of how the course was built

BANNED = re.compile(r"\b(sessions?|lent|scratch)\b|the device tool", re.IGNORECASE)
TEXT_SUFFIXES = {".md", ".py", ".cu", ".cuh", ".css", ".svg", ".yml", ".yaml", ".txt", ".json", ".sh", ".html"}


def scanned_files() -> list[Path]:
    """docs/, results/NOTES.md and every source file under stages/."""
    files = [p for p in (ROOT / "docs").rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES]
    files += [p for p in (ROOT / "stages").rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES
              and "__pycache__" not in p.parts]
    return sorted(files) + [ROOT / "results" / "NOTES.md"]


def banned_lines(path: Path) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{i}: {line.strip()[:120]}"
            for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if BANNED.search(line)]


def test_no_words_of_how_the_course_was_built():
    """"session", "lent", "scratch" and "the device tool" are words of the course's making, not of the
    course: a lesson says what was measured, where and at which commit, and a date."""
    found = [line for path in scanned_files() for line in banned_lines(path)]
    assert not found, "reword these lines (a date and a commit say when):\n" + "\n".join(found)


def test_the_scan_for_those_words():
    assert BANNED.search("A/B on the H100, session of 2026-11-24") and BANNED.search("the lent H100")
    assert BANNED.search("`scratch` variants") and BANNED.search("Sessions 3 and 4") and BANNED.search("via the device tool")
    assert not BANNED.search("silent, equivalent, prevalent, excellent: a scratchpad-free line")


# ---------------------------------------------------------------- words of the workshop, and its notes
# The course names what it speaks of: "the 32-expert layer", "the stage's bar", "the first benchmark
# shape", not the ticket or the specification it came from ("issue 7's second half", "the seed's
# shape", "the specification's"). And what it cites, a reader can open: a lesson's lab notebook
# (docs/notebook/), not results/NOTES.md, the repository's running log, which is not on the site.
# The kernels' and launch modules' comments included: the site shows them in the lessons' listings.

WORKSHOP = re.compile(
    r"\bissues?\s*#\s*\d+"                          # "issue #7"
    r"|\bissues?\s+\d+\b(?!\s+[a-z])"               # "issue 7's", "(issue 7)", "Issue 7:"; not "issue 4 wgmmas"
    r"|\bissues?\s+\d+\s+(?:and|or|to)\s+\d+"       # "issues 7 and 8"
    r"|\bthe issue's\b|\bof the issue\b"            # "the bar", "the shapes of the issue"
    r"|\bseed's\b|\bseed\s+configurations?\b"       # the MoE layer by the name of its configuration
    r"|\bspecification's\b",
    re.IGNORECASE)
NOTES = re.compile(r"\bNOTES(?:\.md\b|,?\s+(?:\d|entr))")  # results/NOTES.md, "NOTES 7", "NOTES, entry 7"
WORKSHOP_SCANNED = ("docs", "grader", "reference", "stages")


def workshop_files(folders=WORKSHOP_SCANNED) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*")
                  if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts)


def workshop_lines(path: Path) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{i}: {line.strip()[:120]}"
            for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
            if WORKSHOP.search(line) or NOTES.search(line)]


def test_no_words_of_the_workshop_and_no_citations_of_its_notes():
    found = [line for path in workshop_files() for line in workshop_lines(path)]
    assert not found, ("say what it is (the 32-expert layer, the stage's bar, the first benchmark shape) and cite "
                       "the lesson's lab notebook, docs/notebook/stageN.md, not results/NOTES.md:\n" + "\n".join(found))


def test_the_scan_for_the_workshops_words():
    for text in ("issue 7's second half", "(issue 7)", "Issue 7: small launches", "issue #7", "issues 7 and 8",
                 "the three shapes of the issue", "The issue's bars", "the seed's shape", "the seed configuration",
                 "Seed configurations", "the specification's tiny shapes"):
        assert WORKSHOP.search(text), text
    for text in ("issue 4 wgmmas per stage", "one thread issues 2 copies", "the issue slots", "warps stall at issue",
                 "seed 0", "--seed N", "`--config seed`", "ten seeds of two of them", "a seeded generator"):
        assert not WORKSHOP.search(text), text
    for text in ("see `results/NOTES.md`", "(NOTES 7)", "NOTES.md, entries 7 and 8", "NOTES, entry 7"):
        assert NOTES.search(text), text
    assert not NOTES.search("the notes under the table") and not NOTES.search("Notes: 14 shapes")


# ---------------------------------------------------------------- one shape for every lesson

SHAPE = ["The idea", "The code", "The exercise", "Results", "What each technique bought", "What to try next",
         "Further reading"]
OPTIONAL_FIRST = "The problem"
WORDS_BAR = 3500


def words(markdown: str) -> int:
    """Words of the lesson's body: the Markdown's whitespace-separated words (`wc -w`), its hand-drawn
    diagrams (inline <svg> ... </svg>) left out."""
    return len(re.sub(r"<svg.*?</svg>", " ", markdown, flags=re.S).split())


@pytest.mark.parametrize("stage_dir", STAGE_DIRS, ids=lambda d: d.name)
def test_every_lesson_has_the_one_shape(stage_dir):
    """The idea, the code, the exercise, the measured result, what each technique bought, what to try
    next, further reading: in this order, and nothing else at the top level (the problem may come first)."""
    headings = list(h2_sections(lesson(stage_dir).read_text()))
    if headings and headings[0] == OPTIONAL_FIRST:
        headings = headings[1:]
    found = [next((s for s in SHAPE if h == s or h.startswith(s + ":")), h) for h in headings]
    assert found == SHAPE, f"{lesson(stage_dir).relative_to(ROOT)}: its ## sections are {headings}, not {SHAPE}"


@pytest.mark.parametrize("stage_dir", STAGE_DIRS, ids=lambda d: d.name)
def test_a_lesson_is_short_enough_to_read(stage_dir):
    n = words(lesson(stage_dir).read_text())
    assert n <= WORDS_BAR, f"{lesson(stage_dir).relative_to(ROOT)}: {n} words; move history to the lab notebook"


@pytest.mark.parametrize("stage_dir", STAGE_DIRS, ids=lambda d: d.name)
def test_one_current_table_of_what_each_technique_bought(stage_dir):
    section = h2_sections(lesson(stage_dir).read_text()).get("What each technique bought", "")
    header = next((line for line in section.splitlines() if line.startswith("|")), "")
    cells = [c.strip().lower() for c in header.strip("|").split("|")]
    assert cells[:4] == ["technique", "predicted", "measured", "commit"], (
        f"{lesson(stage_dir).relative_to(ROOT)}: no table | Technique | Predicted | Measured | Commit |")


@pytest.mark.parametrize("stage_dir", STAGE_DIRS, ids=lambda d: d.name)
def test_the_lesson_ends_with_its_lab_notebook(stage_dir):
    """The history of a stage (variants tried and not kept, earlier profiles, run-to-run notes) has a
    page of its own, each entry dated by date and commit, linked at the lesson's end."""
    page = notebook(stage_dir)
    assert page.is_file(), f"no lab notebook for {stage_dir.name}: docs/notebook/{page.name}"
    reading = h2_sections(lesson(stage_dir).read_text())["Further reading"]
    assert f"../notebook/{page.name}" in reading, f"{lesson(stage_dir).relative_to(ROOT)} does not link its notebook at its end"
    entries = re.findall(r"^## (.+)$", page.read_text(), re.M)
    assert entries, f"{page.relative_to(ROOT)} has no entries"
    undated = [e for e in entries if not re.search(r"\d{4}-\d{2}-\d{2}", e) or not re.search(r"`[0-9a-f]{7,}`", e)]
    assert not undated, f"{page.relative_to(ROOT)}: entries without a date and a commit: {undated}"


def test_the_notebook_pages_are_in_the_nav():
    """docs/hooks/course.py fills the nav's "Lab notebook" section with one page per stage."""
    import importlib.util
    import sys
    import types

    import yaml

    spec = importlib.util.spec_from_file_location("course_hook_nav", ROOT / "docs" / "hooks" / "course.py")
    hook = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = hook
    spec.loader.exec_module(hook)
    class Loader(yaml.SafeLoader):  # mkdocs.yml's own tags (!relative) read as nothing
        pass
    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    nav = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)
    config = hook.on_config(types.SimpleNamespace(nav=nav["nav"]))
    notebook_pages = next(e["Lab notebook"] for e in config.nav if isinstance(e, dict) and "Lab notebook" in e)
    listed = [page for entry in notebook_pages for page in entry.values()]
    assert listed[0] == "notebook/grading.md"
    for d in STAGE_DIRS:
        assert f"notebook/stage{number(d)}.md" in listed, f"docs/notebook/stage{number(d)}.md is not in the nav"


# ---------------------------------------------------------------- the exercise

def exercise_copy(stage_dir: Path) -> str | None:
    """What `python -m grader init` writes for the stage (grader/exercise.py), or None without markers."""
    from grader.exercise import count_exercises, make_exercise
    import stages
    source = stages.load(stage_dir.name).source_path.read_text()
    return make_exercise(source) if count_exercises(source) else None


@pytest.mark.parametrize("stage_dir", STAGE_DIRS, ids=lambda d: d.name)
def test_the_exercise_names_the_copys_markers(stage_dir):
    """The exercise section tells how to get the copy, and names the marker the copy has: grader init
    turns `// EXERCISE:` into `// TODO(exercise):`, so a lesson that says `EXERCISE` sends the learner
    looking for a word that is not in their file."""
    pytest.importorskip("torch")
    copy = exercise_copy(stage_dir)
    assert copy is not None, f"{stage_dir.name} has no EXERCISE markers: grader init writes no copy"
    marker = re.search(r"// (TODO\(exercise\))", copy)[1]
    section = h2_sections(lesson(stage_dir).read_text())["The exercise"]
    assert f"grader init stage{number(stage_dir)}" in section
    assert f"`{marker}`" in section, f"{lesson(stage_dir).relative_to(ROOT)}: the exercise does not name `{marker}`"
    assert not re.search(r"\bEXERCISE\b", section), (
        f"{lesson(stage_dir).relative_to(ROOT)}: the learner's copy has no `EXERCISE` marker, it has `{marker}`")


SNIPPET = re.compile(r'^(?P<indent>[ \t]*)--8<-- "(?P<spec>[^"]+)"', re.M)


def snippet_lines(spec: str) -> list[str]:
    """What pymdownx.snippets includes for "path", "path:section" or "path:first:last"."""
    path, *rest = spec.split(":")
    lines = (ROOT / path).read_text().splitlines()
    if not rest:
        return lines
    if len(rest) == 2:
        return lines[int(rest[0]) - 1:int(rest[1])]
    inside, out = False, []
    for line in lines:
        if f"[start:{rest[0]}]" in line:
            inside = True
        elif f"[end:{rest[0]}]" in line:
            inside = False
        elif inside:
            out.append(line)
    return out


def open_listings_with_the_solution(markdown: str) -> list[str]:
    """Snippet includes that show an exercise's solution (the lines between `// EXERCISE` and `// END
    EXERCISE`) without a click: outside a collapsed `??? ` block."""
    found, lines = [], markdown.splitlines()
    for m in SNIPPET.finditer(markdown):
        if not any(re.match(r"\s*// EXERCISE", line) for line in snippet_lines(m["spec"])):
            continue
        row = markdown[:m.start()].count("\n")
        indent = len(m["indent"].expandtabs(4))
        opener = next((line for line in reversed(lines[:row]) if line.strip() and len(line) - len(line.lstrip()) < indent), "")
        if not opener.lstrip().startswith("??? "):  # "???+" opens the block: the solution on show
            found.append(m["spec"])
    return found


@pytest.mark.parametrize("stage_dir", STAGE_DIRS, ids=lambda d: d.name)
def test_the_listing_does_not_give_the_exercise_away(stage_dir):
    shown = open_listings_with_the_solution(lesson(stage_dir).read_text())
    assert not shown, f"{lesson(stage_dir).relative_to(ROOT)} shows the solution of its exercise openly: {shown}"


def test_the_check_for_an_open_solution():
    spoiler = '```cuda\n--8<-- "stages/stage0_naive/attention.cu:softmax"\n```\n'
    assert open_listings_with_the_solution(spoiler) == ["stages/stage0_naive/attention.cu:softmax"]
    folded = '??? example "The solution"\n\n    ```cuda\n    --8<-- "stages/stage0_naive/attention.cu:softmax"\n    ```\n'
    assert open_listings_with_the_solution(folded) == []
    assert open_listings_with_the_solution(folded.replace("??? ", "???+ ")) != []
    assert open_listings_with_the_solution('```cuda\n--8<-- "stages/stage0_naive/attention.cu:scores"\n```\n') == []


# ---------------------------------------------------------------- the setup page

CPU_BLOCK = re.compile(r"<!-- ci: cpu-install -->\s*\n```bash\n(.*?)```", re.S)


def test_the_setup_page_shows_the_readmes_cpu_install():
    """A laptop without a GPU must not pull the CUDA wheels: the site shows the README's CPU-only
    install, the block CI runs, as it is (only the block: the README's test command may change)."""
    readme = CPU_BLOCK.search((ROOT / "README.md").read_text())
    setup = CPU_BLOCK.search((ROOT / "docs" / "setup.md").read_text())
    assert readme, "README.md has no <!-- ci: cpu-install --> block"
    assert setup, "docs/setup.md has no <!-- ci: cpu-install --> block"
    assert setup[1] == readme[1], f"docs/setup.md's CPU install differs from README.md's:\n{setup[1]}\n---\n{readme[1]}"
