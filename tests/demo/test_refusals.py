"""Refusals that were silently wrong or gave the wrong reason (issue 28 §3): each test
reproduces a row of shared/reviews/robustness-3.md (the row id is in its name or docstring)
and checks the split or the message now says what is true. Every case stops before any
step, so all run in the fast loop."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from gradstep_demo.cli import main
from gradstep_demo.config import TrainConfig
from gradstep_demo.data import _held_out, _unit, load_source
from gradstep_demo.records import DataError, TemplateError
from tests.support.batches import text_corpus

GPT = [
    "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "16",
    "--micro-batch-size", "2", "--accum-steps", "1", "--eval-batches", "1",
    "--sample-tokens", "0", "--warmup", "1", "--max-steps", "1",
]  # fmt: skip
HF = [
    "--seq-len", "32", "--micro-batch-size", "2", "--accum-steps", "1", "--eval-batches", "1",
    "--sample-tokens", "0", "--warmup", "1", "--max-steps", "1",
]  # fmt: skip
CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def chats(n: int) -> list[dict[str, Any]]:
    return [
        {"messages": [{"role": "user", "content": f"{i}"}, CHAT["messages"][1]]} for i in range(n)
    ]


def jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def pairs(n: int) -> list[dict[str, str]]:
    return [{"prompt": f"q{i}: ", "completion": f"a{i} b"} for i in range(n)]  # fits --seq-len 16


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run the CLI, expect exit status 2 and one error line; return that line."""
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if " error: " in line]
    assert len(lines) == 1, err
    return lines[0]


def train(capsys: Any, tmp_path: Path, *flags: str, model: Path | None = None) -> str:
    """``refused`` for a tiny run into ``tmp_path/run``: the demo GPT, or ``hf:model``."""
    size = GPT if model is None else ["--model", f"hf:{model}", *HF]
    return refused(capsys, "train", *size, "--out", str(tmp_path / "run"), *flags)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return text_corpus(tmp_path_factory.mktemp("data") / "corpus")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("transformers")
    from tests.support import hf_assets

    root = tmp_path_factory.mktemp("hf")
    return {
        "llama": hf_assets.model_dir(root / "llama", "llama", seed=0),
        "notok": hf_assets.model_dir(root / "notok", "llama", seed=0, tokenizer=False),
    }


# ------------------------------------------------------------------ V5: the held-out share


@given(
    n=st.integers(1, 400),
    copies=st.integers(1, 3),
    fraction=st.floats(1e-4, 0.9999),
    prefix=st.text(max_size=6),
)
@example(n=300, copies=1, fraction=0.999, prefix="x")  # V5: every record hashes below
@example(n=5, copies=2, fraction=1e-4, prefix="")  # none does
@example(n=5, copies=3, fraction=0.9999, prefix="")  # every key does, each with copies
def test_the_split_holds_out_the_hashed_share_clamped_never_the_inverse(
    n: int, copies: int, fraction: float, prefix: str
) -> None:
    """V5, the rule of docs/demo.md ("The validation split"): a distinct key is held out when
    its hash unit is below the fraction, the count clamped to [1, keys - 1]; fewer than two
    keys cannot be split. Copies land together, and the split is deterministic."""
    keys = [f"{prefix}record {i}" for i in range(n) for _ in range(copies)]
    hashed = sum(_unit(f"{prefix}record {i}") < fraction for i in range(n))
    if n < 2:
        with pytest.raises(ValueError, match="two distinct keys"):
            _held_out(keys, fraction)
        return
    held = _held_out(keys, fraction)
    assert held == _held_out(keys, fraction) and len(held) == len(keys)
    side = {}
    for key, is_val in zip(keys, held, strict=True):
        assert side.setdefault(key, is_val) == is_val  # copies on one side
    val = sum(side.values())
    assert val == min(max(hashed, 1), n - 1)  # so 1 <= val <= n - 1
    if n >= 100:  # the hash is uniform: the share asked for, never its complement
        assert abs(val / n - fraction) <= 5 * math.sqrt(fraction * (1 - fraction) / n) + 2 / n


