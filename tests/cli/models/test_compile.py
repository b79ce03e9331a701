"""``--compile`` (gradstep_cli.models.compile): each transformer block compiled in place.

The parity tests (marked slow: compiling on the CPU costs seconds per graph) train a
compiled model and its eager copy side by side: one micro-batch's loss and gradient, then
3 optimizer steps of the Stepper (AdamW, 2 micro-batches a window), equal within float32
rounding (:data:`RTOL`, per tensor). Covered: the demo GPT plain, and on packed rows
(``seq_ids=``) with activation checkpointing and dropout; a tiny HF Llama (from a config,
nothing downloaded) with LoRA (adapter dropout on) and activation checkpointing on packed
rows (the 4-D mask of :func:`gradstep.packing.mask_for`). Each also checks that dynamo
compiled the blocks without a graph break, so the eager copy is compared with compiled
code, not with itself.

Fast: state_dict keys unchanged, a second compile is a no-op, a forward without autograd
runs eagerly (no compile), the compile-time arithmetic, and the refusals (no C++ compiler
found, before anything is built; one that fails at the first step, naming the flag).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from gradstep import Stepper
from gradstep.memory import checkpoint_blocks
from gradstep.packing import pack
from gradstep_cli.config.checks import ConfigError
from gradstep_cli.models.compile import (
    check_compile,
    compile_blocks,
    compile_note,
    compile_seconds,
)
from gradstep_cli.models.gpt import GPT, GPTConfig

dynamo = pytest.importorskip("torch._dynamo")
if not dynamo.is_dynamo_supported():
    pytest.skip(
        "torch.compile is not supported on this Python / torch build", allow_module_level=True
    )

RTOL = 1e-5
"""Relative difference (norm of the difference over the norm) allowed per tensor and per
loss: float32 rounding, as inductor fuses and reorders the block's arithmetic."""
VOCAB, T = 256, 16


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    """Each test compiles its own graphs (as a fresh process would) and counts them."""
    from torch._dynamo.utils import counters

    dynamo.reset()
    counters.clear()
    yield
    dynamo.reset()


def _graphs() -> int:
    """Graphs dynamo compiled since the test began; a graph break fails the test (the
    break's code would run eagerly)."""
    from torch._dynamo.utils import counters

    assert not counters["graph_break"], dict(counters["graph_break"])
    return counters["stats"]["unique_graphs"]


def gpt(dropout: float = 0.0) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, max_seq_len=T, dropout=dropout))


def _sequences(seed: int, lengths: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids, aligned next-token labels) pairs, some targets ignored."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, VOCAB, (n + 1,), generator=gen)
        labels = ids[1:].clone()
        labels[torch.rand(n, generator=gen) < 0.2] = -100
        out.append((ids[:-1], labels))
    return out


def plain_batch(seed: int) -> dict[str, torch.Tensor]:
    ids, labels = zip(*_sequences(seed, (T,) * 4), strict=True)
    return {"input_ids": torch.stack(ids), "labels": torch.stack(labels)}


def packed_batch(seed: int) -> dict[str, torch.Tensor]:
    """4 rows of T tokens, 2-3 whole sequences each, padding on the right."""
    seqs = _sequences(seed, (5, 9, 3, 7, 6, 4, 6, 6, 2, 11))
    batch = pack(seqs, [[0, 1], [2, 3, 4], [5, 6, 7], [8, 9]], row_tokens=T)
    batch["labels"] = batch.pop("shift_labels")
    return batch


def gpt_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    return model(batch["input_ids"], batch["labels"], seq_ids=batch.get("seq_ids"))


def _pair(model: nn.Module, checkpointed: bool) -> tuple[nn.Module, nn.Module]:
    """(eager, compiled): the same weights; activation checkpointing first, as the run does."""
    compiled = copy.deepcopy(model)
    if checkpointed:
        checkpoint_blocks(model)
        checkpoint_blocks(compiled)
    assert compile_blocks(compiled) == 2
    return model, compiled


def _grads(model: nn.Module, batch: dict, loss_fn: Callable) -> tuple[float, dict]:
    """The mean loss of ``batch`` and its gradient (dropout drawn from seed 1)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss = loss_fn(model, batch)
    (loss.total / loss.count).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.total.detach() / loss.count), grads


def _steps(model: nn.Module, batches: Callable[[int], dict], loss_fn: Callable) -> tuple:
    """3 Stepper steps of 2 micro-batches: each step's loss and pre-clip norm, the weights."""
    torch.manual_seed(2)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    stepper = Stepper(model, optimizer)
    stats = [stepper.step([batches(2 * i), batches(2 * i + 1)], loss_fn) for i in range(3)]
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return [x for s in stats for x in (s.loss, s.grad_norm)], weights


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert (got[name] - w).norm() <= RTOL * w.norm(), name


