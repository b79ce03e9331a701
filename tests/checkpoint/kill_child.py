"""Child process of the SIGKILL tests: checkpoints saved by processes that die mid-save.

    python -m tests.checkpoint.kill_child DIR points POINT[,POINT...]   -> {"point": signal, ...}
    python -m tests.checkpoint.kill_child DIR random ROUNDS SEED        -> [{round}, ...]

(from the repo root; it imports nothing of the test suite, only gradstep).

Every checkpoint of step s holds a model whose parameters all equal s and an object whose
state is {"step": s}, so a loader can tell exactly which save it got. ``points``: for each
point, a forked process saves steps 1 and 2 normally, then saves step 3 with a hook that
SIGKILLs it at that point ("replace" re-saves step 2 instead), in DIR/POINT. ``random``: a
forked process saves steps 1, 2, 3, ... in DIR until SIGKILLed at a random instant; after
each kill this process loads the newest checkpoint, as a resume would. The saving process
reports through a pipe what it did: ``b<step>`` just before the step's folder is published
(``layout.publish``, the rename) and ``p<step>`` once ``save`` returned, so each round is
``{"loaded": step loaded, "published": newest step whose save returned, "begun": newest
step whose publish had begun}``: the claim is that the newest published step loads (or
the one after it, when the kill came after its rename but before ``save`` returned).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

import gradstep.checkpoint as ckpt
from gradstep.checkpoint import layout

KEEP = 2


class Counter:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def wrap(owner: Any, name: str, before: Any = None, after: Any = None) -> None:
    """Replace ``owner.name`` with a version that calls ``before``/``after`` around it."""
    original = getattr(owner, name)

    def hooked(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before(*args, **kwargs)
        result = original(*args, **kwargs)
        if after is not None:
            after(*args, **kwargs)
        return result

    setattr(owner, name, hooked)


def truncate_and_die(path: Any) -> None:
    """The file is written, then cut in half: what a crash in mid-write leaves."""
    path = Path(path)
    os.truncate(path, path.stat().st_size // 2)
    die()


def half_delete_and_die(path: Any, **_: Any) -> None:
    if ".trash-" in str(path) and Path(path).is_dir():
        (Path(path) / "model.safetensors").unlink()
        die()


def install(point: str) -> None:
    if point == "mid_tensor_file":  # model.safetensors half written
        wrap(safetensors.torch, "save_file", after=lambda tensors, path: truncate_and_die(path))
    elif point == "before_manifest":  # every tensor file done, no manifest
        wrap(layout, "write_manifest", before=lambda *a, **k: die())
    elif point == "mid_manifest":  # manifest.json half written
        wrap(
            layout,
            "write_bytes",
            after=lambda path, data: truncate_and_die(path) if path.name == ckpt.MANIFEST else None,
        )
    elif point in ("before_rename", "replace"):  # complete folder, not yet renamed
        wrap(
            os,
            "rename",
            before=lambda src, dst: die() if Path(src).name.startswith(".tmp") else None,
        )
    elif point == "before_prune":  # published, the oldest not yet pruned
        wrap(layout, "prune", before=lambda *a, **k: die())
    elif point == "mid_prune":  # the oldest renamed away, half deleted
        wrap(shutil, "rmtree", before=half_delete_and_die)
    else:
        raise SystemExit(f"unknown kill point {point!r}")


def save(checkpointer: ckpt.Checkpointer, model: torch.nn.Module, counter: Counter, step: int):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(step)
    counter.step = step
    checkpointer.save(step, model=model, counter=counter)


def new_model() -> torch.nn.Module:
    # Big enough (~4 MB) that a save takes a while: random kills land inside it.
    return torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))


def scenario(directory: str, point: str, ready: int = -1, step: int = 1) -> None:
    """Runs in a forked process, which dies by SIGKILL (or exits 3 if it never fires)."""
    model, counter = new_model(), Counter()
    checkpointer = ckpt.Checkpointer(directory, keep=KEEP)
    if point == "loop":
        # Small writes to a pipe are atomic: a kill never leaves half a report.
        wrap(layout, "publish", before=lambda tmp, final: report(ready, "b", final))
        while True:
            save(checkpointer, model, counter, step)
            os.write(ready, f"p{step}\n".encode())
            step += 1
    save(checkpointer, model, counter, 1)
    save(checkpointer, model, counter, 2)
    install(point)
    save(checkpointer, model, counter, 2 if point == "replace" else 3)
    os._exit(3)


def report(fd: int, event: str, final: Path) -> None:
    """Write ``<event><step>`` for the folder ``final`` (``step-N``) to the pipe ``fd``."""
    os.write(fd, f"{event}{int(final.name.removeprefix('step-'))}\n".encode())


def forked(fn: Any, *args: Any) -> int:
    """Run ``fn`` in a child forked from this (torch already imported) process: no second
    interpreter start-up per case. Returns the child's pid."""
    pid = os.fork()
    if pid == 0:
        try:
            fn(*args)
        finally:
            os._exit(4)
    return pid


def loaded_step(directory: str) -> int | None:
    """What a fresh process resumes; the contents must be exactly that step's."""
    model, counter = new_model(), Counter()
    step = ckpt.Checkpointer(directory).load_latest(model=model, counter=counter)
    if step is not None:
        assert counter.step == step, (counter.step, step)
        assert all(torch.equal(p, torch.full_like(p, step)) for p in model.parameters())
    return step


def run_points(directory: str, points: list[str]) -> dict[str, int]:
    """Each kill point in its own folder; returns the signal each child died of."""
    died = {}
    for point in points:
        _, status = os.waitpid(forked(scenario, os.path.join(directory, point), point), 0)
        died[point] = os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status)
    return died


def _newest(events: bytes, kind: str) -> int | None:
    steps = [int(line[1:]) for line in events.decode().splitlines() if line.startswith(kind)]
    return max(steps, default=None)


def run_random(directory: str, rounds: int, seed: int) -> list[dict[str, int | None]]:
    """Kill a save loop at random instants; after each kill, load like a resume would and
    continue saving from the loaded step. Returns what each round loaded, and the newest
    steps the killed process had published and begun to publish."""
    gen, results = random.Random(seed), []
    for _ in range(rounds):
        read, write = os.pipe()
        loaded = results[-1]["loaded"] if results else 0
        pid = forked(scenario, directory, "loop", write, (loaded or 0) + 1)  # like a resume
        os.close(write)
        events = b""
        while b"p" not in events:  # the first checkpoint of this round exists
            chunk = os.read(read, 4096)
            if not chunk:
                raise SystemExit("the saving process died before its first checkpoint")
            events += chunk
        time.sleep(gen.uniform(0.0, 0.3))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        while chunk := os.read(read, 4096):  # everything it reported before it died
            events += chunk
        os.close(read)
        results.append(
            {
                "loaded": loaded_step(directory),
                "published": _newest(events, "p"),
                "begun": _newest(events, "b"),
            }
        )
    return results


def main() -> None:
    torch.set_num_threads(1)  # single-threaded before any fork
    directory, mode = sys.argv[1], sys.argv[2]
    if mode == "points":
        result: Any = run_points(directory, sys.argv[3].split(","))
    else:
        result = run_random(directory, int(sys.argv[3]), int(sys.argv[4]))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
