#!/usr/bin/env python3
"""Re-run the rows of robustness-3 that issue 28 names, with the current code.

Usage: ``python tools/robustness3_rows.py [--rows S4,V5] [--work DIR] [--keep] [--list]``.

Each row sets up its case in a scratch folder (tiny data; tiny Hugging Face models and a
tokenizer built here by tests/support/hf_assets.py, nothing downloaded), runs the review's
reproduction through the CLI as a user would (``python -m gradstep`` subprocesses, each
with a timeout) and reports the exit status and the decisive line: the error line, or the
evidence (a payload's marker file, what was published, the records of each side). Prints
one markdown table ``| row | before | now |`` (before: quoted briefly from
shared/reviews/robustness-3.md) and exits 0. The forged checkpoints are built with
tests/checkpoint/forge.py. FS1/FS2 need a small tmpfs and RO2/RO4 a read-only one (root):
where mounting fails those rows say so (FS3 covers the file-size limit with RLIMIT_FSIZE).
``--work`` must be a new or empty folder; without ``--keep`` it is removed at the end. Each
row's seconds go to stderr. A full run takes about 10 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pickle
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support.hf_assets, tests.checkpoint.forge

HF = ["--seq-len", "64", "--micro-batch-size", "2", "--accum-steps", "1", "--max-steps", "2"]
HF += ["--sample-tokens", "0", "--eval-batches", "1", "--device", "cpu"]
# What robustness-3.md reported for each row (quoted briefly).
# fmt: off
BEFORE = {
    "S4": "payload ran (`PWNED_dcp` created), then rc 1 raw `AttributeError: 'int' object "
        "has no attribute 'storage_meta'` traceback",
    "S4b": "(not a review row: forge.py's other forgery, a payload in one optimizer entry "
        "of a `.distcp` file, checksums recomputed; `export`)",
    "S11": "same forged checkpoint, `train --out runs/fsdp_evil --resume --max-steps 6`: "
        "payload ran again, rc 1 traceback",
    "S12": "(OK) payload in `.metadata` without updating the manifest: rc 0, step 4 "
        "detected as corrupted, exported step 2 instead; payload not run",
    "FS1": "400 KiB tmpfs: rc 1, raw traceback ending `SafetensorError: ... No space left "
        "on device (os error 28)`; nothing left behind",
    "FS2": "FS1 again on the same tmpfs: same traceback; no stale `.exp.export-tmp`",
    "FS3": "`ulimit -f 200`: rc 1, the same traceback with `File too large (os error 27)`; "
        "no folder published",
    "LIVE": "trainer with `--save-every 1 --keep-checkpoints 1` running: 5 of 6 exports rc 1 "
        "`No such file or directory: .../step-000143/model.safetensors`",
    "CONC": "two exports to one `--out`: the loser fails with a raw `Directory not empty "
        "('.../exp/c')` or `No such file or directory ('.../exp/.c.export-tmp')`",
    "E14": "empty current folder, `export ../runs/lora1 --out \"\"`: rc 0, `exported ... "
        "to .` (in place, not atomic)",
    "E10": "`--out \"\"` in a non-empty folder: rc 2 `--out '.' is not empty`",
    "E23": "rc 2, the wrong reason: `trained on a randomly initialised base (--seed 0), "
        "which no Hugging Face folder holds ... pass --merge-lora`",
    "E24": "E23's run with `--merge-lora`: rc 2, the real cause (the folder is missing)",
    "E25": "E23's run, `--resume`: rc 2, folder missing",
    "RO4": "`export runs/lora1 --out mnt_ro/exp`: rc 1 `Read-only file system "
        "('.../mnt_ro/.exp.export-tmp'): ... write the run elsewhere (--out)`",
    "V5": "300 records: `--val-fraction 0.99` holds out 297, `0.999`: rc 0, `299 train "
        "records ..., 1 val records` (inverted, no note)",
    "D2": "1 good record + 1 bad, `--skip-bad-records`: rc 2 `no sequence to use (no record "
        "is left)` (the good record went to validation, unsaid)",
    "D5": "one chat without an assistant turn + one good: rc 2 `no sequence to use (1 record "
        "with no token to train on)` (the good one went to validation)",
    "D6": "1 record (assistant, then user): rc 2 `no record is left` (held out)",
    "D9": "1 record: rc 2 `no sequence to use (no record is left)`",
    "D18": "D9 with `--micro-batch-size 1 --accum-steps 1`: same message",
    "SY1": "`checkpoints -> ../../precious` + `config.json`, `train --overwrite`: rc 1 "
        "`Cannot call rmtree on a symbolic link`, no path named, config.json already gone",
    "RO2": "run on a read-only tmpfs, `--resume`: rc 2 `cannot open its lock file ... "
        "(Read-only file system); ... delete it and retry`",
    "T3": "`--model hf:llama_notok --data chat.jsonl`: rc 2 `{\"messages\"} records need a "
        "tokenizer with a chat template (--model hf:DIR); the demo GPT reads bytes`",
    "H2": "`--data fifo.jsonl` (a named pipe): rc 2 `no such file or folder`",
    "H3": "`--data /dev/zero`: rc 2 `no such file or folder`",
    "H4": "`--data /dev/urandom`: rc 2 `no such file or folder`",
    "H5": "(OK) pc.jsonl + `sub/again.jsonl -> ../pc.jsonl`: rc 0, 600 records (a "
        "symlinked file is read again)",
    "H6": "`--data linkdir` (only `t -> ../txt`): rc 2 `no files found (hidden ones are "
        "skipped)`, symlinked folders unmentioned",
    "H7": "(not a review row: a Unix socket as `--data`)",
    "S5": "`auto_map` to custom code: rc 2 `not a usable HF config (... contains custom code "
        "... pass trust_remote_code=True)`; transformers' `[y/N]` prompt printed first",
    "S7": "template `{{ ''.__class__.__mro__[1].__subclasses__() }}`: rc 2 `the chat template "
        "refused it (SecurityError: ...)` but it says 'fix the record'",
    "S8": "template calling `raise_exception('bad content')` on record 4: rc 2 naming line 4 "
        "and `TemplateError: bad content`",
    "S10": "template `{{ cycler.__init__.__globals__.os.system('touch ...') }}`: rc 2 "
        "SecurityError; nothing executed",
}
# fmt: on

ROWS: dict[str, Callable[[Case], str]] = {}


def row(name: str) -> Callable[[Callable[[Case], str]], Callable[[Case], str]]:
    """Register the function that reproduces ``name`` (a key of BEFORE)."""

    def add(fn: Callable[[Case], str]) -> Callable[[Case], str]:
        assert name in BEFORE, name
        ROWS[name] = fn
        return fn

    return add


@dataclass
class Done:
    """A finished CLI call: its status (None: killed at the timeout) and its output."""

    rc: int | None
    text: str

    def line(self, key: str = "error:") -> str:
        """The first line holding ``key`` (a traceback's last line first), and how many
        lines follow an error line."""
        lines = [ln.strip() for ln in self.text.splitlines() if ln.strip()]
        if "Traceback (most recent call last)" in self.text:
            return f"TRACEBACK, ending `{lines[-1]}`"
        hits = [i for i, ln in enumerate(lines) if key in ln]
        if not hits:
            return f"(no line with {key!r}; last line: {lines[-1] if lines else 'none'})"
        more = len(lines) - hits[0] - 1 if key == "error:" else 0
        return f"`{lines[hits[0]]}`" + (f" (+{more} lines after it)" if more else "")

    def now(self, key: str = "error:") -> str:
        return f"rc {self.rc}: {self.line(key)}"


class Case:
    """The scratch folder and the fixtures the rows share, each built on first use."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.mounts: list[Path] = []
        self.env = dict(os.environ, GRADSTEP_CACHE=str(work / "cache"), OMP_NUM_THREADS="1")
        self.env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")

    def start(self, *args: object, cwd: Path | None = None, fsize: int = 0) -> subprocess.Popen:
        def limit() -> None:
            if fsize:
                resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

        argv = [sys.executable, "-m", "gradstep", *map(str, args)]
        return subprocess.Popen(
            argv, cwd=cwd or self.work, env=self.env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, preexec_fn=limit,
        )  # fmt: skip

    def finish(self, proc: subprocess.Popen, timeout: float = 300) -> Done:
        try:
            out, _ = proc.communicate(timeout=timeout)
            return Done(proc.returncode, out)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            return Done(None, out + f"\nTIMEOUT: killed after {timeout:g} s")

    def cli(self, *args: object, timeout: float = 300, **kw: object) -> Done:
        return self.finish(self.start(*args, **kw), timeout)

    def hf(self, out: str, *args: object, model: object = None, timeout: float = 300) -> Done:
        """``train`` of the tiny Llama (or ``model``) for 2 steps into WORK/runs/``out``."""
        model = model or self.llama
        run = self.work / "runs" / out
        return self.cli("train", *HF, "--model", model, *args, "--out", run, timeout=timeout)

    def train(self, out: str, *args: object) -> Path:
        """A fixture run (its failure fails the rows that need it)."""
        done = self.hf(out, *args, timeout=600)
        if done.rc != 0:
            raise RuntimeError(f"fixture run {out} failed: {done.now()}")
        return self.work / "runs" / out

    # -- models and data

    def model(self, name: str, seed: int = 0, tokenizer: bool = True) -> Path:
        from tests.support import hf_assets
        from transformers.utils import logging

        logging.disable_progress_bar()
        dest = self.work / name
        if not dest.exists():
            hf_assets.model_dir(dest, "llama", seed=seed, tokenizer=tokenizer)
        return dest

    @functools.cached_property
    def llama(self) -> str:
        return f"hf:{self.model('llama')}"

    def jsonl(self, name: str, records: list[object]) -> Path:
        path = self.work / name
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return path

    @functools.cached_property
    def pc(self) -> Path:
        words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota"]
        prompts = [f"Q{i}: " + " ".join(words[i % 7 :]) for i in range(300)]
        completions = [" " + " ".join(words[: i % 9 + 1]) for i in range(300)]
        pairs = zip(prompts, completions, strict=True)
        return self.jsonl("pc.jsonl", [{"prompt": p, "completion": c} for p, c in pairs])

    @functools.cached_property
    def chat(self) -> Path:
        def chat(i: int) -> list[dict[str, str]]:
            return [
                {"role": "user", "content": f"U{i} say {i * 7}"},
                {"role": "assistant", "content": f"{i * 7} said"},
            ]

        return self.jsonl("chat.jsonl", [{"messages": chat(i)} for i in range(300)])

    def tokenizer(self, name: str, template: str) -> Path:
        """The local tokenizer with its chat template replaced by ``template``."""
        from tests.support import hf_assets

        dest = hf_assets.tokenizer_dir(self.work / name)
        (dest / "chat_template.jinja").write_text(template)
        return dest

    # -- runs

    @functools.cached_property
    def pc1(self) -> Path:
        return self.train("pc1", "--data", self.pc, "--save-every", "2")

    @functools.cached_property
    def lora1(self) -> Path:
        flags = ["--data", self.chat, "--lora", "4", "--save-every", "2"]
        return self.train("lora1", *flags)

    @functools.cached_property
    def fsdp(self) -> Path:
        flags = ["--nproc-per-node", "2", "--strategy", "fsdp", "--max-steps", "4"]
        flags += ["--eval-batches", "2", "--save-every", "2"]
        return self.train("fsdp1", "--data", self.pc, *flags)

    # -- mounts

    def tmpfs(self, name: str, kib: int) -> Path | None:
        """A tmpfs of ``kib`` KiB at WORK/name (None where it cannot be mounted)."""
        folder = self.work / name
        if folder in self.mounts:
            return folder
        folder.mkdir()
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(folder)]
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            return None
        self.mounts.append(folder)
        return folder

    @functools.cached_property
    def read_only(self) -> Path | None:
        """A read-only tmpfs holding a copy of pc1 as ``run`` (None: cannot mount)."""
        mnt = self.tmpfs("mnt_ro", 8192)
        if mnt is None:
            return None
        shutil.copytree(self.pc1, mnt / "run", symlinks=True)
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        return mnt

    def unmount(self) -> None:
        for folder in reversed(self.mounts):
            subprocess.run(["umount", str(folder)], capture_output=True)


