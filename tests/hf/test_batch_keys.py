"""What ``causal_lm_loss`` does with each batch key: HF's pre-shifted ``shift_labels`` give the
same loss as the unshifted ``labels`` they come from (any mask, left or right padding),
only the documented keys reach the model, and ids outside the vocabulary or of a float
dtype are a :class:`gradstep.hf.BatchError` naming the key instead of torch's IndexError."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("transformers")

from gradstep.errors import GradstepError  # noqa: E402
from gradstep.hf import (  # noqa: E402
    FORWARDED_KEYS,
    BatchError,
    causal_lm_loss,
    causal_lm_targets,
    count_tokens,
)
from tests.hf.helpers import IGNORE, VOCAB, hf_batch, llama  # noqa: E402

MODEL = llama()


def hf_shift(labels: torch.Tensor) -> torch.Tensor:
    """HF's own shift (``ForCausalLMLoss``): pad one -100 column, drop the first."""
    padded = torch.nn.functional.pad(labels, (0, 1), value=IGNORE)
    return padded[:, 1:].contiguous()


def expected_count(labels: torch.Tensor, mask: torch.Tensor) -> int:
    """Targets counted the plain way: position t predicts label t+1 when both are real."""
    n = 0
    for row, m in zip(labels.tolist(), mask.tolist(), strict=True):
        for t in range(len(row) - 1):
            n += row[t + 1] != IGNORE and m[t] == 1 and m[t + 1] == 1
    return n


@st.composite
def padded_batches(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    """Rows of real tokens padded left, right, or holed anywhere; labels with some -100
    and arbitrary ids at padding (a collator that does not mask them)."""
    rows, width = draw(st.integers(1, 3)), draw(st.integers(1, 9))
    ids, mask, labels = [], [], []
    for _ in range(rows):
        real = draw(st.integers(0, width))
        kind = draw(st.sampled_from(["right", "left", "any"]))
        if kind == "any":
            m = draw(st.lists(st.integers(0, 1), min_size=width, max_size=width))
        else:
            m = [1] * real + [0] * (width - real)
            m = m if kind == "right" else m[::-1]
        tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=width, max_size=width))
        lab = [t if draw(st.integers(0, 4)) else IGNORE for t in tokens]
        ids.append(tokens), mask.append(m), labels.append(lab)
    return {
        "input_ids": torch.tensor(ids),
        "attention_mask": torch.tensor(mask),
        "labels": torch.tensor(labels),
    }


@given(batch=padded_batches())
def test_shift_labels_give_the_same_loss_as_the_labels_they_come_from(batch: dict) -> None:
    shifted = {**batch, "shift_labels": hf_shift(batch["labels"])}
    del shifted["labels"]
    aligned = {**batch, "labels": hf_shift(batch["labels"])}
    want = expected_count(batch["labels"], batch["attention_mask"])
    with torch.no_grad():
        ref = causal_lm_loss(MODEL, batch)
        for other, flag in ((shifted, False), (aligned, True)):
            got = causal_lm_loss(MODEL, other, shifted=flag)
            assert int(got.count) == int(ref.count) == want
            assert count_tokens(other, shifted=flag) == want
            assert torch.equal(got.total, ref.total)
    # Both keys present: shift_labels win, as in HF's loss (labels garbage here).
    both = {**shifted, "labels": torch.full_like(batch["labels"], 7)}
    assert count_tokens(both) == want


def test_shift_labels_last_column_counts_when_its_position_is_real() -> None:
    """Pre-shifted labels may hold the token after the batch (streamed data): the last
    position's target is used when that position is real."""
    ids = torch.tensor([[5, 6, 7]])
    shift = torch.tensor([[6, 7, 8]])
    assert count_tokens({"input_ids": ids, "shift_labels": shift}) == 3
    masked = {"input_ids": ids, "shift_labels": shift, "attention_mask": torch.tensor([[1, 1, 0]])}
    assert causal_lm_targets(masked).tolist() == [[6, -100, -100]]


