"""Supervised fine-tuning data is trained exactly: one accumulated step over the real stream
of each JSONL format equals a float64 full-window reference computed the plain way.

The reference never looks at the stream's labels: it tokenizes each record itself (prompt
and completion apart, EOS appended; a conversation piece by piece from the ChatML template
of tests/support/hf_assets.py), runs every sequence alone and unpadded, sums the
cross-entropy of the tokens that must train (the completion and EOS; the assistant's
content and its end-of-turn token; every token of text) and divides by their count. For
text, whose windows are random cuts, the reference takes the window's own sequences and
checks that each is a piece of one document's tokens.

Tolerance: 1e-14 relative on the whole gradient (float64; Llama's RMSNorm casts to float32
in the backward, so the reference backpropagates the sum first, as the Stepper does: see
tests/hf/test_loss.py). The mean of per-micro-batch means is asserted to be off by > 1e-3
on the same window, so the test can tell the two apart.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

import gradstep  # noqa: E402
from gradstep_cli.cli import main as gradstep_main  # noqa: E402
from gradstep_cli.config.settings import TrainConfig  # noqa: E402
from gradstep_cli.data.sources import IGNORE_INDEX, load_source  # noqa: E402
from gradstep_cli.models.hf import HFLoss, count_batch  # noqa: E402
from gradstep_cli.run.evaluation import evaluate  # noqa: E402
from tests.hf.helpers import grads_of, rel_err  # noqa: E402
from tests.support import hf_assets  # noqa: E402

TOL = 1e-14
SEQ = 48
ROWS, K = 2, 4  # a window of K micro-batches of ROWS records: one epoch of 8 records


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def pairs(n: int = 8, offset: int = 0) -> list[dict[str, str]]:
    """Prompt/completion records with completions of very different lengths; the fourth
    prompt is too long for SEQ, so it is cut from the left."""
    long_doc = '    """' + "Scale the value. " * 12 + '"""\n'
    return [
        {
            "prompt": f"def scale_{i + offset}(x):\n" + (long_doc if i == 3 else ""),
            "completion": "    return x" + " * 2" * ((5 * i + offset) % 9),
        }
        for i in range(n)
    ]


def cut(sequence: tuple[list[int], list[bool]]) -> tuple[list[int], list[bool]]:
    """The documented rule: a record keeps its last SEQ + 1 tokens."""
    ids, trainable = sequence
    return ids[-(SEQ + 1) :], trainable[-(SEQ + 1) :]


def chats(n: int = 8, offset: int = 0) -> list[dict[str, Any]]:
    """Conversations of one or two assistant turns, some with a system message."""
    out = []
    for i in range(n):
        j = i + offset
        turns = [{"role": "user", "content": f"Sum {j} and {j + 1}."}]
        turns.append({"role": "assistant", "content": "It is" + " big" * (j % 7) + "."})
        if i % 2:
            turns = [{"role": "system", "content": "Answer briefly."}, *turns]
            turns += [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "So."}]
        out.append({"messages": turns})
    return out


def texts(n: int = 3) -> list[dict[str, str]]:
    return [{"text": f"import os\n\nvalue_{i} = os.getcwd()\n" * (i + 2)} for i in range(n)]


def source(tmp_path: Path, train: list[dict], val: list[dict], tokenizer: Any) -> Any:
    cfg = TrainConfig(
        data=str(write_jsonl(tmp_path / "train.jsonl", train)),
        val_data=str(write_jsonl(tmp_path / "val.jsonl", val)),
        seq_len=SEQ,
    )
    return load_source(cfg, tokenizer)


# ----------------------------------------------------- the plain reference, record by record


def plain_pair(tok: Any, record: dict[str, str]) -> tuple[list[int], list[bool]]:
    prompt = tok(record["prompt"])["input_ids"]
    completion = tok(record["completion"], add_special_tokens=False)["input_ids"]
    ids = [*prompt, *completion, tok.eos_token_id]
    return ids, [False] * len(prompt) + [True] * (len(completion) + 1)


def plain_chat(tok: Any, record: dict[str, Any]) -> tuple[list[int], list[bool]]:
    """ChatML built piece by piece: the assistant's content and <|im_end|> train."""
    ids: list[int] = []
    trainable: list[bool] = []
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    for message in record["messages"]:
        head, body = enc(f"<|im_start|>{message['role']}\n"), enc(message["content"] + "<|im_end|>")
        tail = enc("\n")
        ids += head + body + tail
        trainable += [False] * len(head) + [message["role"] == "assistant"] * len(body)
        trainable += [False] * len(tail)
    rendered = tok.apply_chat_template(record["messages"], tokenize=True, return_dict=True)
    assert rendered["input_ids"] == ids  # the same sequence the template makes
    return ids, trainable


def reference(model: Any, sequences: list[tuple[list[int], list[bool]]]) -> tuple[dict, float, int]:
    """Gradient of (sum of CE over the trainable targets / their count), each sequence alone
    and unpadded; the sum is backpropagated first (see the module docstring)."""
    model = copy.deepcopy(model)
    total, count = torch.zeros((), dtype=torch.float64), 0
    for ids, trainable in sequences:
        x = torch.tensor(ids)
        logits = model(input_ids=x[None, :-1], use_cache=False).logits[0]
        mask = torch.tensor(trainable[1:])
        total = total + F.cross_entropy(logits[mask], x[1:][mask], reduction="sum")
        count += int(mask.sum())
    total.backward()
    grads = {n: p.grad / count for n, p in model.named_parameters() if p.grad is not None}
    return grads, float(total.detach()) / count, count


