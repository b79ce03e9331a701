"""``--packing`` trains each format exactly (issue 31 §1): one accumulated step over a whole
packed epoch of the real stream equals the float64 reference of every sequence run alone
and unpadded (tests/cli/test_sft.py's reference, 1e-14 relative on the gradient), through
the run's own loss: the HF model's (the 4-D block-causal mask, positions restarting per
sequence) and the demo GPT's (its own block-causal attention, chunked loss or not).

A packed row holds several records here (asserted), so a mask that let them attend to each
other, or positions that did not restart, would fail the comparison by far more than 1e-14.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import gradstep  # noqa: E402
from gradstep.packing import SEGMENTS, use_segments  # noqa: E402
from gradstep_cli.data.sources import IGNORE_INDEX, TrainBatches  # noqa: E402
from gradstep_cli.models.gpt import GPT, GPTConfig  # noqa: E402
from gradstep_cli.run.components import GPTLoss  # noqa: E402
from gradstep_cli.run.evaluation import LMLoss  # noqa: E402
from tests.cli.test_sft import (  # noqa: E402
    SEQ,
    TOL,
    chats,
    check_exact,
    cut,
    pairs,
    plain_chat,
    plain_pair,
    source,
    texts,
)
from tests.hf.helpers import grads_of, rel_err  # noqa: E402
from tests.support import hf_assets  # noqa: E402

ROWS = 2
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tok() -> Any:
    return hf_assets.load_tokenizer()


@pytest.fixture(params=["sdpa", SEGMENTS])
def model(request: pytest.FixtureRequest) -> Any:
    """The 4-D mask under sdpa, and attention one sequence at a time (what --packing runs
    an sdpa model with, unless --compile)."""
    built = hf_assets.build_model("llama", seed=0, attn_implementation="sdpa").double()
    if request.param == SEGMENTS:
        assert use_segments(built)
    return built


def packed_epoch(src: Any, seq_len: int = SEQ) -> list[dict[str, torch.Tensor]]:
    stream = src.train_batches(seq_len, ROWS, 0, 0, 1, packing=True)
    window = [next(stream) for _ in range(stream.epoch_length(0))]
    assert stream.epoch_sequences(0) > stream.epoch_rows(0)  # rows hold several sequences
    return window


def segments(window: list[dict[str, torch.Tensor]]) -> list[tuple[list[int], list[bool]]]:
    """Each packed sequence as (ids, trainable): its inputs plus its last target."""
    out = []
    for batch in window:
        for ids, labels, seq in zip(
            batch["input_ids"], batch["labels"], batch["seq_ids"], strict=True
        ):
            for k in seq.unique().tolist():
                where = seq == k
                lab = labels[where]
                if (lab == IGNORE_INDEX).all():
                    continue  # the row's padding
                full = [*ids[where].tolist(), int(lab[-1])]
                out.append((full, [False] + (lab != IGNORE_INDEX).tolist()))
    return out


def test_prompt_completion_packed_step_is_exact(tmp_path: Path, tok: Any, model: Any) -> None:
    records = pairs()
    window = packed_epoch(source(tmp_path, records, pairs(2, offset=50), tok))
    check_exact(model, window, [cut(plain_pair(tok, r)) for r in records])


def test_messages_packed_step_is_exact(tmp_path: Path, tok: Any, model: Any) -> None:
    records = chats()
    window = packed_epoch(source(tmp_path, records, chats(2, offset=50), tok), seq_len=4 * SEQ)
    sequences = [plain_chat(tok, r) for r in records]
    assert max(len(ids) for ids, _ in sequences) <= 4 * SEQ + 1  # nothing cut
    check_exact(model, window, sequences)


def test_text_packed_step_is_exact(tmp_path: Path, tok: Any, model: Any) -> None:
    records = texts()
    window = packed_epoch(source(tmp_path, records, texts(1), tok), seq_len=16)
    sequences = segments(window)
    docs = [[*tok(r["text"])["input_ids"], tok.eos_token_id] for r in records]
    for ids, trainable in sequences:
        assert all(trainable[1:])  # text: every target trains
        assert any(doc[i : i + len(ids)] == ids for doc in docs for i in range(len(doc)))
    assert len({len(s) for s, _ in sequences}) > 1
    check_exact(model, window, sequences)


@pytest.mark.parametrize("chunk", [None, 5])
def test_the_demo_gpt_packed_step_is_exact(chunk: int | None) -> None:
    """Bytes of documents, the demo GPT in float64, its run's loss (GPTLoss when chunked,
    LMLoss otherwise) over a packed epoch vs every span alone."""
    gen = torch.Generator().manual_seed(0)
    docs = [bytes(torch.randint(32, 127, (n,), generator=gen).tolist()) for n in (90, 41, 67)]
    from gradstep_cli.data.tokenized import Document

    stream = TrainBatches([Document(str(i), d) for i, d in enumerate(docs)], 24, ROWS,
                          seed=1, full_frac=0.3, packing=True)  # fmt: skip
    window = [next(stream) for _ in range(stream.epoch_length(0))]
    sequences = segments(window)
    assert stream.epoch_sequences(0) > stream.epoch_rows(0)
    torch.manual_seed(0)
    base = GPT(GPTConfig(n_layer=2, n_head=2, d_model=16, max_seq_len=24,
                         loss_chunk_tokens=chunk)).double()  # fmt: skip
    loss_fn = GPTLoss(CPU) if chunk else LMLoss(CPU)
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    stats = gradstep.Stepper(model, opt, clip=None).step(window, loss_fn)
    ref = copy.deepcopy(base)
    total, count = torch.zeros((), dtype=torch.float64), 0
    for ids, _ in sequences:
        x = torch.tensor(ids)
        logits = ref(x[None, :-1])[0]
        total = total + torch.nn.functional.cross_entropy(logits, x[1:], reduction="sum")
        count += len(ids) - 1
    total.backward()
    want = {n: p.grad / count for n, p in ref.named_parameters()}
    assert stats.items == count
    assert stats.loss == pytest.approx(float(total.detach()) / count, rel=TOL)
    assert rel_err(grads_of(model), want) <= 1e-13
