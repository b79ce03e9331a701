#!/usr/bin/env python3
"""Apply realistic bugs to gradstep one at a time and check that the tests catch each.

Usage: ``python tools/mutants.py [--only ID,ID] [--list]`` (``make mutants``). For every
mutation: copy ``src/`` to a temporary folder, apply the edit there (the working tree is
never touched, so this can run beside other work), run the tests that guard that code with
the copy first on ``PYTHONPATH`` (spawned ranks and CLI subprocesses inherit it), and call
the mutation caught when they fail. One line per mutation, then ``N caught, M survived``;
the exit status is 1 when any survived (2 when the tool itself cannot run a mutation).

The list is curated: the 14 of the test audit (shared/reviews/test-audit.md, M1-M8 and
P1-P6) plus bugs one could write in the code of the later issues (N1-...). Each edit is an
exact substring that must occur exactly once, so a refactor that moves the code makes the
tool fail loudly instead of testing nothing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    id: str
    what: str
    file: str
    """Path under src/."""
    edits: tuple[tuple[str, str], ...]
    """(exact old text, new text) pairs, applied in order."""
    tests: tuple[str, ...]


def m(id: str, what: str, file: str, edits: list[tuple[str, str]], tests: str) -> Mutation:
    return Mutation(id, what, file, tuple(edits), tuple(tests.split()))


STEP = "gradstep/stepper.py"
PREC = "gradstep/precision.py"
FSDP = "gradstep/parallel/fsdp2.py"
LAYOUT = "gradstep/checkpoint/layout.py"
RUNF = "gradstep_demo/run_folder.py"
DIST = "tests/parallel"

MUTATIONS = [
    # ------------------------------------------------------------ the audit's 14
    m(
        "M1",
        "normalise by the micro-batch count instead of the item count",
        STEP,
        [
            (
                "grad_divisor / (window.items * self._precision.prescale)",
                "grad_divisor / (window.micro_batches * self._precision.prescale)",
            )
        ],
        "tests/test_stepper.py",
    ),
    m(
        "M2",
        "skip the scheduler step",
        STEP,
        [("                self.scheduler.step()\n", "                pass\n")],
        "tests/test_stepper.py tests/checkpoint/test_checkpoint.py",
    ),
    m(
        "M3",
        "clip before the fp16 unscale",
        STEP,
        [
            (
                "        self._precision.unscale(self.optimizer)\n        named_grads",
                "        named_grads",
            ),
            (
                "        view.materialize()\n",
                "        view.materialize()\n        self._precision.unscale(self.optimizer)\n",
            ),
        ],
        "tests/test_precision.py",
    ),
    m(
        "M4",
        "FSDP2: this shard's norm instead of the global one",
        FSDP,
        [("norm = norm.full_tensor()", "norm = norm.to_local()")],
        DIST,
    ),
    m(
        "M5",
        "FSDP2: gradient sync switched off and never back on",
        FSDP,
        [
            (
                "self.model.set_requires_gradient_sync(enabled)  # type: ignore[operator]",
                "self.model.set_requires_gradient_sync(False)  # type: ignore[operator]",
            ),
            (
                "self.model.set_requires_gradient_sync(True)  # type: ignore[operator]",
                "pass",
            ),
        ],
        DIST,
    ),
    m(
        "M6",
        "ZClip updates its EMA with the unclipped norm",
        "gradstep/policies/zclip.py",
        [("g_star = g if target is None else min(g, target)", "g_star = g")],
        "tests/policies/test_adaptive.py",
    ),
    m(
        "M7",
        "checkpoint pruning order reversed",
        LAYOUT,
        [
            (
                "    for n, path in _step_dirs(directory):\n",
                "    for n, path in _step_dirs(directory)[::-1]:\n",
            )
        ],
        "tests/checkpoint",
    ),
    m(
        "M8",
        "AGC excludes nothing",
        "gradstep/policies/agc.py",
        [(" if name not in self.exclude]", "]")],
        "tests/policies/test_adaptive.py",
    ),
    m(
        "P1",
        "fp32 accumulation buffers not reset between steps",
        PREC,
        [("        self._written.clear()\n", "")],
        "tests/test_precision.py",
    ),
    m(
        "P2",
        "fp16 overflow back-off left to each rank's local found_inf",
        PREC,
        [("found_inf.fill_(1.0)", "pass")],
        DIST,
    ),
    m(
        "P3",
        "FSDP2 bf16 reduces gradients in bf16",
        "gradstep/parallel/setup.py",
        [("reduce_dtype=torch.float32)", "reduce_dtype=torch.bfloat16)")],
        DIST,
    ),
    m(
        "P4",
        "--resume on another world size keeps the flag's accum_steps",
        RUNF,
        [
            (
                "else info.accum_steps_for(world)",
                "else cfg.accum_steps",
            )
        ],
        "tests/checkpoint tests/demo",
    ),
    m(
        "P5",
        "peak memory: VmHWM kB reported as MiB",
        "gradstep/metrics.py",
        [
            (
                'return int(line.split()[1]) / 2**10, "max_rss"',
                'return int(line.split()[1]), "max_rss"',
            )
        ],
        "tests/test_metrics.py",
    ),
    m(
        "P6",
        "ClipValue zeroes out-of-range elements instead of clamping",
        "gradstep/policies/fixed.py",
        [
            (
                "        torch._foreach_clamp_min_(grads, -self.value)\n"
                "        torch._foreach_clamp_max_(grads, self.value)\n",
                "        for g in grads:\n            g.masked_fill_(g.abs() > self.value, 0.0)\n",
            )
        ],
        "tests/policies/test_fixed.py",
    ),
    # ------------------------------------------------ bugs in the later issues' code
    m(
        "N1",
        "hooks: on_step_end not called on skipped steps",
        STEP,
        [
            (
                "        for call in self.hooks.on_step_end:\n",
                "        for call in self.hooks.on_step_end if not stats.skipped else ():\n",
            )
        ],
        "tests/test_hooks.py",
    ),
    m(
        "N2",
        "hooks under FSDP2: watch the sharded parameter (never fires)",
        FSDP,
        [("out.append((*found, unsharded))", "out.append((*found, found[1]))")],
        DIST,
    ),
    m(
        "N3",
        "FSDP2: a failed window's unreduced gradients are kept",
        FSDP,
        [
            ("                fsdp_param.unsharded_accumulated_grad = None\n", ""),
            ("                    unsharded.grad = None\n", "                    pass\n"),
        ],
        DIST,
    ),
    m(
        "N4",
        "prune counts checkpoints that do not verify",
        LAYOUT,
        [("if valid_seen < keep and is_valid(path):", "if valid_seen < keep:")],
        "tests/checkpoint/test_prune_and_verify.py",
    ),
    m(
        "N5",
        "prune deletes step-N folders gradstep did not write",
        LAYOUT,
        [("        if not written_by_gradstep(path):\n            continue\n", "")],
        "tests/checkpoint/test_prune_and_verify.py",
    ),
    m(
        "N6",
        "verification trusts NaN in a manifest",
        LAYOUT,
        [(", parse_constant=_reject_constant)", ")")],
        "tests/checkpoint/test_prune_and_verify.py",
    ),
    m(
        "N7",
        "assigning Stepper.clip keeps the old norm type",
        STEP,
        [
            (
                "        self._norm_type = next(",
                "        self._norm_type = getattr(self, '_norm_type', None) or next(",
            )
        ],
        "tests/test_hooks.py",
    ),
    m(
        "N8",
        "the optimizer-covers-the-model check removed",
        STEP,
        [("        check_optimizer_covers(self._named, optimizer)\n", "")],
        "tests/test_input_checks.py",
    ),
    m(
        "N9",
        "a folder holding a run is taken for an empty one",
        RUNF,
        [("return any((out / name).exists() for name in RUN_FILES)", "return False")],
        "tests/demo/test_run_folder.py",
    ),
    m(
        "N10",
        "no lock on the run folder",
        RUNF,
        [
            (
                "                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)\n",
                "                pass\n",
            )
        ],
        "tests/demo/test_run_folder.py",
    ),
    m(
        "N11",
        "resume silently ignores a changed --lr / --clip",
        RUNF,
        [("elif name in given and value != saved[name]:", "elif False:")],
        "tests/demo/test_run_folder.py",
    ),
    m(
        "N13",
        "LARS/LAMB under FSDP2: trust ratios from this shard's norms",
        "gradstep/optim/_shards.py",
        [("            part = collectives.all_reduce_sum(part, group)\n", "            pass\n")],
        "tests/optim",
    ),
    m(
        "N14",
        "OOM on one rank: the others do not split (no agreement)",
        "gradstep/memory/split.py",
        [
            (
                "            failed = bool(self._sum(flag).item() > 0)",
                "            failed = failed",
            )
        ],
        "tests/test_oom.py",
    ),
    m(
        "N12",
        "resuming a finished run trains and rewrites its files",
        "gradstep_demo/train.py",
        [("        if run.finished(run.start):", "        if False:")],
        "tests/demo/test_run_folder.py",
    ),
    m(
        "N15",
        "noise scale under fp16: the loss scale left in the micro-batch norms",
        "gradstep/gns.py",
        [("sq / stepper.loss_scale_factor**2", "sq")],
        "tests/test_gns.py",
    ),
    m(
        "N16",
        "noise scale on several ranks: this rank's micro-batch norms only",
        "gradstep/gns.py",
        [("stepper.strategy.all_reduce_sum(local).unbind()", "local.unbind()")],
        "tests/test_gns.py",
    ),
    m(
        "N17",
        "noise scale: the squared micro-batch sizes left out of both estimates",
        "gradstep/gns.py",
        [("        self._n_sq_sum = self._n_sq_sum + n * n\n", "        self._n_sq_sum = 0.0\n")],
        "tests/test_gns.py",
    ),
    m(
        "N18",
        "batch ramp: the LR schedule keyed on optimizer steps, not sequences",
        "gradstep_demo/schedule.py",
        [
            (
                "            self.trained += micro_batches * self.world",
                "            self.trained += self.base_micro_batches * self.world",
            )
        ],
        "tests/demo/test_schedule.py",
    ),
    m(
        "N19",
        "aux terms backpropagated without their weight N/M (the window's items per micro-batch)",
        "gradstep/tally.py",
        [
            (
                "        return sum(loss.aux[n] for n in names) * self.plan.aux_weight",
                "        return sum(loss.aux[n] for n in names)",
            )
        ],
        "tests/test_aux.py",
    ),
    m(
        "N20",
        "FSDP2 norm in backward: this rank's shards only, not reduced over the shard group",
        FSDP,
        [
            (
                "return self.all_reduce_sum(norm.double() ** norm_type) ** (1.0 / norm_type)",
                "return norm",
            )
        ],
        "tests/test_norms.py",
    ),
    m(
        "N21",
        "norm in backward: the hooks stay registered when the window raises",
        "gradstep/norms.py",
        [
            (
                "    try:\n        yield\n    finally:\n        for h in handles:\n",
                "    yield\n    if True:\n        for h in handles:\n",
            )
        ],
        "tests/test_norms.py",
    ),
]


def apply(mutation: Mutation, src: Path) -> None:
    path = src / mutation.file
    text = path.read_text()
    for old, new in mutation.edits:
        found = text.count(old)
        if found != 1:
            raise SystemExit(
                f"mutants: {mutation.id}: expected the text to mutate exactly once in "
                f"src/{mutation.file}, found it {found} times: {old!r}"
            )
        text = text.replace(old, new)
    path.write_text(text)


def run_tests(tests: tuple[str, ...], src: Path | None) -> tuple[int, float, str]:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONDONTWRITEBYTECODE": "1"}
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(src), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    started = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        code, tail = done.returncode, (done.stdout + done.stderr).strip().splitlines()[-1:]
    except subprocess.TimeoutExpired:
        code, tail = 124, ["timed out after 900 s"]
    return code, time.monotonic() - started, (tail[0] if tail else "")


def check_import_path(src: Path) -> None:
    """The copy, not the editable install, must be what the tests import."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    probe = "import gradstep, gradstep_demo; print(gradstep.__file__, gradstep_demo.__file__)"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    if out.returncode or any(not p.startswith(str(src)) for p in out.stdout.split()):
        raise SystemExit(f"mutants: the copy in {src} is not what Python imports: {out.stdout}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", help="comma-separated mutation ids (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = parser.parse_args(argv)
    chosen = MUTATIONS
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {mu.id for mu in MUTATIONS}
        if unknown:
            parser.error(f"unknown mutation ids: {', '.join(sorted(unknown))}")
        chosen = [mu for mu in MUTATIONS if mu.id in wanted]
    if args.list:
        for mu in chosen:
            print(f"{mu.id:4} {mu.what}  [src/{mu.file}; {' '.join(mu.tests)}]")
        return 0
    guarded = tuple(dict.fromkeys(t for mu in chosen for t in mu.tests))
    code, seconds, tail = run_tests(guarded, None)
    if code != 0:
        print(f"mutants: the unmutated tree fails its tests ({tail}); fix that first")
        return 2
    print(f"baseline: {len(guarded)} test paths pass unmutated ({seconds:.0f} s)")
    caught = survived = 0
    with tempfile.TemporaryDirectory(prefix="gradstep-mutants-") as tmp:
        for mu in chosen:
            src = Path(tmp, mu.id, "src")
            shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("*.egg-info"))
            check_import_path(src)
            apply(mu, src)
            code, seconds, tail = run_tests(mu.tests, src)
            ok = code not in (0, 5)  # 5: pytest collected nothing, which proves nothing
            caught += ok
            survived += not ok
            verdict = "caught  " if ok else "SURVIVED"
            print(f"{mu.id:4} {verdict} {mu.what} ({seconds:.0f} s; {tail})", flush=True)
            shutil.rmtree(src.parent, ignore_errors=True)
    print(f"{caught} caught, {survived} survived")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