def test_too_little_left_to_train_says_what_val_fraction_held_out(tmp_path, capsys) -> None:
    """V5: 0.999 of 300 records held out 1 (0.99: 297). Now it holds out about 299, and the
    1 left cannot fill a micro-batch of 2: the refusal says why. D10: a micro-batch larger
    than the data said 'fewer than world_size=1'."""
    data = jsonl(tmp_path / "pc.jsonl", pairs(300))
    line = train(capsys, tmp_path, "--data", str(data), "--val-fraction", "0.999")
    held = re.search(r"--val-fraction 0\.999 held (\d+) of the 300 records out", line)
    assert held and int(held.group(1)) >= 290, line
    assert "--val-data" in line and "--micro-batch-size" in line, line
    val = jsonl(tmp_path / "val.jsonl", pairs(8))
    one = ["--data", str(jsonl(tmp_path / "one.jsonl", pairs(1))), "--val-data", str(val)]
    line = train(capsys, tmp_path, "--micro-batch-size", "4", *one)
    assert "training data yields 1 sequence per epoch, 0 micro-batches of 4" in line, line
    assert "use more data or a smaller --micro-batch-size" in line and "world_size" not in line


# ------------------------------ D2, D5, D6, D9, D18: too small to split; SY1, RO2: run folders


@pytest.mark.parametrize(
    ("lines", "flags", "holds"),
    [
        ([pairs(1)[0]], [], "holds 1 record:"),
        ([pairs(1)[0]], ["--micro-batch-size", "1"], "holds 1 record:"),
        ([pairs(1)[0], '{"prompt": "a"'], ["--skip-bad-records"],
         "holds 1 record (1 more skipped as bad):"),
        ([pairs(1)[0]] * 3, [], "holds 3 records, all copies of one:"),
    ],
    ids=["D9", "D18", "D2", "copies"],
)  # fmt: skip
def test_a_file_too_small_to_split_says_where_the_record_would_go(
    tmp_path, capsys, lines, flags, holds
) -> None:
    """D2, D9, D18: 'no sequence to use (no record is left)': the one record had gone to
    validation, which the message did not say."""
    data = jsonl(tmp_path / "one.jsonl", lines)
    line = train(capsys, tmp_path, *flags, "--data", str(data))
    assert f"--data {str(data)!r} {holds} too few to split" in line, line
    assert "--val-fraction 0.1" in line and "--val-data PATH" in line, line
    assert "no record is left" not in line


def test_chat_files_too_small_to_split_name_validation(tmp_path, capsys, hf_dirs) -> None:
    """D6 (one conversation) and D5 (one without an assistant turn, one good): whichever
    side the good one goes to, the message says --val-fraction / --val-data."""
    order = [{"messages": [*CHAT["messages"][::-1]]}]  # the assistant first
    data = jsonl(tmp_path / "order.jsonl", order)
    line = train(capsys, tmp_path, "--data", str(data), model=hf_dirs["llama"])
    assert "holds 1 record: too few to split" in line and "--val-data PATH" in line, line
    silent = {"messages": [{"role": "user", "content": "nobody answers"}]}
    data = jsonl(tmp_path / "noasst.jsonl", [silent, CHAT])
    line = train(capsys, tmp_path, "--data", str(data), model=hf_dirs["llama"])
    assert "1 record with no token to train on" in line, line
    assert "--val-fraction 0.1" in line and "--val-data PATH" in line, line


