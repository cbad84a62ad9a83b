"""The wrong kernels of tests/mutations.py still apply to today's sources (on the CPU, so that CI fails the
day a kernel change orphans one): each mutation's text occurs exactly once in its stage's kernel, the
mutated kernel still compiles (the GPU test must find it wrong, not fail to build it), and the cases it
must fail exist."""
import re

import pytest

import reference
import stages
from conftest import compiles_as_graded
from mutations import MUTATIONS, Mutation, mutate


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_every_mutation_applies_exactly_once_and_compiles(name, tmp_path):
    stage, path = mutate(name, tmp_path)  # asserts each text occurs once
    assert path.read_text() != stage.source_path.read_text()
    assert compiles_as_graded(stage, path, max(stage.archs)).path.is_file()


@pytest.mark.parametrize("name", [n for n, m in MUTATIONS.items() if m.cases is not None])
def test_the_cases_a_mutation_must_fail_exist(name):
    mutation = MUTATIONS[name]
    problem = reference.load(stages.load(mutation.stage).problem)
    assert any(re.search(mutation.cases, case.name) for case in problem.cases(0)), mutation.cases


def test_an_orphaned_mutation_is_caught(tmp_path, monkeypatch):
    monkeypatch.setitem(MUTATIONS, "gone", Mutation("stage0", (("no such text", "x"),), None))
    with pytest.raises(AssertionError, match="no longer in attention.cu once"):
        mutate("gone", tmp_path)


def test_the_wrong_rank_tests_traffic_goes_through_pytorchs_regroup():
    """The GPU test of "row_from_wrong_rank" compares the kernel with PyTorch's regroup on traffic built
    here: built and regrouped on the CPU, every grouped row is a received row, each once."""
    import torch

    from mutations import regroup_in_pytorch, regroup_piece

    piece = regroup_piece(8, 4, "cpu")
    offsets, source_row, grouped_row = regroup_in_pytorch(piece)
    assert int(offsets[-1]) == piece.grouped_rows == piece.received_rows
    assert torch.equal(source_row.sort().values.long(), torch.arange(piece.received_rows))
    assert torch.equal(grouped_row.sort().values.long(), torch.arange(piece.received_rows))
