"""The docs hold together: every relative link and anchor in README.md, BENCHMARKS.md,
CHANGELOG.md and docs/**.md resolves, and the hand-written references name every
``StepStats`` field and every member of the strategy protocol and its capabilities."""

from __future__ import annotations

import dataclasses
import inspect
import re
import unicodedata
from pathlib import Path

import pytest

import gradstep
from gradstep.parallel import base

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(
    [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "CHANGELOG.md", *DOCS.rglob("*.md")]
)

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans (links there are code)."""
    return _CODE.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped (letters,
    digits, ``_``, ``-`` and spaces kept), spaces as ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.lower().replace("`", "")
    kept = (
        c
        for c in text
        if c in " -_" or unicodedata.category(c)[0] in "LN" or unicodedata.category(c) == "Mn"
    )
    return "".join(kept).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in ``path``, a repeated one numbered as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for _, title in _HEADING.findall(_FENCE.sub("", path.read_text())):
        base_slug = slug(title)
        n = seen.get(base_slug, 0)
        seen[base_slug] = n + 1
        out.add(base_slug if n == 0 else f"{base_slug}-{n}")
    return out


def links(path: Path) -> list[str]:
    """The relative targets of ``path``'s markdown links and images (``#x`` included)."""
    targets = _LINK.findall(_prose(path.read_text()))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # no http:, mailto:


def test_the_pages_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/README.md", "docs/reference/flags.md"} <= names


def test_the_slugs_are_githubs() -> None:
    assert slug("(b) A strategy") == "b-a-strategy"
    assert slug("2-D meshes: `--tp` and `--hsdp`") == "2-d-meshes---tp-and---hsdp"
    assert slug("Hugging Face models: `--model hf:DIR`") == "hugging-face-models---model-hfdir"
    assert slug("The loss: `gradstep.hf.causal_lm_loss`") == "the-loss-gradstephfcausal_lm_loss"
    assert slug("12. Fine-tuning × 2 — done") == "12-fine-tuning--2--done"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        where, _, anchor = target.partition("#")
        file = (page.parent / where).resolve() if where else page
        if not file.exists():
            broken.append(
                f"{target}: no {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}"
            )
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading with the anchor #{anchor}")
    assert not broken, f"{page.relative_to(ROOT)}:\n  " + "\n  ".join(broken)


def test_every_page_of_docs_is_in_the_index() -> None:
    """docs/README.md links every page under docs/."""
    index = DOCS / "README.md"
    linked = {(index.parent / t.partition("#")[0]).resolve() for t in links(index)}
    pages = {p.resolve() for p in DOCS.rglob("*.md")} - {index.resolve()}
    missing = sorted(p.relative_to(DOCS).as_posix() for p in pages - linked)
    assert not missing, f"docs/README.md does not link {missing}"


def _mentioned(page: Path) -> set[str]:
    """Every name written in backticks on ``page``, and its first word (``name(args)``)."""
    spans = re.findall(r"`([^`\n]+)`", page.read_text())
    return {m for s in spans for m in (s, re.split(r"[(\s\[=]", s, maxsplit=1)[0])}


def test_the_stepstats_reference_names_every_field() -> None:
    page = DOCS / "reference" / "stepstats.md"
    fields = {f.name for f in dataclasses.fields(gradstep.StepStats)}
    rows = set(re.findall(r"^\| `(\w+)` \|", page.read_text(), re.M))
    assert rows == fields, (
        f"{page.relative_to(ROOT)}: rows for fields that do not exist {sorted(rows - fields)}, "
        f"fields without a row {sorted(fields - rows)}"
    )


def _protocols() -> dict[str, type]:
    """The strategy core and every capability protocol gradstep.parallel.base declares."""
    return {
        name: obj
        for name, obj in vars(base).items()
        if inspect.isclass(obj) and getattr(obj, "_is_protocol", False) and name in base.__all__
    }


def _members(protocol: type) -> set[str]:
    own = set(protocol.__dict__.get("__annotations__", {}))
    own |= {n for n, v in protocol.__dict__.items() if callable(v) or isinstance(v, property)}
    own |= {n for n, v in protocol.__dict__.items() if isinstance(v, staticmethod)}
    return {n for n in own if not n.startswith("_")}


def test_the_strategy_reference_names_every_protocol_and_member() -> None:
    page = DOCS / "reference" / "strategy.md"
    named = _mentioned(page)
    protocols = _protocols()
    assert "Strategy" in protocols and len(protocols) >= 8
    missing = [name for name in protocols if name not in named]
    missing += [
        f"{name}.{member}"
        for name, protocol in protocols.items()
        for member in sorted(_members(protocol))
        if member not in named
    ]
    missing += [layout for layout in base.GRADIENT_LAYOUTS if layout not in named]
    assert not missing, f"{page.relative_to(ROOT)} does not name {missing}"