def assert_parity(
    model: nn.Module, batches: Callable[[int], dict], loss_fn: Callable, checkpointed: bool
) -> None:
    """The compiled copy of ``model`` trains as ``model`` does (module docstring)."""
    eager, compiled = _pair(model.train(), checkpointed)
    trained = {n: p.detach().clone() for n, p in eager.named_parameters() if p.requires_grad}
    loss, grads = _grads(compiled, batches(100), loss_fn)
    assert _graphs() >= 1  # the blocks ran compiled
    want_loss, want_grads = _grads(eager, batches(100), loss_fn)
    assert loss == pytest.approx(want_loss, rel=RTOL)
    _assert_close(grads, want_grads)
    got, weights = _steps(compiled, batches, loss_fn)
    want, want_weights = _steps(eager, batches, loss_fn)
    assert got == pytest.approx(want, rel=RTOL)
    _assert_close(weights, want_weights)
    assert all(not torch.equal(weights[n], w) for n, w in trained.items())  # the steps moved


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_compiled_gpt_trains_as_the_eager_one() -> None:
    assert_parity(gpt(), plain_batch, gpt_loss, checkpointed=False)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_compiled_gpt_on_packed_rows_with_checkpointing_and_dropout() -> None:
    assert_parity(gpt(dropout=0.1), packed_batch, gpt_loss, checkpointed=True)


def llama() -> nn.Module:
    """A tiny Llama with LoRA adapters on q_proj and v_proj (dropout on)."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    config._attn_implementation = "sdpa"  # packing's 4-D mask is exact under sdpa
    model = LlamaForCausalLM(config)
    pytest.importorskip("peft")
    from gradstep_cli.config.settings import TrainConfig
    from gradstep_cli.models.lora import add_lora

    return add_lora(model, TrainConfig(model="hf:unused", seq_len=T, lora=4, lora_dropout=0.1))


def hf_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    """A packed batch's loss: its 4-D block-causal mask, its aligned labels."""
    from gradstep.hf import causal_lm_loss
    from gradstep.packing import mask_for

    batch = {k: v for k, v in batch.items() if k != "labels"} | {"shift_labels": batch["labels"]}
    return causal_lm_loss(model, mask_for(model, batch, torch.float32))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_compiled_llama_with_lora_on_packed_rows_with_checkpointing() -> None:
    assert_parity(llama(), packed_batch, hf_loss, checkpointed=True)


def test_names_and_state_dict_keys_do_not_change_and_a_second_compile_is_a_no_op() -> None:
    model = gpt()
    names = [n for n, _ in model.named_parameters()]
    keys = list(model.state_dict())
    assert compile_blocks(model) == 2
    forwards = [b.forward for b in model.blocks]
    assert compile_blocks(model) == 2
    assert [b.forward for b in model.blocks] == forwards  # not compiled twice over
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == keys  # no torch.compile "_orig_mod." prefix
    assert compile_note(model).startswith("--compile: 2 transformer blocks (Block) compiled")


def test_a_forward_without_autograd_runs_the_blocks_eagerly() -> None:
    """Evaluation and generation (their lengths vary: each would be a new compile)."""
    from torch._dynamo.utils import counters

    eager = gpt()
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled)
    ids = plain_batch(0)["input_ids"]
    with torch.no_grad():
        assert torch.equal(compiled(ids), eager(ids))
    with torch.inference_mode():
        assert torch.equal(compiled(ids[:, :5]), eager(ids[:, :5]))
    assert counters["frames"]["total"] == 0  # dynamo never saw a frame


def test_a_model_without_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="--compile: the model has no nn.ModuleList"):
        compile_blocks(nn.Sequential(nn.Linear(2, 2)))


def test_the_compile_time_is_the_first_steps_excess_over_the_median_step() -> None:
    assert compile_seconds([9.0, 1.0, 3.0, 2.0]) == 7.0
    assert compile_seconds([0.5, 1.0, 0.9]) == 0.0  # never negative
    assert compile_seconds([9.0]) is None  # nothing to compare the first step with
    assert compile_seconds([]) is None


# inductor's config is patched with its own patch(): pytest's monkeypatch deletes a
# sub-config's key on undo instead of restoring it.
NO_COMPILER = {"cpp.cxx": ("gradstep-no-such-c++",)}


def test_no_cpp_compiler_is_refused_naming_the_flag() -> None:
    import torch._inductor.config as inductor

    check_compile(torch.device("cpu"))  # this machine's compiler is found
    with (
        inductor.patch(NO_COMPILER),
        pytest.raises(ConfigError, match="--compile on the CPU needs a C.. compiler"),
    ):
        check_compile(torch.device("cpu"))


@pytest.mark.slow
def test_a_compile_that_fails_at_the_first_step_names_the_flag() -> None:
    """A compiler that cannot build the kernels (one removed after the check): the error
    names --compile and what failed, not dynamo's traceback alone."""
    import torch._functorch.config as functorch
    import torch._inductor.config as inductor

    model = gpt()
    compile_blocks(model)
    with (
        inductor.patch({**NO_COMPILER, "fx_graph_cache": False}),  # no kernels from disk:
        functorch.patch(enable_autograd_cache=False),  # they must be built now
        pytest.raises(
            ConfigError,
            match=r"--compile: torch.compile could not build Block's kernels "
            r"\(InvalidCxxCompiler: .*\); train without --compile",
        ),
    ):
        model(plain_batch(0)["input_ids"])
