"""Per-slot caches and the ragged batched forward of the native runtime (SupportsBatchRows).

Each row of a ``forward_rows`` call must get bitwise the logits it gets alone: the C
kernels run every linear once over all rows of all sequences, so this holds only if a
(weight row, token row) pair's sum never depends on the other token rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from speculative.models.base import RowInput, SupportsBatchRows
from speculative.models.native import NativeLlama, load_native
from speculative.models.session import tree_attention
from test_native import _ids, _tiny_llama, require_kernels


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_rows")
    _tiny_llama(path, layers=2)
    return path


def _rows_script() -> list[list[tuple[list[int], list[int] | None]]]:
    """Three sequences over five calls: (tokens, tree parents or None) per sequence.

    Different prompt lengths (cache lengths), block sizes 1..11, a token tree (the first
    token its root, then nodes with parents, -1 = the root), and calls where several
    sequences decode one row each (their attention shares one work-sharing loop)."""
    a, b, c = _ids(40, 21)[0].tolist(), _ids(40, 22)[0].tolist(), _ids(40, 23)[0].tolist()
    return [
        [(a[:3], None), (b[:11], None), (c[:1], None)],  # prefills of different lengths
        [(a[3:8], None), (b[11:12], None), (c[1:10], None)],
        [(a[8:9], None), (b[12:16], [-1, -1, 0]), (c[10:14], None)],  # b: a tree
        [(a[9:10], None), (b[16:17], None), (c[14:15], None)],  # decode rows: one shared loop
        [(a[10:11], None), (b[17:20], None), (c[15:16], None)],  # two decode rows and a block
    ]


def _row_input(slot: int, length: int, tokens: list[int], parents: list[int] | None) -> RowInput:
    ids = torch.tensor(tokens, dtype=torch.long)  # [k]
    if parents is None:
        return RowInput(slot, ids)
    mask, offsets = tree_attention(parents, 1)  # [k, k], [k]
    return RowInput(slot, ids, mask, length + offsets)


def _run(model: NativeLlama, together: bool) -> list[list[torch.Tensor]]:
    """Logits per call and sequence; rows in one forward_rows call, or one call each."""
    slots = [model.acquire_slot() for _ in range(3)]
    outputs = []
    for step in _rows_script():
        rows = [
            _row_input(slot, model.slot_length(slot), tokens, parents)
            for slot, (tokens, parents) in zip(slots, step, strict=True)
        ]
        if together:
            outputs.append(model.forward_rows(rows))
        else:
            outputs.append([model.forward_rows([row])[0] for row in rows])
    return outputs


@pytest.mark.parametrize(
    ("backend", "precision"),
    [("kernels", "fp32"), ("kernels", "int4"), ("kernels", "bf16"), ("torch", "fp32")],
)
def test_row_in_a_batch_equals_row_alone(folder: Path, backend: str, precision: str) -> None:
    if backend == "kernels":
        require_kernels()
    batched = load_native(folder, precision, max_length=64, backend=backend)
    alone = load_native(folder, precision, max_length=64, backend=backend)
    assert isinstance(batched, SupportsBatchRows)
    for step_b, step_a in zip(_run(batched, True), _run(alone, False), strict=True):
        for row_b, row_a in zip(step_b, step_a, strict=True):
            assert torch.equal(row_b, row_a)


def test_rows_match_the_single_sequence_forward(folder: Path) -> None:
    """A slot continues exactly like the single-sequence cache (forward + rollback)."""
    require_kernels()
    model = load_native(folder, max_length=64, backend="kernels")
    single = load_native(folder, max_length=64, backend="kernels")
    ids = _ids(20, 31)
    slot = model.acquire_slot()
    first = model.forward_rows([RowInput(slot, ids[0, :12])])[0]
    assert torch.equal(first, single.forward(ids[:, :12])[0])
    model.rollback_slot(slot, 4)
    single.rollback(4)
    again = model.forward_rows([RowInput(slot, ids[0, 8:20])])[0]
    assert torch.equal(again, single.forward(ids[:, 8:20])[0])
    assert model.slot_length(slot) == 20


def test_kernels_batch_matches_torch_reference(folder: Path) -> None:
    require_kernels()
    kernels = _run(load_native(folder, max_length=64, backend="kernels"), True)
    reference = _run(load_native(folder, max_length=64, backend="torch"), False)
    for step_k, step_r in zip(kernels, reference, strict=True):
        for row_k, row_r in zip(step_k, step_r, strict=True):
            torch.testing.assert_close(row_k, row_r, atol=1e-4, rtol=1e-4)


def test_a_misassigned_slot_is_detected(folder: Path) -> None:
    """Negative control: feeding one sequence's continuation into another's slot changes
    its logits, so the equality tests above would catch a slot mix-up."""
    require_kernels()
    model = load_native(folder, max_length=64, backend="kernels")
    a, b = model.acquire_slot(), model.acquire_slot()
    ids_a, ids_b = _ids(10, 41)[0], _ids(10, 42)[0]
    model.forward_rows([RowInput(a, ids_a[:6]), RowInput(b, ids_b[:6])])
    right = model.forward_rows([RowInput(a, ids_a[6:8]), RowInput(b, ids_b[6:8])])
    model.rollback_slot(a, 2)
    model.rollback_slot(b, 2)
    swapped = model.forward_rows([RowInput(b, ids_a[6:8]), RowInput(a, ids_b[6:8])])
    assert not torch.equal(right[0], swapped[1])
    assert not torch.equal(right[1], swapped[0])


def test_slots_are_owned_and_freed(folder: Path) -> None:
    model = load_native(folder, max_length=32, backend="torch", max_slots=2)
    a, b = model.acquire_slot(), model.acquire_slot()
    with pytest.raises(ValueError, match="no free cache slot"):
        model.acquire_slot()
    model.forward_rows([RowInput(a, torch.tensor([1, 2, 3]))])
    with pytest.raises(ValueError, match="held by a batch row"):
        model.forward(torch.tensor([[1, 2]]))  # the single-sequence cache is slot 0 = a
    with pytest.raises(ValueError, match="twice"):
        model.forward_rows([RowInput(b, torch.tensor([1])), RowInput(b, torch.tensor([2]))])
    with pytest.raises(ValueError, match="cache overflow"):
        model.forward_rows([RowInput(a, torch.zeros(30, dtype=torch.long))])
    model.release_slot(a)
    with pytest.raises(ValueError, match="not acquired"):
        model.slot_length(a)
    assert model.acquire_slot() == a and model.slot_length(a) == 0


@pytest.mark.parametrize(("backend", "precision"), [("kernels", "int4"), ("torch", "fp32")])
def test_rows_skip_the_logits_they_do_not_ask_for(
    folder: Path, backend: str, precision: str
) -> None:
    """``RowInput.logits_from``: each row's logits are bitwise the tail of its full logits,
    its features and its cache are the same (the next call's logits equal), the fused
    argmax follows the kept rows, and the single-sequence ``forward_from`` agrees."""
    if backend == "kernels":
        require_kernels()
    full = load_native(folder, precision, max_length=64, backend=backend)
    part = load_native(folder, precision, max_length=64, backend=backend)
    ids = [_ids(30, 51 + i)[0] for i in range(3)]
    froms = [6, 0, 11]  # a prefill wanting its last row only, every row, a longer prefill
    slots = [(full.acquire_slot(), part.acquire_slot()) for _ in ids]
    every = full.forward_rows_with_hidden(
        [RowInput(f, t[:12]) for (f, _), t in zip(slots, ids, strict=True)]
    )
    rows = [RowInput(p, t[: 7 if n == 6 else 12], logits_from=n)
            for (_, p), t, n in zip(slots, ids, froms, strict=True)]  # fmt: skip
    full.rollback_slot(slots[0][0], 5)  # the first row fed 7 tokens, not 12
    asked = part.forward_rows_with_hidden(rows)
    asked_features = asked[1].split([row.input_ids.numel() for row in rows])
    every_features = every[1].split(12)
    for logits, features, want_logits, want_features, n, row in zip(
        asked[0], asked_features, every[0], every_features, froms, rows, strict=True
    ):
        k = row.input_ids.numel()
        assert logits.shape[0] == k - n
        assert torch.equal(logits, want_logits[n:k]) and torch.equal(features, want_features[:k])
    if backend == "kernels":  # the argmax the kernels took is each row's kept logits' own
        for logits in asked[0]:
            assert part.argmax_rows(logits) == logits.argmax(-1).tolist()
    nexts = [RowInput(f, t[12:14]) for (f, _), t in zip(slots, ids, strict=True)]
    nexts[0] = RowInput(slots[0][0], ids[0][7:9])
    after_full = full.forward_rows(nexts)
    after_part = part.forward_rows([RowInput(p, r.input_ids)
                                    for (_, p), r in zip(slots, nexts, strict=True)])  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(after_part, after_full, strict=True))
    single = load_native(folder, precision, max_length=64, backend=backend)
    logits, features = single.forward_from(ids[2][None, :12], 11, hidden=True)
    assert torch.equal(logits[0], every[0][2][11:12]) and torch.equal(
        features[0], every_features[2]
    )
    with pytest.raises(ValueError, match="logits_from"):
        part.forward_rows([RowInput(slots[1][1], ids[1][14:16], logits_from=2)])


@pytest.mark.parametrize("backend", ["kernels", "torch"])
def test_single_sequence_tree_compaction_leaves_the_rows_slots_alone(
    folder: Path, backend: str
) -> None:
    """The single-sequence cache (slot 0, ``forward``) compacts a verified tree path while
    a batch row holds slot 1: the row's next logits are bitwise those of the same row on
    a model where nothing else ran. Control: the same compaction applied to every slot of
    the cache (what the single sequence once did) changes them."""
    if backend == "kernels":
        require_kernels()
    ids, row_ids = _ids(20, 51), _ids(20, 52)[0]

    def row_after_compaction(compact) -> torch.Tensor:
        model = load_native(folder, max_length=64, backend=backend)
        model.forward(ids[:, :6])  # the single sequence holds slot 0
        slot = model.acquire_slot()
        model.forward_rows([RowInput(slot, row_ids[:8])])
        if compact is not None:
            mask, offsets = tree_attention([-1, -1, 0], 1)  # a root and two branches
            model.forward_tree(ids[:, 6:10], mask, 6 + offsets)
            compact(model)
        return model.forward_rows([RowInput(slot, row_ids[8:10])])[0]

    want = row_after_compaction(None)
    got = row_after_compaction(lambda m: m.keep_slots(6, [6, 8]))  # root, second branch
    assert torch.equal(got, want)
    every_slot = row_after_compaction(lambda m: m.decoder.keep_slots(6, [6, 8]))
    assert not torch.equal(every_slot, want)