NO_MOUNT = "not reproduced: a tmpfs cannot be mounted here (needs root)"


def marker_says(marker: Path) -> str:
    return "PAYLOAD RAN (its marker file exists)" if marker.exists() else "payload did not run"


# ---------------------------------------------------------------- S4, S11, S12: forged DCP


def forged(c: Case, name: str, how: str) -> tuple[Path, Path]:
    """A copy of the 2-rank FSDP run whose step-4 checkpoint is forged; (run, marker).
    ``how``: metadata / entry (forge.py, checksums recomputed) or stale (payload in
    ``.metadata``, checksums left as they were)."""
    from tests.checkpoint import forge

    run, marker = c.work / "runs" / name, c.work / f"PWNED-{name}"
    shutil.copytree(c.fsdp, run)
    step = run / "checkpoints" / "step-000004"
    if how == "stale":
        (step / "dcp" / ".metadata").write_bytes(pickle.dumps(forge.Payload(marker)))
    else:
        {"metadata": forge.forge_metadata, "entry": forge.forge_entry}[how](step, marker)
    return run, marker


@row("S4")
def s4(c: Case) -> str:
    run, marker = forged(c, "s4", "metadata")
    done = c.cli("export", run, "--out", c.work / "exp" / "s4")
    return f"{done.now()}; {marker_says(marker)}"


