"""The documentation stays in step with the code and with itself.

- every flag `train.py --help` prints is documented in docs/options.md, whose tables are generated from the config;
- every relative link in README.md, docs/*.md and benchmarks/README.md leads to a file that exists, and a `#anchor`
  into a Markdown page to one of its headings (GitHub's slugs);
- the README's quick start is the two commands it promises, the second the one CI runs, and the README stays short.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
README = REPO_ROOT / "README.md"
OPTIONS_PAGE = REPO_ROOT / "docs" / "options.md"
PAGES = sorted([README, REPO_ROOT / "benchmarks" / "README.md", *(REPO_ROOT / "docs").glob("*.md")])
README_MAX_LINES = 300

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^()\s<>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a `#` there is a shell comment, a `[x](y)` is code)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def _prose(text: str) -> str:
    """The text outside fenced code blocks, with inline code spans blanked (their brackets are not links)."""
    return CODE_SPAN.sub("code", "\n".join(_prose_lines(text)))


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text lowercased, punctuation dropped, spaces as hyphens."""
    text = LINK.sub(lambda m: m.group(2), heading)  # a link in a heading keeps its text only
    text = re.sub(r"<[^>]+>", "", text).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a Markdown page, with GitHub's -1, -2, ... for repeated headings."""
    seen: dict[str, int] = {}
    found = set()
    for line in _prose_lines(page.read_text()):
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def relative_links(page: Path) -> list[str]:
    """The targets of the page's Markdown links and images that are not URLs (relative paths and #anchors)."""
    return [m.group(3) for m in LINK.finditer(_prose(page.read_text())) if not SCHEME.match(m.group(3))]


def help_flags() -> list[str]:
    """The flags `train.py --help` prints, read from the text it prints (the docstring fire shows), in-process."""
    from qlora_fsdp.cli import main

    return re.findall(r"^\s+--(\w+)\b", main.__doc__ or "", flags=re.M)


def test_help_lists_every_config_flag() -> None:
    """A control for the next test: the flags read from the help text are all of the config's, and --config."""
    from qlora_fsdp.config.options import FLAGS

    flags = help_flags()
    assert len(flags) == len(set(flags)), "a flag is listed twice in --help"
    assert set(flags) == {*FLAGS, "config"}


def test_options_page_documents_every_help_flag() -> None:
    page = OPTIONS_PAGE.read_text()
    missing = [flag for flag in help_flags() if f"`--{flag}`" not in page]
    assert not missing, f"docs/options.md lacks {missing}: run python scripts/update_readme_options.py"


def test_options_page_is_generated_from_config() -> None:
    from scripts.update_readme_options import OPTIONS, rendered

    assert OPTIONS == OPTIONS_PAGE
    current = OPTIONS.read_text()
    assert rendered(current) == current, "run: python scripts/update_readme_options.py"


def test_supported_models_page_is_generated_from_the_tests() -> None:
    """docs/supported-models.md lists exactly the architectures and formats the end-to-end tests train."""
    from scripts.update_supported_models import PAGE, rendered

    current = PAGE.read_text()
    assert rendered(current) == current, "run: python scripts/update_supported_models.py"


def test_github_slug_control() -> None:
    """The slug rule against anchors GitHub gives these headings."""
    assert github_slug("Checkpoints, resume and preemption") == "checkpoints-resume-and-preemption"
    assert github_slug("Data suite (`--suite cpu-data`)") == "data-suite---suite-cpu-data"
    assert github_slug("Preference training (DPO, IPO, ORPO, SimPO)") == "preference-training-dpo-ipo-orpo-simpo"
    assert github_slug("FSDP versions") == "fsdp-versions"


def test_link_parser_control(tmp_path: Path) -> None:
    """Links across lines and with code in their text are found; code, URLs and fenced blocks are not links."""
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\nSee [the\nmanual](a.md#x), [`b.md`](b.md) and [web](https://example.com).\n"
        "`[not](c.md)`\n\n```bash\n# not a heading [no](d.md)\n```\n\n## Title\n"
    )
    assert relative_links(page) == ["a.md#x", "b.md"]
    assert anchors(page) == {"title", "title-1"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with the anchor #{anchor} in {dest.relative_to(REPO_ROOT)}")
    assert not broken, f"{page.relative_to(REPO_ROOT)}: {broken}"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in relative_links(README)}
    orphans = [p.name for p in sorted((REPO_ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not orphans, f"README.md links no docs page {orphans}"


def test_readme_is_at_most_300_lines() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_ci_runs_the_readme_test_command() -> None:
    readme = README.read_text()
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in readme
    assert "bash scripts/test.sh" in ci


def test_quick_start_has_exactly_two_commands() -> None:
    readme = README.read_text()
    section = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in section.splitlines() if line.strip()]
    assert [c.split("#")[0].strip() for c in commands] == ["bash scripts/quickstart_cpu.sh", "bash scripts/test.sh"]