@pytest.mark.parametrize("entry", ["checkpoints", "metrics.jsonl"])
def test_overwrite_refuses_a_symlinked_entry_before_deleting_anything(
    tmp_path, corpus, capsys, entry
) -> None:
    """SY1: 'Cannot call rmtree on a symbolic link', after config.json was deleted."""
    precious, out = tmp_path / "precious", tmp_path / "run"
    for folder in (precious, out):
        folder.mkdir(parents=True)
    (precious / "file.txt").write_text("keep me")
    (out / "config.json").write_text("{}")
    target = precious if entry == "checkpoints" else precious / "file.txt"
    (out / entry).symlink_to(target)
    line = train(capsys, tmp_path, "--data", str(corpus), "--overwrite")
    assert f"--overwrite: {str(out / entry)!r} (-> {str(target)!r}): a symbolic link" in line
    assert "nothing was deleted" in line, line
    assert (out / "config.json").exists()
    assert (out / entry).is_symlink() and (precious / "file.txt").read_text() == "keep me"


@pytest.mark.parametrize("entry", ["checkpoints", "metrics.jsonl", "summary.json"])
def test_overwrite_refuses_a_dangling_symlinked_entry_too(tmp_path, corpus, capsys, entry) -> None:
    """SY1 for a link whose target is gone (checkpoints kept on a disk not mounted now): it is
    an entry of the run all the same, refused before anything is deleted; the run never
    writes through it (which would create the target outside the run folder)."""
    out, target = tmp_path / "run", tmp_path / "unmounted" / entry
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / entry).symlink_to(target)
    line = train(capsys, tmp_path, "--data", str(corpus), "--overwrite")
    assert f"--overwrite: {str(out / entry)!r} (-> {str(target)!r}): a symbolic link" in line
    assert "nothing was deleted" in line, line
    assert (out / "config.json").exists() and (out / entry).is_symlink()
    assert not target.exists() and not target.parent.exists()


@pytest.mark.parametrize(
    ("code", "why"),
    [(errno.EROFS, "is on a read-only file system"), (errno.EACCES, "is not writable")],
)
def test_a_read_only_run_folder_is_told_so(tmp_path, corpus, capsys, monkeypatch, code, why):
    """RO2: the lock error advised 'delete it and retry' on a read-only file system (root
    writes through file modes, so the file system's errno is simulated)."""
    from gradstep_demo import run_lock

    out = tmp_path / "run"
    out.mkdir()

    def read_only(path: Any, *args: Any, **kwargs: Any) -> Any:
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(run_lock, "open", read_only, raising=False)
    line = train(capsys, tmp_path, "--data", str(corpus), "--resume")
    assert f"--out {str(out)!r} {why}" in line and ".gradstep.lock" in line, line
    assert f"pass --resume {str(out)!r} with a new, writable --out" in line
    assert "delete it" not in line


# ------------------------------------------------------------ H2-H6: not regular files


def _unblocked(capsys, tmp_path: Path, *flags: str) -> str:
    """``gpt``'s refusal, from a thread: opening a FIFO would block, and this must not."""
    result: list[str] = []
    run = lambda: result.append(train(capsys, tmp_path, *flags))  # noqa: E731
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the refusal blocked (was the named pipe opened?)"
    return result[0]


@pytest.mark.parametrize("flag", ["--data", "--val-data"])
def test_special_files_are_not_regular_files_and_are_never_opened(
    tmp_path, corpus, capsys, flag
) -> None:
    """H2, H3, H4 and a socket: 'no such file or folder' for a file that exists."""
    fifo, sock_path = tmp_path / "fifo.jsonl", tmp_path / "s.sock"
    os.mkfifo(fifo)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(sock_path))
    cases = {fifo: "a named pipe", sock_path: "a socket"}
    cases.update({Path(p): "a character device" for p in ("/dev/zero", "/dev/urandom")
                  if Path(p).exists()})  # fmt: skip
    try:
        for path, kind in cases.items():
            data = [str(path)] if flag == "--data" else [str(corpus), flag, str(path)]
            line = _unblocked(capsys, tmp_path, "--data", *data)
            assert f"{flag} {str(path)!r} is {kind}, not a regular file" in line, line
    finally:
        sock.close()


