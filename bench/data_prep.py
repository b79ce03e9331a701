"""Data preparation at scale: time to the first step and peak memory (issue 30 §2).

Reproduces robustness-3's large-data cases (shared/reviews/robustness-3.md) and a 1 GB text
corpus, each a ``gradstep train`` process of its own with an empty token cache (a fresh
``GRADSTEP_CACHE``), sampled from outside:

* BIG1: 290 MB of text in 11 files, the demo GPT (bytes);
* BIG2: 200,000 prompt/completion records (JSONL, ~32 MB), the tiny Llama;
* BIG3: 83 MB of text in 3 files of 27.6 MB, the tiny Llama; then again, reusing its store;
* BIG4: 5 MB of text as one file, and as 50 files, the tiny Llama;
* BUDGET1: 100,000 records, ``--micro-batch-size auto --global-batch 8 --memory-budget 1GiB``;
* BUDGET2: one 5 MB text file, ``--micro-batch-size auto --global-batch 4 --memory-budget 1GiB``;
* TWICE: BUDGET1 and BUDGET2 with a fixed micro-batch (auto used to tokenize twice);
* GB1: 1 GB of text in 8 files, the tiny Llama.

Everything is made here, deterministically, under ``--work``: the text is the standard
library's sources interleaved with seeded synthetic prose, the records seeded synthetic
functions; the tokenizer is a byte-level BPE (vocab 512) trained with ``tokenizers`` and the
model a 2-layer Llama (``tests/support/hf_assets.py``). Peak RSS: the sum of ``VmRSS`` over
the process tree, sampled every 10 ms from ``/proc``. Baseline: the peak of the same command
on a tiny corpus of the same kind (what the run costs without its data). Time to first
step, data preparation and the resident set after the step ("RSS training"): the run's own
``summary.json``. "tokenized once": the run said
``data: tokenized`` exactly once (and ``reused`` for a reuse).

Run: ``nice python bench/data_prep.py`` (about 30 minutes on 2 busy cores, most of it GB1);
``--cases BIG2,BUDGET1`` runs some; ``--gb 0.25`` shrinks GB1. Writes
bench/out/data_prep.md and data_prep.json.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from _common import BaseConfig, machine_info, markdown_table, write_outputs

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
from tests.support import hf_assets  # noqa: E402

MiB = 2**20
RUN = ["--max-steps", "1", "--eval-every", "0", "--eval-batches", "2", "--sample-tokens", "0",
       "--warmup", "0", "--device", "cpu"]  # fmt: skip
HF = ["--seq-len", "64"]
AUTO = ["--micro-batch-size", "auto", "--memory-budget", "1GiB"]
WORDS = (
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be",
    "by", "this", "are", "or", "from", "at", "which", "an", "model", "data", "step", "batch",
    "token", "gradient", "memory", "budget", "store", "file", "record", "value", "loss", "train",
    "function", "return", "class", "import", "error", "window", "layer", "weight", "update",
    "rank", "device", "shape", "exact",
)  # fmt: skip


@dataclass(frozen=True)
class Config(BaseConfig):
    work: str = "/tmp/gradstep-bench-data"
    cases: str = "BIG1,BIG2,BIG3,BIG3-reuse,BIG4-one,BIG4-many,BUDGET1,BUDGET2,TWICE1,TWICE2,GB1"
    gb: float = 1.0
    sample_ms: float = 10.0
    HELP = {
        "work": "folder for the corpora, the model, the runs and the token caches",
        "cases": "comma-separated cases to run",
        "gb": "size of GB1's corpus in GB",
    }


def _stdlib_sources() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
    return texts


def _prose(rng: random.Random, n_words: int) -> str:
    words = [rng.choice(WORDS) for _ in range(n_words)]
    lines = [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
    return ". ".join(lines).capitalize() + ".\n\n"


def write_text(path: Path, n_bytes: int, seed: int, sources: list[str]) -> None:
    """``n_bytes`` of stdlib sources interleaved with seeded prose (deterministic)."""
    rng, written, i = random.Random(seed), 0, seed
    with path.open("w", encoding="utf-8") as f:
        while written < n_bytes:
            part = sources[i % len(sources)] + "\n" + _prose(rng, rng.randint(50, 400))
            part = part[: n_bytes - written] if written + len(part.encode()) > n_bytes else part
            f.write(part)
            written += len(part.encode())
            i += 1


def write_records(path: Path, n: int, seed: int) -> None:
    """``n`` seeded prompt/completion records: a function's signature and docstring, its body."""
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as f:
        for k in range(n):
            name = f"{rng.choice(WORDS)}_{rng.choice(WORDS)}_{k}"
            args = ", ".join(rng.sample(WORDS, rng.randint(1, 3)))
            prompt = f'def {name}({args}):\n    """{_prose(rng, rng.randint(3, 10)).strip()}"""\n'
            body = "".join(
                f"    {rng.choice(WORDS)} = {rng.choice(WORDS)}({rng.randint(0, 99)})\n"
                for _ in range(rng.randint(1, 4))
            )
            f.write(json.dumps({"prompt": prompt, "completion": body + "    return None\n"}))
            f.write("\n")