@row("S4b")
def s4b(c: Case) -> str:
    run, marker = forged(c, "s4b", "entry")
    done = c.cli("export", run, "--out", c.work / "exp" / "s4b")
    return f"{done.now()}; {marker_says(marker)}"


@row("S11")
def s11(c: Case) -> str:
    run, marker = forged(c, "s11", "metadata")
    done = c.cli("train", "--out", run, "--resume", "--max-steps", "6", timeout=400)
    return f"{done.now()}; {marker_says(marker)}"


@row("S12")
def s12(c: Case) -> str:
    run, marker = forged(c, "s12", "stale")
    done = c.cli("export", run, "--out", c.work / "exp" / "s12")
    key = "exported" if done.rc == 0 else "error:"
    return f"{done.now(key)}; {marker_says(marker)}"


# ---------------------------------------------------------- FS1-FS3: full disk, ulimit -f


def leftovers(folder: Path) -> str:
    names = sorted(p.name for p in folder.iterdir())
    return ", ".join(names) if names else "nothing"


@row("FS1")
def fs1(c: Case) -> str:
    mnt = c.tmpfs("mnt_small", 100)  # the config and tokenizer fit, the 207 KB weights do not
    if mnt is None:
        return NO_MOUNT + " (FS3 reproduces the failed write with RLIMIT_FSIZE)"
    done = c.cli("export", c.pc1, "--out", mnt / "exp")
    return f"100 KiB tmpfs: {done.now()}; left in the tmpfs: {leftovers(mnt)}"