def test_a_folder_of_a_symlinked_folder_or_a_pipe_says_so(tmp_path, corpus, capsys) -> None:
    """H6: 'no files found (hidden ones are skipped)' for a folder whose only entry is a
    symlinked folder (not followed), or a named pipe."""
    linkdir = tmp_path / "linkdir"
    linkdir.mkdir()
    (linkdir / "t").symlink_to(corpus, target_is_directory=True)
    line = train(capsys, tmp_path, "--data", str(linkdir))
    assert "'t' is a symlinked folder (not followed)" in line, line
    assert f"name it: --data {linkdir / 't'}" in line, line
    pipes = tmp_path / "pipes"
    pipes.mkdir()
    os.mkfifo(pipes / "p.jsonl")
    line = _unblocked(capsys, tmp_path, "--data", str(pipes))
    assert "'p.jsonl' is a named pipe" in line, line


# ------------------------------------------------------------ T3, S7, S8: tokenizers


def test_an_hf_model_without_a_tokenizer_is_told_to_pass_one(tmp_path, capsys, hf_dirs) -> None:
    """T3: chat data for an hf: model without tokenizer files was told 'the demo GPT reads
    bytes'."""
    data = jsonl(tmp_path / "chat.jsonl", [CHAT] * 4)
    line = train(capsys, tmp_path, "--data", str(data), model=hf_dirs["notok"])
    assert f"model 'hf:{hf_dirs['notok']}' has no tokenizer" in line, line
    assert "pass --tokenizer PATH" in line and "demo GPT" not in line, line


def _tokenizer(prefix: str) -> Any:
    from tests.support import hf_assets

    tokenizer = hf_assets.load_tokenizer()
    tokenizer.chat_template = prefix + hf_assets.CHAT_TEMPLATE
    return tokenizer


@pytest.mark.parametrize(
    ("prefix", "raised"),
    [
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),  # S7
        ("{{ cycler.__init__.__globals__.os.system('true') }}", "SecurityError"),  # S10
        ("{% if %}", "TemplateSyntaxError"),
    ],
)
def test_a_template_at_fault_is_named_not_the_record(tmp_path: Path, prefix, raised) -> None:
    """S7: a template the sandbox stops was reported as 'fix the record' (and, with
    --skip-bad-records, skipped every record)."""
    pytest.importorskip("transformers")
    data = jsonl(tmp_path / "chat.jsonl", chats(4))
    for skip in (False, True):
        cfg = TrainConfig(data=str(data), seq_len=32, skip_bad_records=skip)
        with pytest.raises(TemplateError) as exc:
            load_source(cfg, _tokenizer(prefix))
        message = str(exc.value)
        assert "line 1: the chat template of the tokenizer in" in message, message
        assert f"is at fault, not the record: rendering raised {raised}" in message
        assert "--tokenizer PATH" in message and "fix the record" not in message


def test_a_record_the_template_refuses_names_the_record(tmp_path: Path) -> None:
    """S8 and S9 are kept: the template's own raise_exception on record 4 names line 4 (and
    --skip-bad-records skips it). A record the template fails on otherwise (here an
    UndefinedError) names the line and the tokenizer: either may be at fault."""
    pytest.importorskip("transformers")
    bad = {"messages": [{"role": "user", "content": "bad content"}, CHAT["messages"][1]]}
    data = jsonl(tmp_path / "chat.jsonl", [*chats(3), bad])
    test = "{% for m in messages %}{% if m['content'] == 'bad content' %}"
    checks = {
        "TemplateError": test + "{{ raise_exception('bad content') }}{% endif %}{% endfor %}",
        "UndefinedError": test + "{{ m.nothing.deeper }}{% endif %}{% endfor %}",
    }
    for raised, check in checks.items():
        cfg = TrainConfig(data=str(data), val_data=str(data), seq_len=32)
        tokenizer = _tokenizer(check)
        with pytest.raises(DataError) as exc:
            load_source(cfg, tokenizer)
        message = str(exc.value)
        assert "line 4: " in message and f"({raised}: " in message, message
        assert "fix the record, or pass --skip-bad-records" in message
        if raised == "TemplateError":
            assert "line 4: the chat template refused it (TemplateError: bad content)" in message
        else:
            assert f"the tokenizer in {tokenizer.name_or_path!r} failed on it" in message
        skipped = TrainConfig(data=str(data), val_data=str(data), seq_len=32, skip_bad_records=True)
        assert load_source(skipped, _tokenizer(check)).counts()["bad_skipped"] == 2