def corpora(work: Path, gb: float, needed: set[str]) -> dict[str, Path]:
    """The ``needed`` cases' data (made once, kept between runs of the script)."""
    data, sources = work / "data", None
    files = {
        "corpus": [(f"f{i:02d}.txt", 290_000_000 // 11) for i in range(11)],
        "c3": [(f"c{i}.txt", 27_600_000) for i in range(3)],
        "one5": [("one.txt", 5_000_000)],
        "many5": [(f"m{i:02d}.txt", 100_000) for i in range(50)],
        "gb1": [(f"g{i}.txt", int(gb * 1e9) // 8) for i in range(8)],
        "tiny": [("tiny.txt", 40_000)],
    }
    out = {}
    for name, parts in files.items():
        folder = data / (f"{name}-{gb:g}" if name == "gb1" else name)
        out[name] = folder
        if name not in needed or (folder / ".done").exists():
            continue
        sources = sources or _stdlib_sources()
        folder.mkdir(parents=True, exist_ok=True)
        for seed, (file, size) in enumerate(parts):
            write_text(folder / file, size, seed, sources)
        (folder / ".done").write_text("")
    for name, n in (("big.jsonl", 200_000), ("b100k.jsonl", 100_000), ("tiny.jsonl", 400)):
        out[name] = data / name
        if name in needed and not out[name].exists():
            write_records(data / (name + ".tmp"), n, seed=n)
            os.replace(data / (name + ".tmp"), out[name])
    return out


def llama(work: Path) -> Path:
    """The tiny Llama with its local BPE tokenizer (vocab 512), made once."""
    folder = work / "llama"
    if not (folder / "config.json").exists():
        hf_assets.model_dir(folder, "llama", seed=0)
    return folder


class Sampler(threading.Thread):
    """The process tree's summed VmRSS, every ``interval_ms``, read from /proc."""

    def __init__(self, pid: int, interval_ms: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval, self.peak = pid, interval_ms / 1000, 0

    def _tree(self, pid: int) -> list[int]:
        out = [pid]
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    out += [q for child in f.read().split() for q in self._tree(int(child))]
        except OSError:
            pass
        return out

    def _rss(self, pid: int) -> int:
        try:
            with open(f"/proc/{pid}/status") as f:
                line = next(x for x in f if x.startswith("VmRSS:"))
            return int(line.split()[1]) * 1024
        except (OSError, StopIteration, ValueError):
            return 0

    def run(self) -> None:
        while os.path.exists(f"/proc/{self.pid}"):
            self.peak = max(self.peak, sum(self._rss(p) for p in self._tree(self.pid)))
            time.sleep(self.interval)


def train(args: list[str], out: Path, cache: Path, interval_ms: float) -> dict:
    """One ``gradstep train`` under the sampler: its peak, summary and what it said."""
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "GRADSTEP_CACHE": str(cache), "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [sys.executable, "-m", "gradstep", "train", *args, "--out", str(out)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    sampler = Sampler(proc.pid, interval_ms)
    sampler.start()
    stdout, stderr = proc.communicate()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {
        "peak": sampler.peak,
        "wall": time.perf_counter() - start,
        "first_step": summary["time_to_first_step_s"],
        "data_prep": summary["data_prep_s"],
        "training_rss": summary.get("rss_last_step_mb"),
        "tokenized": stderr.count("data: tokenized "),
        "reused": stderr.count("data: reused the token store"),
        "data_line": next((x for x in stderr.splitlines() if x.startswith("data: /")), ""),
    }


@dataclass(frozen=True)
class Case:
    name: str
    corpus: str
    """What the table calls its data."""
    data: str
    """Its key in :func:`corpora`."""
    model: str
    """``gpt`` (bytes) or ``llama`` (the tiny Llama and its BPE)."""
    flags: tuple[str, ...] = ()
    budget_mib: int | None = None
    reuse: str | None = None
    """Run on the token cache that case left (its store reused)."""

    @property
    def tiny(self) -> str:
        return "tiny.jsonl" if self.data.endswith(".jsonl") else "tiny"


BUDGET1 = (*HF, "--global-batch", "8", "--max-steps", "2")
BUDGET2 = (*HF, "--global-batch", "4")
CASES = [
    Case("BIG1", "290 MB text, 11 files", "corpus", "gpt"),
    Case("BIG2", "200,000 prompt/completion records (JSONL)", "big.jsonl", "llama", tuple(HF)),
    Case("BIG3", "83 MB text, 3 files", "c3", "llama", tuple(HF)),
    Case("BIG3-reuse", "83 MB text, 3 files, again", "c3", "llama", tuple(HF), reuse="BIG3"),
    Case("BIG4-one", "5 MB text, 1 file", "one5", "llama", tuple(HF)),
    Case("BIG4-many", "5 MB text, 50 files", "many5", "llama", tuple(HF)),
    Case("BUDGET1", "100,000 records, auto, 1 GiB", "b100k.jsonl", "llama", (*BUDGET1, *AUTO),
         1024),
    Case("BUDGET2", "5 MB text, 1 file, auto, 1 GiB", "one5", "llama", (*BUDGET2, *AUTO), 1024),
    Case("TWICE1", "BUDGET1 with --micro-batch-size 8", "b100k.jsonl", "llama",
         (*BUDGET1, "--micro-batch-size", "8")),
    Case("TWICE2", "BUDGET2 with --micro-batch-size 4", "one5", "llama",
         (*BUDGET2, "--micro-batch-size", "4")),
    Case("GB1", "1 GB text, 8 files", "gb1", "llama", ("--seq-len", "128")),
]  # fmt: skip


def _args(case: Case, data: Path, model: Path) -> list[str]:
    chosen = ["--model", f"hf:{model}"] if case.model == "llama" else []
    return [*chosen, "--data", str(data), *RUN, *case.flags]


def run_case(case: Case, paths: dict, model: Path, work: Path, cfg: Config, baselines: dict):
    """The case's run and its baseline's (the same command on a tiny corpus)."""
    caches = work / "caches"
    cache = caches / (case.reuse or case.name)
    if case.reuse is None:
        shutil.rmtree(cache, ignore_errors=True)
    run = train(_args(case, paths[case.data], model), work / "runs" / case.name, cache,
                cfg.sample_ms)  # fmt: skip
    key = (case.model, case.flags, case.tiny)
    if key not in baselines:
        shutil.rmtree(caches / "tiny", ignore_errors=True)
        baselines[key] = train(_args(case, paths[case.tiny], model), work / "runs" / "tiny",
                               caches / "tiny", cfg.sample_ms)["peak"]  # fmt: skip
    base = baselines[key]
    budget = case.budget_mib * MiB if case.budget_mib else None
    once = run["reused"] == 1 if case.reuse else run["tokenized"] == 1
    return {
        "case": case.name,
        "corpus": case.corpus if case.name != "GB1" else f"{cfg.gb:g} GB text, 8 files",
        "tokenizer": "bytes (demo GPT)" if case.model == "gpt" else "BPE 512 (tiny Llama)",
        "first step s": round(run["first_step"], 1),
        "data prep s": round(run["data_prep"], 1),
        "tokenized once": ("reused" if case.reuse else "yes") if once else "NO",
        "peak RSS MiB": round(run["peak"] / MiB),
        "baseline MiB": round(base / MiB),
        "above baseline MiB": round((run["peak"] - base) / MiB),
        "RSS training MiB": None if run["training_rss"] is None else round(run["training_rss"]),
        "budget": f"{case.budget_mib} MiB" if budget else "-",
        "under budget?": ("yes" if run["peak"] <= budget else "NO") if budget else "-",
        "data": run["data_line"][:160],
    }


def main(argv: list[str] | None = None) -> None:
    cfg, _ = Config.parse(argv, Config.parser(__doc__))
    work = Path(cfg.work)
    wanted = cfg.cases.split(",")
    unknown = set(wanted) - {c.name for c in CASES}
    if unknown:
        raise SystemExit(f"--cases: unknown {sorted(unknown)}; known: {[c.name for c in CASES]}")
    started = time.perf_counter()
    cases = [c for c in CASES if c.name in wanted]
    paths = corpora(work, cfg.gb, {k for c in cases for k in (c.data, c.tiny)})
    model = llama(work)
    print(f"corpora and model ready in {time.perf_counter() - started:.0f}s", flush=True)
    rows, baselines = [], {}
    for case in cases:
        rows.append(run_case(case, paths, model, work, cfg, baselines))
        print(json.dumps(rows[-1]), flush=True)
    keys = [k for k in rows[0] if k != "data"]
    text = (
        "## Data preparation (bench/data_prep.py)\n\n"
        f"`nice python bench/data_prep.py --gb {cfg.gb:g}`; machine: {machine_info()}\n\n"
        + markdown_table(rows, keys)
        + "\n"
    )
    write_outputs("data_prep", text, {"config": vars(cfg), "rows": rows})


if __name__ == "__main__":
    main()