def mean_of_means(model: Any, window: list[dict[str, torch.Tensor]]) -> dict:
    """What averaging each micro-batch's mean loss gives (the classic accumulation bug)."""
    model = copy.deepcopy(model)
    for batch in window:
        loss = HFLoss(torch.device("cpu"))(model, batch)
        (loss.total / loss.count / len(window)).backward()
    return grads_of(model)


def step(model: Any, window: list[dict[str, torch.Tensor]]) -> gradstep.StepStats:
    stepper = gradstep.Stepper(model, torch.optim.SGD(model.parameters(), lr=0.0), clip=None)
    return stepper.step(window, HFLoss(torch.device("cpu")), count=count_batch)


def check_exact(model: Any, window: list, sequences: list) -> None:
    want, loss, n = reference(model, sequences)
    stats = step(model, window)
    assert stats.items == n
    assert rel_err(grads_of(model), want) <= TOL
    assert stats.loss == pytest.approx(loss, rel=TOL)
    assert rel_err(mean_of_means(model, window), want) > 1e-3  # variable lengths matter here


@pytest.fixture(scope="module")
def tok() -> Any:
    return hf_assets.load_tokenizer()


@pytest.fixture
def model() -> Any:
    return hf_assets.build_model("llama", seed=0).double()


def test_prompt_completion_step_is_exact(tmp_path: Path, tok: Any, model: Any) -> None:
    records = pairs()
    src = source(tmp_path, records, pairs(2, offset=50), tok)
    stream = src.train_batches(SEQ, ROWS, 0, 0, 1)
    window = [next(stream) for _ in range(K)]  # one epoch: every record once
    counts = {int((b["labels"] != IGNORE_INDEX).sum()) for b in window}
    assert len(counts) > 1  # micro-batches of different target counts
    sequences = [plain_pair(tok, r) for r in records]
    assert len(sequences[3][0]) > SEQ + 1 and src.counts()["truncated"] == 1
    check_exact(model, window, [cut(s) for s in sequences])


def test_messages_step_is_exact(tmp_path: Path, tok: Any, model: Any) -> None:
    records = chats()
    src = source(tmp_path, records, chats(2, offset=50), tok)
    stream = src.train_batches(SEQ, ROWS, 0, 0, 1)
    window = [next(stream) for _ in range(K)]
    check_exact(model, window, [cut(plain_chat(tok, r)) for r in records])


def test_text_step_is_exact(tmp_path: Path, tok: Any, model: Any) -> None:
    records = texts()
    src = source(tmp_path, records, texts(1), tok)
    stream = src.train_batches(16, ROWS, 0, 0, 1)
    window = [next(stream) for _ in range(K)]
    docs = [[*tok(r["text"])["input_ids"], tok.eos_token_id] for r in records]
    sequences = []
    for batch in window:
        for ids, labels in zip(batch["input_ids"], batch["labels"], strict=True):
            n = int((labels != IGNORE_INDEX).sum())
            assert (labels[:n] != IGNORE_INDEX).all()  # text: every target trains
            seq = [*ids[:n].tolist(), int(labels[n - 1])]
            assert any(_contains(doc, seq) for doc in docs)  # a piece of one document
            sequences.append((seq, [True] * len(seq)))
    assert len({len(s) for s, _ in sequences}) > 1
    check_exact(model, window, sequences)


def _contains(doc: list[int], piece: list[int]) -> bool:
    return any(doc[i : i + len(piece)] == piece for i in range(len(doc) - len(piece) + 1))


def test_evaluation_is_token_weighted_over_completion_tokens(tmp_path: Path, tok: Any) -> None:
    model = hf_assets.build_model("llama", seed=1).double()
    val = pairs(5, offset=20)
    src = source(tmp_path, pairs(), val, tok)
    batches = src.validation_batches(SEQ, 2, 10, 0, 1)
    got = evaluate(model, batches, torch.device("cpu"), HFLoss(torch.device("cpu")))
    _, want, _ = reference(model, [cut(plain_pair(tok, r)) for r in val])
    assert got == pytest.approx(want, rel=1e-12)


# ------------------------------------------------------------------ from the command line

CLI = [
    "--seq-len", str(SEQ), "--micro-batch-size", str(ROWS), "--accum-steps", str(K),
    "--eval-batches", "2", "--eval-every", "0", "--sample-tokens", "0", "--warmup", "1",
    "--lr", "1e-3",
]  # fmt: skip


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_assets.model_dir(tmp_path_factory.mktemp("hf") / "llama")


def test_cli_bad_record_is_one_error_and_leaves_no_run(
    tmp_path: Path, llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps(pairs(1)[0]) + '\n{"prompt": "p", "completion": ""}\n')
    out = tmp_path / "run"
    args = ["train", "--model", f"hf:{llama_dir}", "--data", str(data), *CLI, "--out", str(out)]
    assert gradstep_main(args) == 2
    err = capsys.readouterr().err
    assert f"gradstep train: error: --data {data} line 2: 'completion' is empty" in err
    assert "Traceback" not in err and err.count("error:") == 1
    from gradstep_cli.run.folder import holds_run

    assert not holds_run(out)  # nothing written: the same command, fixed, just runs
