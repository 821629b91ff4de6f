"""Regenerate the option reference, docs/options.md, from the config dataclasses (the single source of truth).

The script keeps its old name (CI and habits call it); the table it writes moved from README.md to docs/options.md.

python scripts/update_readme_options.py          # rewrite the section between the markers
python scripts/update_readme_options.py --check  # exit 1 if docs/options.md is out of date
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qlora_fsdp.config.help import option_docs
from qlora_fsdp.config.options import DEPRECATED

OPTIONS = Path(__file__).resolve().parents[1] / "docs" / "options.md"
START, END = "<!-- options:start -->", "<!-- options:end -->"


def options_markdown() -> str:
    lines: list[str] = []
    section = None
    for sec, flag, default, doc in option_docs():
        if sec != section:
            lines += ["", f"**{sec}**", "", "| flag | default | meaning |", "|---|---|---|"]
            section = sec
        lines.append(f"| `--{flag}` | `{default!r}` | {doc} |")
    lines += ["", "**deprecated** (accepted, with a notice, and ignored)", "", "| flag | why |", "|---|---|"]
    lines += [f"| `--{flag}` | {why[0].upper()}{why[1:]}. |" for flag, why in DEPRECATED.items()]
    return "\n".join(lines).strip() + "\n"


def rendered(page: str) -> str:
    """`page` with the text between the markers replaced by the table generated now."""
    head, rest = page.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{options_markdown()}{END}{tail}"


def main() -> int:
    current = OPTIONS.read_text()
    fresh = rendered(current)
    if "--check" in sys.argv[1:]:
        return 0 if fresh == current else 1
    OPTIONS.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
