"""--sample-prompts (gradstep_cli.run.samples): the prompt file's formats and refusals, greedy
generation that stops at a stop token, and samples.jsonl cut back on a resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gradstep_cli.config.checks import ConfigError
from gradstep_cli.run.samples import cut_samples, generate, read_prompts


def test_text_file_is_one_prompt_per_line(tmp_path: Path) -> None:
    path = tmp_path / "p.txt"
    path.write_text("def f(x):\n\n  indented prompt\n")
    prompts = read_prompts(str(path), None)
    assert [p.source for p in prompts] == ["def f(x):", "  indented prompt"]
    assert prompts[0].ids == list(b"def f(x):")


def test_jsonl_strings_prompts_and_messages(tmp_path: Path) -> None:
    from tests.support import hf_assets

    tok = hf_assets.load_tokenizer()
    chat = [{"role": "user", "content": "Sum 1 and 2."}]
    path = tmp_path / "p.jsonl"
    lines = ["def f(x):", {"prompt": "import os"}, {"messages": chat}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    prompts = read_prompts(str(path), tok)
    assert prompts[0].ids == tok("def f(x):")["input_ids"]
    want = tok.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    assert prompts[2].ids == list(want["input_ids"])
    assert tok.decode(prompts[2].ids).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ('{"completion": "x"}', "a prompt is a JSON string"),
        ("{not json", "invalid JSON"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "need a tokenizer with a chat"),
    ],
)
def test_refused_prompts_name_the_line(tmp_path: Path, line: str, said: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('"ok"\n' + line + "\n")
    with pytest.raises(ConfigError, match=f"p.jsonl line 2: .*{said}"):
        read_prompts(str(path), None)


def test_an_empty_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "p.txt").write_text("\n\n")
    with pytest.raises(ConfigError, match="holds no prompt"):
        read_prompts(str(tmp_path / "p.txt"), None)


class Counter(torch.nn.Module):
    """Predicts (last token + 1) mod 10."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot((ids + 1) % 10, 10).float() + self.w


def test_greedy_generation_stops_at_a_stop_token_or_the_limit() -> None:
    assert generate(Counter(), [3], 4, set(), 8) == ([4, 5, 6, 7], "length")
    assert generate(Counter(), [3], 9, {6}, 8) == ([4, 5], "eos")


def test_cut_samples_keeps_the_checkpoints_steps(tmp_path: Path) -> None:
    path = tmp_path / "samples.jsonl"
    rows = [{"step": s, "completion": "x"} for s in (0, 2, 4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6')
    cut_samples(path, 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 2]