# ------------------------------------------------------- notes and model-folder refusals


def test_val_data_that_repeats_the_training_data_gets_a_note(tmp_path, capsys) -> None:
    """V7: --val-data equal to --data ran without a word; part of it too."""
    data = jsonl(tmp_path / "pc.jsonl", pairs(20))
    load_source(TrainConfig(data=str(data), val_data=str(data), seq_len=32))
    err = capsys.readouterr().err
    assert "note: every --val-data record is also in --data" in err, err
    val = jsonl(tmp_path / "val.jsonl", pairs(25)[15:])
    load_source(TrainConfig(data=str(data), val_data=str(val), seq_len=32))
    assert "note: 5 of the 10 --val-data records are also in --data" in capsys.readouterr().err
    for name in ("a", "b"):
        (tmp_path / f"{name}.txt").write_text(f"text {name}\n" * 50)
    load_source(TrainConfig(data=f"{tmp_path}/*.txt", val_data=str(tmp_path / "a.txt")))
    assert "note: every --val-data file is also in --data" in capsys.readouterr().err


def test_lora_rank_and_aux_loss_say_what_is_true(capsys, hf_dirs) -> None:
    """LR9: --lora 100000 on a 32-wide model ran without a word. M6: the refusal of
    --aux-loss-coef on a dense model named the field aux_loss_coef, not the flag."""
    pytest.importorskip("peft")
    from gradstep_demo.config import ConfigError
    from gradstep_demo.hf_model import build_model, hf_config

    for rank in (100_000, 8):
        build_model(TrainConfig(model=f"hf:{hf_dirs['llama']}", seq_len=32, lora=rank))
        note = f"note: --lora {rank} is above the rank of every adapted layer (at most 32"
        assert (note in capsys.readouterr().err) == (rank > 32)
    cfg = TrainConfig(model=f"hf:{hf_dirs['llama']}", seq_len=32, aux_loss_coef=0.1)
    with pytest.raises(ConfigError, match=r"^--aux-loss-coef: model .* has no router loss"):
        hf_config(cfg)


def test_a_model_folders_code_is_refused_and_never_run(tmp_path, capsys, monkeypatch, hf_dirs):
    """S5: transformers asked '[y/N]' on a terminal (a 'y' ran the folder's code), and the
    refusal said to pass trust_remote_code=True, which no flag does. S1: a pickled .bin
    naming code was refused with torch's advice to load it with weights_only=False."""
    import torch

    remote, evil, marker = tmp_path / "remote", tmp_path / "evil", tmp_path / "ran"
    for folder in (remote, evil):
        shutil.copytree(hf_dirs["llama"], folder)
    config = json.loads((remote / "config.json").read_text())
    config.update(model_type="evilllama", auto_map={"AutoConfig": "modeling_evil.EvilConfig"})
    (remote / "config.json").write_text(json.dumps(config))
    (remote / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (evil / "model.safetensors").unlink()
    torch.save({"x": os.system}, evil / "pytorch_model.bin")  # a pickle naming code
    monkeypatch.setattr("builtins.input", lambda *a: "y")  # a user answering the prompt
    data = jsonl(tmp_path / "pc.jsonl", pairs(8))
    line = train(capsys, tmp_path, "--data", str(data), model=remote)
    assert "gradstep never runs a model folder's code" in line and "trust_remote" not in line
    line = train(capsys, tmp_path, "--data", str(data), model=evil)
    assert f"the weights in {evil} are a pickle that holds more than tensors (it refers to" in line
    assert "posix.system" in line or "os.system" in line, line
    assert "nothing in it was run" in line and "weights_only" not in line, line
    assert not marker.exists()