@row("FS2")
def fs2(c: Case) -> str:
    return fs1(c)  # the same mount: a second export onto the same full disk


@row("FS3")
def fs3(c: Case) -> str:
    out = c.work / "exp_fs3" / "out"
    out.parent.mkdir()
    done = c.cli("export", c.pc1, "--out", out, fsize=100 * 1024)
    return f"RLIMIT_FSIZE 100 KiB: {done.now()}; left beside --out: {leftovers(out.parent)}"


# ---------------------------------------------------------------- LIVE, CONC: concurrency


def wait_for(test: Callable[[], bool], seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if test():
            return True
        time.sleep(0.2)
    return False


def exported_step(out: Path) -> str:
    return str(json.loads((out / "gradstep_export.json").read_text())["step"])


@row("LIVE")
def live(c: Case) -> str:
    run = c.work / "runs" / "live"
    flags = ["--max-steps", "100000", "--save-every", "1", "--keep-checkpoints", "1"]
    chat = ["--model", c.llama, "--data", c.chat, "--lora", "4"]
    trainer = c.start("train", *HF, *chat, *flags, "--out", run)
    steps, errors, during = [], [], 0
    try:
        if not wait_for(lambda: any((run / "checkpoints").glob("step-*")), 300):
            return f"not reproduced: the trainer saved nothing: {c.finish(trainer, 5).now()}"
        for i in range(6):
            done = c.cli("export", run, "--out", c.work / "exp" / f"live{i}")
            during += trainer.poll() is None
            if done.rc == 0:
                steps.append(exported_step(c.work / "exp" / f"live{i}"))
            else:
                errors.append(done.now())
    finally:
        os.killpg(trainer.pid, signal.SIGTERM)
        c.finish(trainer, 60)
    said = f"{len(steps)} of 6 exports rc 0 (steps {', '.join(steps) or 'none'})"
    return f"{said}, {during} of 6 ended while the trainer still ran; " + (
        "; ".join(errors) if errors else "no error"
    )


def export_kind(out: Path) -> str:
    """What the published folder holds: one export's files, or a mix."""
    if not out.exists():
        return "nothing published"
    names = {p.name for p in out.iterdir()}
    kind = json.loads((out / "gradstep_export.json").read_text())["kind"]
    mixed = "model.safetensors" in names and "adapter_model.safetensors" in names
    return f"published {kind} " + ("MIXED with the other's files" if mixed else "(its own files)")


@row("CONC")
def conc(c: Case) -> str:
    _ = (c.lora1, c.pc1)  # both runs exist before the race
    trials, lost = [], []
    for i, delay in enumerate((0.0, 0.5, 1.2)):
        out = c.work / "conc" / f"c{i}"
        first = c.start("export", c.lora1, "--out", out)
        time.sleep(delay)
        second = c.start("export", c.pc1, "--out", out)
        a, b = c.finish(first), c.finish(second)
        lost += [d.now().replace(str(out), ".../c") for d in (a, b) if d.rc != 0]
        trials.append(f"offset {delay:g} s: rc {a.rc}/{b.rc}, {export_kind(out)}")
    hidden = [p.name for p in (c.work / "conc").iterdir() if p.name.startswith(".")]
    said = f"adapter/full export, 3 trials: {'; '.join(trials)}; temporary folders left: "
    return said + f"{', '.join(hidden) or 'none'}; the losers: {' / '.join(sorted(set(lost)))}"


# ------------------------------------------------------------------- export refusals


@row("E14")
def e14(c: Case) -> str:
    here = c.work / "emp2"
    here.mkdir()
    done = c.cli("export", c.lora1, "--out", "", cwd=here)
    return f"{done.now()}; the current folder holds: {leftovers(here)}"


@row("E10")
def e10(c: Case) -> str:
    here = c.work / "nonempty"
    here.mkdir()
    (here / "notes.txt").write_text("mine\n")
    return c.cli("export", c.lora1, "--out", "", cwd=here).now()


@functools.cache
def moved_base(c: Case) -> Path:
    """A LoRA run on pretrained ``llama_tmp2`` (seed 7: not the seed's init), whose base
    folder was then moved away."""
    base = c.model("llama_tmp2", seed=7)
    flags = ["--data", c.pc, "--lora", "4", "--save-every", "2"]
    run = c.train("loratmp2", "--model", f"hf:{base}", *flags)
    base.rename(base.with_name("llama_tmp2_moved"))
    return run


@row("E23")
def e23(c: Case) -> str:
    return c.cli("export", moved_base(c), "--out", c.work / "exp" / "e23").now()


@row("E24")
def e24(c: Case) -> str:
    return c.cli("export", moved_base(c), "--out", c.work / "exp" / "e24", "--merge-lora").now()


@row("E25")
def e25(c: Case) -> str:
    return c.cli("train", "--out", moved_base(c), "--resume", "--max-steps", "4").now()


@row("RO4")
def ro4(c: Case) -> str:
    mnt = c.read_only
    return NO_MOUNT if mnt is None else c.cli("export", c.lora1, "--out", mnt / "exp").now()


# -------------------------------------------------------- V5, D*: the validation split


def sides(done: Done) -> str:
    found = re.search(r"([\d,]+) train records.*?([\d,]+) val records", done.text)
    if done.rc != 0 or not found:
        return done.now()
    return f"rc {done.rc}: {found[1]} train records, {found[2]} val records"


@row("V5")
def v5(c: Case) -> str:
    said = []
    for fraction in ("0.99", "0.999"):
        done = c.hf("d", "--data", c.pc, "--val-fraction", fraction, "--overwrite")
        said.append(f"{fraction}: {sides(done)}")
    return "; ".join(said)


def small_file(c: Case, name: str, lines: list[str], *flags: str) -> str:
    path = c.work / name
    path.write_text("".join(line + "\n" for line in lines))
    return c.hf("d", "--data", path, *flags, "--overwrite").now()


GOOD = json.dumps({"prompt": "What is two and two?", "completion": " Four."})


@row("D2")
def d2(c: Case) -> str:
    return small_file(c, "bad_json.jsonl", [GOOD, '{"prompt": "x",'], "--skip-bad-records")


@row("D5")
def d5(c: Case) -> str:
    bad = {"messages": [{"role": "user", "content": "hello there"}]}
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    return small_file(c, "noasst.jsonl", [json.dumps(bad), json.dumps(good)])


@row("D6")
def d6(c: Case) -> str:
    turns = [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Hi."}]
    return small_file(c, "order.jsonl", [json.dumps({"messages": turns})])


@row("D9")
def d9(c: Case) -> str:
    return small_file(c, "oneline.jsonl", [GOOD])


@row("D18")
def d18(c: Case) -> str:
    return small_file(c, "oneline.jsonl", [GOOD], "--micro-batch-size", "1", "--accum-steps", "1")


# ------------------------------------------------------- SY1, RO2: the run folder itself


@row("SY1")
def sy1(c: Case) -> str:
    precious, run = c.work / "precious", c.work / "runs" / "sym1"
    precious.mkdir()
    (precious / "file.txt").write_text("keep me\n")
    run.mkdir(parents=True)
    (run / "checkpoints").symlink_to("../../precious")
    shutil.copy(c.pc1 / "config.json", run / "config.json")
    done = c.hf("sym1", "--data", c.pc, "--overwrite")
    kept = "config.json kept" if (run / "config.json").exists() else "config.json DELETED"
    target = "target intact" if (precious / "file.txt").exists() else "target DAMAGED"
    return f"{done.now()}; {kept}; {target}"


@row("RO2")
def ro2(c: Case) -> str:
    mnt = c.read_only
    if mnt is None:
        return NO_MOUNT
    return c.cli("train", "--out", mnt / "run", "--resume", "--max-steps", "6").now()


# ---------------------------------------------------------------- T3, H*: what --data is


@row("T3")
def t3(c: Case) -> str:
    notok = c.model("llama_notok", tokenizer=False)
    return c.hf("t3", "--data", c.chat, model=f"hf:{notok}").now()


def data_is(c: Case, data: object, key: str = "error:") -> str:
    done = c.hf("h", "--data", data, "--overwrite", timeout=120)
    return done.now(key if done.rc == 0 else "error:")


@row("H2")
def h2(c: Case) -> str:
    os.mkfifo(c.work / "fifo.jsonl")
    return data_is(c, c.work / "fifo.jsonl")


@row("H3")
def h3(c: Case) -> str:
    return data_is(c, "/dev/zero")


@row("H4")
def h4(c: Case) -> str:
    return data_is(c, "/dev/urandom")


@row("H5")
def h5(c: Case) -> str:
    folder = c.work / "linkdata"
    (folder / "sub").mkdir(parents=True)
    shutil.copy(c.pc, folder / "pc.jsonl")
    (folder / "sub" / "again.jsonl").symlink_to("../pc.jsonl")
    return data_is(c, folder, "train records")


@row("H6")
def h6(c: Case) -> str:
    txt, folder = c.work / "txt", c.work / "linkdir"
    txt.mkdir()
    for i in range(5):
        (txt / f"doc{i}.txt").write_text(f"document {i}: " + "some words of text " * 200)
    folder.mkdir()
    (folder / "t").symlink_to("../txt")
    return data_is(c, folder)


@row("H7")
def h7(c: Case) -> str:
    path = c.work / "sock.jsonl"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        return data_is(c, path)


# --------------------------------------------------- S5, S7, S8, S10: code in a model folder


@row("S5")
def s5(c: Case) -> str:
    remote, marker = c.work / "remote", c.work / "PWNED-s5"
    shutil.copytree(c.model("llama"), remote)
    config = json.loads((remote / "config.json").read_text())
    config.update(
        model_type="evilllama",
        auto_map={
            "AutoConfig": "modeling_evil.EvilConfig",
            "AutoModelForCausalLM": "modeling_evil.EvilModel",
        },
    )
    (remote / "config.json").write_text(json.dumps(config))
    (remote / "modeling_evil.py").write_text(f"import os\nos.system('touch {marker}')\n")
    done = c.hf("s5", "--data", c.pc, model=f"hf:{remote}")
    prompt = "a [y/N] prompt printed" if "[y/N]" in done.text else "no [y/N] prompt"
    return f"{done.now()}; {prompt}; {marker_says(marker)}"


def with_template(c: Case, name: str, template: str) -> Done:
    tok = c.tokenizer(name, template)
    return c.hf(name, "--tokenizer", tok, "--data", c.chat)


@row("S7")
def s7(c: Case) -> str:
    from tests.support.hf_assets import CHAT_TEMPLATE

    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    return with_template(c, "tok_j1", escape + CHAT_TEMPLATE).now()


@row("S8")
def s8(c: Case) -> str:
    from tests.support.hf_assets import CHAT_TEMPLATE

    raising = "{% if messages[0]['content'].startswith('U3 ') %}"
    raising += "{{ raise_exception('bad content') }}{% endif %}"
    return with_template(c, "tok_raise", raising + CHAT_TEMPLATE).now()


@row("S10")
def s10(c: Case) -> str:
    from tests.support.hf_assets import CHAT_TEMPLATE

    marker = c.work / "PWNED-s10"
    escape = f"{{{{ cycler.__init__.__globals__.os.system('touch {marker}') }}}}"
    done = with_template(c, "tok_j2", escape + CHAT_TEMPLATE)
    return f"{done.now()}; {marker_says(marker)}"


# ---------------------------------------------------------------------------- the table


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", help="comma-separated row ids (default: all)")
    parser.add_argument("--work", type=Path, help="scratch folder (default: a new one in /tmp)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    parser.add_argument("--list", action="store_true", help="list the rows and exit")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(f"{name}: {BEFORE[name]}" for name in ROWS))
        return 0
    names = [n.strip() for n in args.rows.split(",")] if args.rows else list(ROWS)
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        parser.error(f"unknown rows {', '.join(unknown)}; known: {', '.join(ROWS)}")
    work = args.work or Path(tempfile.mkdtemp(prefix="robustness3-"))
    work.mkdir(parents=True, exist_ok=True)
    if any(work.iterdir()):
        parser.error(f"--work {str(work)!r} is not empty: the rows need a fresh folder")
    case = Case(work)
    print("| row | before (robustness-3.md) | now |\n|---|---|---|", flush=True)
    try:
        for name in names:
            start = time.monotonic()
            try:
                now = ROWS[name](case)
            except Exception as exc:  # a row that cannot be set up says so, the rest run
                now = f"SCRIPT ERROR while setting up the case: {type(exc).__name__}: {exc}"
            took = time.monotonic() - start
            print(f"| {name} | {cell(BEFORE[name])} | {cell(now)} |", flush=True)
            print(f"{name}: {took:.0f} s", file=sys.stderr, flush=True)
    finally:
        case.unmount()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