def test_only_the_documented_keys_reach_the_model() -> None:
    seen: dict = {}
    forward = MODEL.forward

    def spy(**kwargs):  # noqa: ANN003, ANN202
        seen.update(kwargs)
        return forward(**kwargs)

    batch = hf_batch([torch.tensor([1, 2, 3]), torch.tensor([4, 5])], pad="left")
    batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
    batch["shift_labels"] = hf_shift(batch["labels"])
    batch["length"] = torch.tensor([[3], [2]])  # a collator's extra key
    MODEL.forward = spy
    try:
        causal_lm_loss(MODEL, batch)
    finally:
        del MODEL.forward
    assert set(seen) == set(FORWARDED_KEYS) | {"use_cache"}
    assert seen["use_cache"] is False
    # Left padding: positions counted over real tokens.
    assert seen["position_ids"].tolist() == [[0, 1, 2], [0, 0, 1]]


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("labels", 999, f"[0, {VOCAB})"),
        ("labels", -5, f"[0, {VOCAB})"),
        ("shift_labels", VOCAB, f"[0, {VOCAB})"),
        ("input_ids", VOCAB + 44, f"[0, {VOCAB})"),
    ],
)
def test_ids_outside_the_vocabulary_name_the_key(key: str, value: int, allowed: str) -> None:
    batch = hf_batch([torch.tensor([1, 2, 3, 4])])
    if key == "shift_labels":
        batch["shift_labels"] = hf_shift(batch["labels"])
    batch[key][0, 2] = value
    with pytest.raises(BatchError) as info:
        causal_lm_loss(MODEL, batch)
    message = str(info.value)
    assert f"batch[{key!r}]" in message and str(value) in message and allowed in message
    assert isinstance(info.value, GradstepError) and isinstance(info.value, ValueError)
    assert not isinstance(info.value, IndexError)


@pytest.mark.parametrize("key", ["input_ids", "labels", "shift_labels"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_non_integer_ids_name_the_key_and_dtype(key: str, dtype: torch.dtype) -> None:
    batch = hf_batch([torch.tensor([1, 0, 1])])
    if key == "shift_labels":
        batch["shift_labels"] = hf_shift(batch["labels"])
    batch[key] = batch[key].to(dtype)
    with pytest.raises(BatchError, match=rf"batch\['{key}'\] must hold integer token ids.*{dtype}"):
        causal_lm_loss(MODEL, batch)


def test_int32_ids_and_labels_train_like_int64() -> None:
    batch = hf_batch([torch.tensor([1, 2, 3, 4]), torch.tensor([9, 8])])
    small = {k: v.to(torch.int32) for k, v in batch.items()}
    with torch.no_grad():
        a, b = causal_lm_loss(MODEL, batch), causal_lm_loss(MODEL, small)
    assert torch.equal(a.total, b.total) and int(a.count) == int(b.count) == 4


def test_missing_labels_names_both_keys() -> None:
    with pytest.raises(KeyError, match="'labels' \\(or 'shift_labels'\\)"):
        causal_lm_loss(MODEL, {"input_ids": torch.zeros(1, 3, dtype=torch.long)})


@pytest.mark.parametrize("key", ["labels", "shift_labels"])
def test_shapes_that_differ_name_both_keys(key: str) -> None:
    """L13: the message names both keys and shapes, whichever labels the batch holds."""
    batch = {"input_ids": torch.arange(8).reshape(2, 4), key: torch.arange(10).reshape(2, 5)}
    with pytest.raises(BatchError, match=rf"input_ids shape \(2, 4\) differs from {key} shape"):
        causal_lm_loss(MODEL, batch)
    batch["attention_mask"] = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(BatchError, match=rf"attention_mask shape \(2, 4\) differs from {key}"):
        count_tokens(batch)
