"""The README stays a five-minute read that tells the truth: at most 120 lines, its two commands verbatim, every
relative link (and #anchor) resolving, the keys table naming real OARConfig keys with their real defaults, and the
dated figures it left living in the pages that own them (docs/performance.md, tests/README.md)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from oar_verl.core import OARConfig

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LINKED_PAGES = [README, ROOT / "tests" / "README.md", ROOT / "docs" / "performance.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a `# comment` in a code block is no heading
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.+)$", text, flags=re.M)}


def broken_links(page: Path, text: str | None = None) -> list[str]:
    """The relative links of ``page`` whose file, or whose ``#anchor`` in that file, does not exist."""
    text = page.read_text() if text is None else text
    broken = []
    for target in LINK.findall(re.sub(r"```.*?```", "", text, flags=re.S)):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or (anchor and (dest.suffix != ".md" or anchor not in _anchors(dest))):
            broken.append(target)
    return broken


def test_the_readme_reads_in_five_minutes():
    assert len(README.read_text().splitlines()) <= 120


def test_the_two_commands_are_there_verbatim_and_exist():
    text = README.read_text()
    for command, script in [("bash recipes/quickstart_cpu.sh", "recipes/quickstart_cpu.sh"),
                            ("bash scripts/test.sh", "scripts/test.sh")]:
        assert re.search(rf"^{re.escape(command)}\b", text, flags=re.M), command
        assert (ROOT / script).is_file(), script


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_a_broken_link_or_anchor_is_caught():
    text = README.read_text()
    assert broken_links(README, text + "\n[x](docs/no_such_page.md)\n") == ["docs/no_such_page.md"]
    assert broken_links(README, text + "\n[x](docs/performance.md#no-such-section)\n") == \
        ["docs/performance.md#no-such-section"]


def test_the_keys_table_names_real_keys_with_their_defaults():
    defaults = {f.name: f.default for f in dataclasses.fields(OARConfig)}
    rows = re.findall(r"^\| `algorithm\.oar\.(\w+)` \| `?([^|`]+?)`? \|", README.read_text(), flags=re.M)
    assert len(rows) >= 5
    for key, default in rows:
        assert key in defaults, f"algorithm.oar.{key} is not an OARConfig key"
        assert str(defaults[key]) == default, f"algorithm.oar.{key}: README says {default}, OARConfig {defaults[key]}"


def test_no_dates_or_commit_hashes_in_the_readme():
    """Dated figures live in the pages that own them (docs/performance.md, tests/README.md), with their commands."""
    text = README.read_text()
    assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", text)
    assert not re.findall(r"\bcommit [0-9a-f]{7,}\b", text)


def test_the_citation_and_licence():
    text = README.read_text()
    assert "@article{li2026oar," in text
    assert re.search(r"eprint\s*=\s*\{2601\.07408\}", text) and re.search(r"archivePrefix\s*=\s*\{arXiv\}", text)
    assert "Apache-2.0" in text and 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text()
