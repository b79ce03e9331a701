"""``gradstep train`` launched the multi-node ways, for tests/parallel/test_multinode.py.

As a library: :func:`torchrun` (the command line of torchrun's module), :func:`run_together`
(start several launchers at once, e.g. two "nodes", wait for all of them, and on a timeout
or an error end every launcher *and the workers it started*: torchrun starts each worker in
a session of its own, so killing the launcher alone would leave them running).

As a module torchrun runs (``-m tests.parallel.node_ranks train ...``): the real CLI
(``gradstep_cli.cli.main``), one of whose workers is killed once: the worker of rank
``GRADSTEP_TEST_KILL_RANK`` SIGKILLs itself as it enters its ``GRADSTEP_TEST_KILL_AT``-th
optimizer step, unless the file ``GRADSTEP_TEST_KILL_MARK`` exists, which it creates first
(``"rank step pid"``: the test's proof that the kill happened). The restarted workers find
it and run the plain CLI. ``TORCHELASTIC_RESTART_COUNT`` cannot say "first attempt": on
two nodes the agent whose worker did not fail keeps counting 0 after the restart (seen
here; pytorch#108158). Before the kill the worker waits for ``GRADSTEP_TEST_KILL_AFTER``
(the manifest of the checkpoint the restart must resume from), so the resume point does
not depend on timing. The demo has no kill hook of its own, and a kill from outside that
polls the run folder would race the tiny model's 20 ms steps.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
KILL_AT, KILL_RANK = "GRADSTEP_TEST_KILL_AT", "GRADSTEP_TEST_KILL_RANK"
KILL_AFTER, KILL_MARK = "GRADSTEP_TEST_KILL_AFTER", "GRADSTEP_TEST_KILL_MARK"
_WAIT_S = 60.0  # for the checkpoint before the kill, on a loaded 2-core machine
_GRACE_S = 10.0  # between SIGTERM (torchrun stops its workers) and SIGKILL


def torchrun(*launch: str) -> list[str]:
    """``torchrun LAUNCH...`` as this interpreter runs it (``python -m torch.distributed.run``)."""
    return [sys.executable, "-m", "torch.distributed.run", *launch]


def launch_env(**extra: str) -> dict[str, str]:
    """The environment of a launch: one thread per worker (2 shared cores), unbuffered
    output, this checkout importable (``-m tests.parallel.node_ranks``), plus ``extra``."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": path,
        **extra,
    }


# ------------------------------------------------------------------ launching, and cleaning up


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) of every process, from /proc."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)"
            table[int(stat.parent.name)] = (int(fields[1]), fields[19])
    return table


def _family(roots: Sequence[int]) -> dict[int, str]:
    """``roots`` and all their descendants: pid -> start time (to never signal a reused pid)."""
    table = _proc_table()
    found = {pid: table[pid][1] for pid in roots if pid in table}
    grew = True
    while grew:
        new = {p: s for p, (pp, s) in table.items() if pp in found and p not in found}
        found.update(new)
        grew = bool(new)
    return found


def _kill_family(family: dict[int, str]) -> None:
    """SIGKILL each process of ``family`` still running with the start time it had."""
    table = _proc_table()
    for pid, started in family.items():
        if table.get(pid, (0, ""))[1] == started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    """End the launchers still running and every worker they started: SIGTERM first (torchrun
    passes it on to its workers), then SIGKILL whatever is left after a grace period."""
    running = [p for p in procs if p.poll() is None]
    family = _family([p.pid for p in running])
    for p in running:
        p.terminate()
    deadline = time.monotonic() + _GRACE_S
    for p in running:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    family.update(_family([p.pid for p in running]))
    _kill_family(family)
    for p in running:
        p.wait()


@contextlib.contextmanager
def _started(
    cmds: Sequence[list[str]], **popen: Any
) -> Iterator[list[tuple[subprocess.Popen, tuple[Any, Any]]]]:
    """The launchers, started together, each with its (stdout, stderr) files (not pipes:
    several processes writing at once must never block on a full pipe); on any error or
    timeout every launcher and its workers are ended."""
    procs: list[subprocess.Popen] = []
    started = []
    with contextlib.ExitStack() as files:
        try:
            for cmd in cmds:
                out = files.enter_context(tempfile.TemporaryFile("w+"))
                err = files.enter_context(tempfile.TemporaryFile("w+"))
                procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, **popen))
                started.append((procs[-1], (out, err)))
            yield started
        finally:
            _stop(procs)


def _read(handle: Any) -> str:
    handle.seek(0)
    return handle.read()


def run_together(
    cmds: Sequence[list[str]], timeout: float, **popen: Any
) -> list[subprocess.CompletedProcess]:
    """Start every command at once and wait for all of them. When they are not all done
    within ``timeout`` seconds, every launcher and its workers are ended and an
    AssertionError carries what each printed."""
    with _started(cmds, **popen) as started:
        deadline = time.monotonic() + timeout
        try:
            for p, _ in started:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _stop([p for p, _ in started])
            logs = "\n".join(f"{p.args}:\n{_read(o)}\n{_read(e)}" for p, (o, e) in started)
            raise AssertionError(f"not done within {timeout} s, ended:\n{logs}") from None
        return [
            subprocess.CompletedProcess(p.args, p.returncode, _read(out), _read(err))
            for p, (out, err) in started
        ]


# ------------------------------------------------------------------ the worker that is killed


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + _WAIT_S
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def _install_kill(at: int, after: Path, mark: Path) -> None:
    """SIGKILL this process as it enters its ``at``-th ``Stepper.step``, once ``after``
    exists, unless ``mark`` does (a worker of a restart): no cleanup, no goodbye to its
    peers, as if the kernel had ended it."""
    import gradstep

    original = gradstep.Stepper.step
    calls = [0]

    def step(self: gradstep.Stepper, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == at:
            _wait_for(after)
            with contextlib.suppress(FileExistsError), open(mark, "x") as once:
                once.write(f"{os.environ['RANK']} {at} {os.getpid()}\n")
                once.close()
                os.kill(os.getpid(), signal.SIGKILL)
        return original(self, *args, **kwargs)

    gradstep.Stepper.step = step  # type: ignore[method-assign]


if __name__ == "__main__":
    from gradstep_cli.cli import main

    if os.environ.get(KILL_AT) and os.environ["RANK"] == os.environ[KILL_RANK]:
        _install_kill(
            int(os.environ[KILL_AT]), Path(os.environ[KILL_AFTER]), Path(os.environ[KILL_MARK])
        )
    sys.exit(main(sys.argv[1:]))
