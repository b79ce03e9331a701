"""Long documents tokenized in pieces (gradstep_cli.data.chunks): cut at safe boundaries,
the pieces' ids joined are exactly the ids of the whole document, on a byte-level BPE
trained here; a tokenizer that does not keep that promise is found out and encodes whole."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gradstep_cli.data.chunks import _PROBES, Pieces, file_pieces, safe_cut, text_pieces
from gradstep_cli.data.records import Encoder

# Lines of code, prose, numbers, unicode and odd whitespace: what pieces are cut between.
LINES = st.sampled_from(
    [
        "def f(x):", "    return x + 1", "", "class A(B):", "\tpass", "  # comment  ",
        "The quick brown fox jumps over the lazy dog.", "Über naïve café 東京 ありがとう",
        "x = [1, 2, 3]  # 12345678901234", "   ", "a  b   c", "if (a and b) or c: print('hi')",
        "value_12345 67890 + 3.14159e-10", "\r", "éé é", "'s 't 're", "....!!!???",
    ]
)  # fmt: skip
TEXTS = st.lists(LINES, min_size=1, max_size=60).map("\n".join)


@pytest.fixture(scope="module")
def tok() -> Any:
    pytest.importorskip("transformers")
    from tests.support import hf_assets

    return hf_assets.load_tokenizer()


def _pieced(pieces: Pieces, texts: list[list[str]]) -> list[np.ndarray]:
    """Each document's ids through ``pieces``, given as its pieces."""
    out: list[list[np.ndarray]] = [[] for _ in texts]
    for i, doc in enumerate(texts):
        pieces.add(doc, lambda ids, last, i=i: out[i].append(ids))
    pieces.flush()
    return [np.concatenate(parts) for parts in out]


@given(TEXTS, st.integers(1, 40))
@example("a\nb", 1)
@example("x" * 50 + "\ny", 10)  # no boundary before the size: the first one after it
def test_pieces_join_back_to_the_text_at_safe_boundaries(text: str, size: int) -> None:
    pieces = list(text_pieces(text, size))
    assert "".join(pieces) == text and all(pieces)
    for left, right in zip(pieces, pieces[1:], strict=False):
        newline = left.endswith("\n") and not right[0].isspace()
        space = right[0] == " " and not left[-1].isspace() and not right[1:2].isspace()
        assert newline or (space and len(right) > 1), (left, right)


def test_the_probes_are_split_at_safe_boundaries() -> None:
    for a, b in _PROBES:
        assert safe_cut(a + b, len(a)) == len(a), (a, b)


@settings(max_examples=40, deadline=None)
@given(st.lists(TEXTS, min_size=1, max_size=4), st.integers(2, 64))
def test_pieced_ids_are_the_whole_documents_ids(tok: Any, texts: list[str], size: int) -> None:
    """The promise: on a byte-level BPE trained here, any cut into pieces gives the ids of
    the whole (BOS/EOS framing included), however many documents share a tokenizer call."""
    encoder = Encoder(tok)
    pieces = Pieces(encoder)
    assert pieces.splits
    got = _pieced(pieces, [list(text_pieces(t, size)) for t in texts])
    for text, ids in zip(texts, got, strict=True):
        assert ids.tolist() == encoder.documents([text])[0].tolist()


def test_a_file_read_in_small_blocks_gives_the_same_ids(tok: Any, monkeypatch) -> None:
    from gradstep_cli.data import chunks
    from tests.support import hf_assets

    monkeypatch.setattr(chunks, "BATCH_CHARS", 5000)
    text = "".join(hf_assets.training_text(60_000))
    data = text.encode()
    blocks = [data[i : i + 997] for i in range(0, len(data), 997)]  # cuts inside characters too
    pieces = Pieces(Encoder(tok))
    got = _pieced(pieces, [list(file_pieces(blocks, size=1000))])[0]
    assert got.tolist() == Encoder(tok).documents([text])[0].tolist()
    assert pieces.calls > 1  # several tokenizer calls, each bounded


def test_special_tokens_around_a_text_frame_the_whole_document(tok: Any) -> None:
    """A tokenizer that adds BOS and EOS around a text: the first piece gets the BOS, the
    last the EOS, none in between."""
    from tokenizers.processors import TemplateProcessing

    bos, eos = tok.convert_tokens_to_ids(["<|im_start|>", "<|endoftext|>"])
    tok = type(tok).from_pretrained(tok.name_or_path)
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|im_start|> $A <|endoftext|>",
        special_tokens=[("<|im_start|>", bos), ("<|endoftext|>", eos)],
    )
    encoder = Encoder(tok)
    pieces = Pieces(encoder)
    assert pieces.splits and pieces.prefix == [bos] and pieces.suffix == [eos]
    text = "def f():\n    return 1\n" * 40
    ids = _pieced(pieces, [list(text_pieces(text, 30))])[0]
    assert ids.tolist() == encoder.documents([text])[0].tolist()
    assert ids.tolist().count(bos) == 1 and ids[0] == bos and ids[-1] == eos


def test_a_tokenizer_whose_ids_depend_on_the_whole_text_encodes_it_whole() -> None:
    """A SentencePiece-style normalizer that prepends '▁' to every text cannot be cut: the
    probe finds it out, and documents are encoded whole (the same ids as before)."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.support import hf_assets

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.pre_tokenizer = pre_tokenizers.Split("\n", "isolated")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"])
    raw.train_from_iterator(hf_assets.training_text(50_000), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", unk_token="<unk>")
    encoder = Encoder(tok)
    pieces = Pieces(encoder)
    assert not pieces.splits
    text = "def f(x):\n    return x\nclass A:\n    pass\n" * 20
    ids = _pieced(pieces, [list(text_pieces(text, 16))])[0]
    assert ids.tolist() == encoder.documents([text])[0].tolist()


def test_bytes_need_no_tokenizer() -> None:
    pieces = Pieces(Encoder(None))
    text = "héllo\nworld " * 30
    ids = _pieced(pieces, [list(text_pieces(text, 7))])[0]
    assert bytes(ids.tolist()) == text.encode()
