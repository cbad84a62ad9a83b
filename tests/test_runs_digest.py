"""A record keyed on what runs (grader/runs_digest.py): it stays current across a change that leaves the
machine code of the stage's variants and its launch as they were, and only then.

The kernel's edits are made on a copy of stage 5's routing.cu (two variants, quick to compile; the copy
finds the shared headers as the stage's own file does); the launch's on a copy of its __init__.py, put in
the stage's sources in place of its own. The stage's own cubins are those the other tests compile."""
import dataclasses
import json

import pytest

import stages
from grader import results, runs_digest, sass
from stages.common.compiler import nvrtc_version

STAGE = stages.load("stage5_moe_routing")
ARCH = "sm_90a"
LAUNCH = STAGE.folder / "__init__.py"


@pytest.fixture(scope="module")
def record() -> dict:
    """An entry of the stage as it is, with its runs digest for this NVRTC version."""
    return {"source_sha256": results.source_digest(STAGE), "arch": ARCH,
            "runs_digest": {nvrtc_version(): runs_digest.runs_digest(STAGE, ARCH)}}


@pytest.fixture(scope="module")
def commented(tmp_path_factory):
    """The kernel with a comment reworded, and one added: compiled once for the tests that use it."""
    return edited(STAGE.source_path, tmp_path_factory.mktemp("commented"), "// (v, e) ranks above (v2, e2)",
                  "// Whether (v, e) goes before (v2, e2) in the top k:\n// (v, e) ranks above (v2, e2)")


def edited(path, tmp_path, old: str, new: str):
    """A copy of `path` in tmp_path with `old` (which it holds) replaced by `new`."""
    text = path.read_text()
    assert old in text, f"{path.name} no longer holds {old!r}: pick another edit"
    copy = tmp_path / path.name
    copy.write_text(text.replace(old, new))
    return copy


def with_launch(monkeypatch, copy) -> None:
    """The stage's sources with `copy` in place of its launch module, as if that had been edited so."""
    own = results.source_files
    monkeypatch.setattr(results, "source_files",
                        lambda *args, **kwargs: [copy if path == LAUNCH else path for path in own(*args, **kwargs)])


def test_a_comment_in_the_kernel_leaves_its_record_current(record, commented):
    assert results.source_digest(STAGE, commented) != record["source_sha256"]
    assert runs_digest.is_current(record, STAGE, commented)


def test_a_changed_instruction_stales_the_record(record, tmp_path, monkeypatch):
    monkeypatch.setattr(runs_digest, "FRESH_DRAWS", 0)  # no compiles in new processes: they have their own test
    kernel = edited(STAGE.source_path, tmp_path, "(v == v2 && e < e2)", "(v == v2 && e > e2)")
    assert not runs_digest.is_current(record, STAGE, kernel)


def test_other_machine_code_from_one_compile_is_compiled_again(record, commented, monkeypatch):
    """A variant that came out as other machine code (NVRTC's other draw; here the cached cubin is said to
    be one) is compiled again in a new process, where the entry's comes out."""
    drawn = next(iter(runs_digest.compile_stage(STAGE, commented, ARCH).values())).path
    digest = sass.code_digest
    monkeypatch.setattr(sass, "code_digest", lambda cubin: "another draw" if cubin.path == drawn else digest(cubin))
    assert runs_digest.is_current(record, STAGE, commented)


def test_a_docstring_or_comment_in_the_launch_leaves_its_record_current(record, tmp_path, monkeypatch):
    launch = edited(LAUNCH, tmp_path, '    """Top-k, counts, padded offsets, the permutation',
                    '    # The routing before the experts.\n    """Top-k, the counts, the padded offsets, the permutation')
    with_launch(monkeypatch, launch)
    assert results.source_digest(STAGE) != record["source_sha256"]
    assert runs_digest.is_current(record, STAGE)


def test_a_shape_to_time_at_leaves_its_record_current(record, tmp_path, monkeypatch):
    """Shapes added to the Stage's extra_benchmarks (a name imported and one assigned for them) change
    where it is timed, not what runs."""
    launch = edited(LAUNCH, tmp_path, "STAGE = Stage(",
                    "from stages.common.prompts import SHORT_PROMPTS\nMORE = (dict(B=1),)\n"
                    "STAGE = Stage(\n    extra_benchmarks=MORE + SHORT_PROMPTS,")
    with monkeypatch.context() as patch:
        with_launch(patch, launch)
        assert runs_digest.is_current(record, STAGE)
    (tmp_path / "used").mkdir()
    with_launch(monkeypatch, edited(launch, tmp_path / "used", "\nSTAGE = Stage(", "\nprint(MORE)\nSTAGE = Stage("))
    assert not runs_digest.is_current(record, STAGE)  # MORE is used by the launch too: that is code


@pytest.mark.parametrize("old,new", [('"MAX_TOP_K": MAX_TOP_K}', '"MAX_TOP_K": MAX_TOP_K - 1}'),
                                     ("SCATTER_THREADS = 256", "SCATTER_THREADS = 128"),
                                     ("min(128, 32 * ", "min(256, 32 * ")],
                         ids=["in-geometry", "a-block-size", "in-the-launch-code"])
def test_a_changed_constant_of_the_launch_stales_the_record(record, tmp_path, monkeypatch, old, new):
    with_launch(monkeypatch, edited(LAUNCH, tmp_path, old, new))
    assert not runs_digest.is_current(record, STAGE)


def test_a_changed_geometry_stales_the_record(record, monkeypatch):
    wider = dataclasses.replace(STAGE, geometry=lambda defines: {**STAGE.geometry(defines), "TOPK_THREADS": 512})
    monkeypatch.setattr(results, "source_digest", lambda *args: "other sources")
    assert not runs_digest.is_current(record, wider)


def test_a_runs_digest_of_another_nvrtc_version_falls_back_to_the_sources(record, commented):
    elsewhere = dict(record, runs_digest={"0.1": record["runs_digest"][nvrtc_version()]})
    assert runs_digest.is_current(elsewhere, STAGE)  # the same sources
    assert not runs_digest.is_current(elsewhere, STAGE, commented)  # others, and no digest of this NVRTC


def test_rekey_keys_the_entries_of_the_tree_s_sources_only(record, tmp_path):
    """An entry of the sources as they are gets this NVRTC's digest beside another version's; one marked
    stale, or of other sources, is left as it was."""
    elsewhere = {"0.1": {"launch": "l", "machine_code": {}}}
    entries = {STAGE.key: {"source_sha256": record["source_sha256"], "arch": ARCH, "runs_digest": elsewhere},
               "stage0_naive": {"source_sha256": "older sources", "arch": ARCH},
               "stage1_tiled": {"source_sha256": results.source_digest(stages.load("stage1")), "arch": ARCH,
                                "stale": "measured on older sources"}}
    path = tmp_path / "gpu.json"
    results.save(path, {"gpu": "G", "stages": entries})
    runs_digest.rekey(path)
    written = json.loads(path.read_text())["stages"]
    assert written[STAGE.key]["runs_digest"] == {**elsewhere, **record["runs_digest"]}
    assert written["stage0_naive"] == entries["stage0_naive"] and written["stage1_tiled"] == entries["stage1_tiled"]
