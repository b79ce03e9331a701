"""Validation metrics (gradstep_cli.run.evaluation, run.validation): the loss, token accuracy
and entropy of an evaluation against a plain per-token computation; the whole validation set
by default, an equal number of batches on every rank; which evaluation is the best."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gradstep_cli.config.settings import TrainConfig
from gradstep_cli.data.sources import collate
from gradstep_cli.data.tokenized import Sequences
from gradstep_cli.data.validation import validation_batches
from gradstep_cli.models.gpt import GPT, GPTConfig
from gradstep_cli.run.evaluation import Evaluation, evaluate, evaluate_metrics, token_sums
from gradstep_cli.run.validation import better

CPU = torch.device("cpu")


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, max_seq_len=16))


def test_metrics_are_the_per_token_ones_over_every_target() -> None:
    model = _model()
    batches = [collate([b"abcdefghij", b"ab"]), collate([b"xyz"])]
    logp, targets = [], []
    with torch.no_grad():
        for b in batches:
            mask = b["labels"] != -100
            logp.append(F.log_softmax(model(b["input_ids"])[mask].double(), dim=-1))
            targets.append(b["labels"][mask])
    lp, t = torch.cat(logp), torch.cat(targets)
    got = evaluate_metrics(model, batches, CPU)
    assert got.items == 12 and got.records == 3
    assert got.loss == pytest.approx(float(-lp.gather(1, t[:, None]).mean()), rel=1e-6)
    assert got.loss == pytest.approx(evaluate(model, batches, CPU), rel=1e-6)
    assert got.accuracy == pytest.approx(float((lp.argmax(-1) == t).double().mean()))
    assert got.entropy == pytest.approx(float(-(lp.exp() * lp).sum(-1).mean()), rel=1e-5)
    assert set(got.metrics()) == {
        "val_loss", "val_accuracy", "val_entropy", "val_items", "val_records"
    }  # fmt: skip
    assert "(3 records, 12 tokens)" in got.describe()


def test_token_sums_in_chunks_equal_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(3, 7, 11)
    labels = torch.randint(0, 11, (3, 7))
    labels[1] = -100  # a row with no target counts as no record
    whole = token_sums(logits, labels)
    monkeypatch.setattr("gradstep_cli.run.evaluation._ROWS", 4)
    assert torch.allclose(token_sums(logits, labels), whole)
    assert whole[1] == 14 and whole[4] == 2


def test_token_sums_in_chunks_equal_one_pass_with_a_head() -> None:
    hidden, head = torch.randn(3, 7, 5, dtype=torch.float64), torch.nn.Linear(5, 11).double()
    labels = torch.randint(0, 11, (3, 7))
    labels[1, :4] = -100
    want = token_sums(head(hidden), labels)
    for chunk in (1, 3, 100):
        assert torch.allclose(token_sums(hidden, labels, head, chunk), want, rtol=1e-6)


@pytest.mark.parametrize("tie", [True, False])
def test_a_chunked_evaluation_equals_the_whole_logits_one(tie: bool) -> None:
    """--loss-chunk-tokens: evaluation projects N target positions at a time: equal within
    the float32 rounding the scoring runs in (as the training loss), accuracy exactly."""
    from gradstep_cli.run.evaluation import Logits

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=16, max_seq_len=16, tie_weights=tie))
    model = model.double()
    batches = [collate([b"abcdefghij", b"ab"]), collate([b"xyz", b"0123456789abcde"])]
    whole = evaluate_metrics(model, batches, CPU, Logits(CPU))
    for chunk in (1, 4, 1024):
        got = evaluate_metrics(model, batches, CPU, Logits(CPU, chunk_tokens=chunk))
        assert got.items == whole.items and got.records == whole.records
        assert got.accuracy == whole.accuracy
        assert got.loss == pytest.approx(whole.loss, rel=1e-6)
        assert got.entropy == pytest.approx(whole.entropy, rel=1e-6)


def test_accuracy_with_a_head_is_that_of_the_projected_logits() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 32, bias=False)
    hidden = torch.randn(2, 7, 8)
    with torch.no_grad():
        labels = head(hidden).argmax(-1)
        labels[0, 5:] = -100  # 12 targets, each the argmax: accuracy 1
        assert token_sums(hidden, labels, head, 3)[2] == token_sums(head(hidden), labels)[2] == 12


def test_a_chunked_hf_evaluation_equals_the_whole_logits_one() -> None:
    pytest.importorskip("transformers")
    from gradstep_cli.run.evaluation import Logits
    from tests.support import hf_assets

    model = hf_assets.build_model("llama", seed=0).double()
    batches = [collate([b"abcdefghij", b"ab"]), collate([b"xyz"])]
    whole = evaluate_metrics(model, batches, CPU, Logits(CPU, hf=True))
    got = evaluate_metrics(model, batches, CPU, Logits(CPU, hf=True, chunk_tokens=3))
    assert (got.items, got.records, got.accuracy) == (whole.items, whole.records, whole.accuracy)
    assert got.loss == pytest.approx(whole.loss, rel=1e-6)


def test_nothing_scored_is_nan_not_an_error() -> None:
    ev = Evaluation.of(torch.zeros(5, dtype=torch.float64))
    assert math.isnan(ev.loss) and math.isnan(ev.accuracy) and ev.items == 0


def _records(n: int) -> Sequences:
    from gradstep_cli.data.records import Encoded

    encoded = [
        Encoded(np.arange(5 + i, dtype=np.int32) % 50, np.arange(5 + i) >= 2) for i in range(n)
    ]
    return Sequences([], encoded, dtype=np.int32)


def test_the_whole_set_by_default_and_equal_batches_on_every_rank() -> None:
    data = _records(7)
    every = validation_batches(data, 32, 2)
    assert sum(len(b["labels"]) for b in every) == 7  # every record once
    ranks = [validation_batches(data, 32, 2, None, r, 3) for r in range(3)]
    assert [len(r) for r in ranks] == [2, 2, 2]  # 4 batches over 3 ranks: one filler
    filler = ranks[2][-1]
    assert (filler["labels"] == -100).all()
    rows = sum(int((b["labels"] != -100).any(1).sum()) for r in ranks for b in r)
    assert rows == 7
    assert len(validation_batches(data, 32, 2, 1)) == 1  # --eval-batches 1: a sample


def test_better_knows_each_metrics_direction() -> None:
    assert better("val_loss", 1.0, math.nan) and better("val_loss", 1.0, 2.0)
    assert not better("val_loss", 2.0, 2.0) and not better("val_loss", math.nan, 2.0)
    assert better("val_accuracy", 0.6, 0.5) and not better("val_accuracy", 0.4, 0.5)


def test_sample_note_states_the_sample_size() -> None:
    from gradstep_cli.data.batching import Layout
    from gradstep_cli.run.evaluation import sample_note

    class Source:
        class val:  # noqa: N801 - the TextSource's attribute
            data = _records(7)

    layout = Layout(2, 1, None)
    assert sample_note(TrainConfig(seq_len=32), Source, layout) is None
    note = sample_note(TrainConfig(seq_len=32, eval_batches=2), Source, layout)
    assert note is not None and "a sample of 4 of the 7 validation sequences" in note
    assert sample_note(TrainConfig(seq_len=32, eval_batches=9), Source, layout) is None


class _LiveChunks(torch.utils._python_dispatch.TorchDispatchMode):
    """How many storages of at least ``numel`` elements are alive at once among the tensors
    the dispatched ops return (a storage is alive while any tensor viewing it is): at most
    (``most``), and when each new one is made by a matmul (``at_projection``). An op's own
    temporaries (logsumexp's) are not seen: hence the second count."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.refs, self.most, self.at_projection = numel, {}, 0, []

    def _drop(self, key: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref

        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel:
                key = t.untyped_storage().data_ptr()
                self.refs[key] = self.refs.get(key, 0) + 1
                weakref.finalize(t, self._drop, key)
                self.most = max(self.most, len(self.refs))
                if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                    self.at_projection.append(len(self.refs))
        return out


def test_a_chunked_evaluation_holds_two_chunk_sized_tensors_at_most() -> None:
    """What the evaluation adds to a run's peak: each chunk's logits die before the next
    chunk is projected (two chunk-sized tensors at once at most, logsumexp's temporary
    included, as the training loss's backward holds)."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 512, bias=False)
    hidden, labels = torch.randn(4, 16, 8), torch.randint(0, 512, (4, 16))
    with torch.no_grad(), _LiveChunks(16 * 512) as live:
        token_sums(hidden, labels, head, chunk_tokens=16)
    assert live.at_projection == [1, 1, 1, 1]  # nothing of the chunk before
    assert live.most == 2  # the log-probabilities and their exponentials
