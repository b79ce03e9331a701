"""Shared test settings: deterministic CPU, small hypothesis budgets (CI has 2 cores), and
the ``integration`` marker that keeps ``make test-fast`` fast."""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, settings

pytest_plugins = ("pytester",)  # tests/test_markers.py runs the marker guard in a fresh session

settings.register_profile(
    "gradstep",
    max_examples=int(os.environ.get("GRADSTEP_HYPOTHESIS_EXAMPLES", "12")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
settings.load_profile("gradstep")

# Tiny models: one intra-op thread is as fast, and 2-rank tests do not oversubscribe 2 cores.
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]

# ``integration``: tests that start processes (a subprocess, torchrun, gloo ranks through
# tests.support.multiproc.run_ranks), run an example, or run the demo CLI end to end (a
# `main([...])` that trains or plans). They hold most of the suite's time; `make test-fast`
# leaves them out, `make test` (CI) runs them. CLI refusals (bad flags, --help) stay in the
# fast loop: they stop before any step, in milliseconds. Tests marked `distributed` start
# ranks too and get the marker as well. tests/test_markers.py checks that every entry below
# still names a module / test, and `_no_unmarked_processes` fails any unmarked test that
# starts a Python process, so the fast loop cannot silently slow down again.
INTEGRATION_MODULES = (
    "tests/test_examples.py",  # examples/*.py run end to end
    "tests/step/test_real_oom.py",  # a child process that really runs out of memory
    "tests/cli/test_export.py",  # CLI training runs, then exports
    "tests/cli/test_export_runs.py",
    "tests/cli/test_export_newest.py",
    "tests/cli/test_export_failures.py",  # CLI training runs; a child under ulimit -f
    "tests/cli/test_lr_runs.py",
    "tests/cli/test_run_folder.py",  # CLI runs, two trainers on one folder
    "tests/cli/test_settings_run_folders.py",
)
# Single tests, in modules that are otherwise unit tests.
INTEGRATION_TESTS = (
    "tests/checkpoint/test_checkpoint.py::test_cli_resume_is_bitwise_identical",
    "tests/checkpoint/test_checkpoint.py::test_sigkill_at_random_moments",
    "tests/checkpoint/test_checkpoint.py::test_sigkill_during_save_leaves_a_loadable_checkpoint",
    "tests/checkpoint/test_lease.py::test_a_killed_readers_lease_never_blocks_pruning",
    "tests/checkpoint/test_names_and_full_disk.py::"
    "test_a_full_disk_is_one_checkpoint_error_naming_the_file",
    "tests/checkpoint/test_names_and_full_disk.py::"
    "test_a_read_only_checkpoint_folder_is_one_checkpoint_error",
    "tests/cli/test_boundary.py::test_python_m_gradstep_without_the_cli_extra_says_what_to_install",
    "tests/cli/test_boundary.py::test_the_library_imports_every_module_without_the_cli_extra",
    "tests/cli/test_cli.py::test_train_end_to_end",
    "tests/cli/test_cli.py::test_toml_config_with_flag_override",
    "tests/cli/test_cli.py::test_python_dash_m_entry_point",
    "tests/cli/test_errors.py::test_report_errors_and_overflowing_numbers",
    "tests/cli/test_hf_model.py::test_lora_run_resumes_exactly_from_an_adapter_only_checkpoint",
    "tests/cli/test_hf_model.py::test_moe_aux_loss_is_reported_beside_the_loss",
    "tests/cli/test_hf_pretrained.py::test_the_cli_trains_from_the_folders_weights",
    "tests/cli/test_lora_families.py::test_cli_lora_on_a_pretrained_phi3_with_every_flag",
    "tests/cli/test_lora_families.py::test_cli_moe_router_loss_with_pretrained_weights_and_lora",
    "tests/cli/test_plan.py::test_plan_json_has_the_contract_keys",
    "tests/cli/test_plan.py::test_plan_table_and_a_budget_nothing_fits",
    "tests/cli/test_plan.py::test_auto_micro_batch_plans_records_and_keeps_the_global_batch",
    "tests/cli/test_plan.py::test_global_batch_is_exact_and_its_split_does_not_change_the_update",
    "tests/cli/test_plan_cli.py::test_a_plan_that_train_accepts_still_plans",
    "tests/cli/test_plan_hf.py::test_plan_plans_the_hf_model_at_its_datas_longest_row",
    "tests/cli/test_plan_hf.py::test_an_auto_run_of_an_hf_model_stays_under_its_budget",
    "tests/cli/test_plan_hf.py::test_activation_checkpointing_of_an_hf_model_trains_the_same_run",
    "tests/cli/test_schedule.py::test_ramped_run_records_and_resumes_exactly",
    "tests/cli/test_schedule.py::test_every_optimizer_follows_the_ramp_and_its_lr_scaling",
    "tests/cli/test_settings_flags.py::test_a_short_run_with_default_flags_trains",
    "tests/cli/test_settings_flags.py::test_an_hf_run_records_no_gpt_shape",
    "tests/cli/test_settings_flags.py::test_noise_scale_settings_that_do_nothing_get_a_note",
    "tests/cli/test_settings_flags.py::test_resume_messages_say_what_is_true",
    "tests/cli/test_sft.py::test_cli_fine_tunes_each_format",
    "tests/cli/test_sft.py::test_cli_text_files_are_tokenized",
    "tests/cli/test_sft.py::test_jsonl_run_resumes_exactly",
    "tests/cli/test_sft.py::test_jsonl_folder_trains_with_a_batch_ramp",
    "tests/hf/test_loss.py::test_import_gradstep_without_transformers",
    "tests/memory/test_probe.py::test_real_cpu_probe_grows_with_b_and_keeps_the_budget",
    "tests/optim/test_api.py::test_demo_trains_with_lamb_and_refuses_another_optimizer_on_resume",
    "tests/policies/test_cli.py::test_cli_adaptive_clip_and_spike_guard_reach_metrics",
    "tests/step/test_aux.py::test_aux_gradient_on_two_ranks_equals_one_process",
    "tests/step/test_norm.py::test_two_ranks_same_norm_as_after_backward",
    "tests/test_gns.py::test_two_ddp_ranks_measure_the_exact_noise_scale",
    "tests/test_gns.py::test_two_ranks_estimate_what_one_process_does_on_the_same_window",
    "tests/test_metrics.py::test_a_full_disk_names_the_metrics_file",
    "tests/test_metrics.py::test_train_logs_every_step_to_every_sink",
)
# Tests that `make test-fast` leaves out, and that may therefore start processes.
HEAVY_MARKERS = ("integration", "distributed", "slow", "combinations", "cuda")


def _where(item: pytest.Item) -> tuple[str, str]:
    """``("tests/x/test_y.py", "test_name")`` without the parametrization."""
    path = item.path.relative_to(ROOT).as_posix()
    return path, item.name.split("[", 1)[0]


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    modules, tests = set(INTEGRATION_MODULES), set(INTEGRATION_TESTS)
    for item in items:
        path, name = _where(item)
        if path in modules or f"{path}::{name}" in tests or item.get_closest_marker("distributed"):
            item.add_marker(pytest.mark.integration)


def _starts_python(args: Any) -> bool:
    """True for a command line that runs Python (``setpriv ... python -m x`` included)."""
    if isinstance(args, (str, bytes, os.PathLike)):
        args = os.fsdecode(args).split()
    for arg in map(os.fsdecode, args):
        if arg == sys.executable or Path(arg).name.startswith(("python", "torchrun")):
            return True
    return False


@contextlib.contextmanager
def _no_unmarked_processes(item: pytest.Item) -> Iterator[None]:
    """Fail a test left in the fast loop that starts a Python process or a
    multiprocessing one. Other programs (a compiler torch.compile calls) are allowed."""
    if any(item.get_closest_marker(m) for m in HEAVY_MARKERS):
        yield
        return
    message = (
        f"{item.nodeid} starts a process but is not marked integration: add it to "
        "INTEGRATION_TESTS (or its module to INTEGRATION_MODULES) in tests/conftest.py"
    )
    popen_init = subprocess.Popen.__init__

    def guarded_popen(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        if _starts_python(args):
            pytest.fail(message, pytrace=False)
        popen_init(self, args, *rest, **kwargs)

    def refuse_start(self: multiprocessing.process.BaseProcess) -> None:
        pytest.fail(message, pytrace=False)

    with (
        mock.patch.object(subprocess.Popen, "__init__", guarded_popen),
        mock.patch.object(multiprocessing.process.BaseProcess, "start", refuse_start),
    ):
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    # Setup too: a module-scoped fixture may be what starts the ranks.
    with _no_unmarked_processes(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _no_unmarked_processes(item):
        return (yield)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
