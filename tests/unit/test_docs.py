"""The README stays in step with the code: every flag documented, the CI command the README's test command."""

from __future__ import annotations

from pathlib import Path

from qlora_fsdp.config import FLAGS

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_readme_documents_every_flag() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    missing = [flag for flag in FLAGS if f"`--{flag}`" not in readme]
    assert not missing, f"README.md option reference lacks {missing}"


def test_ci_runs_the_readme_test_command() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in readme
    assert "bash scripts/test.sh" in ci


def test_quick_start_has_exactly_two_commands() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in section.splitlines() if line.strip()]
    assert [c.split("#")[0].strip() for c in commands] == ["bash scripts/quickstart_cpu.sh", "bash scripts/test.sh"]


def test_readme_option_reference_is_generated_from_config() -> None:
    from scripts.update_readme_options import README, rendered

    current = README.read_text()
    assert rendered(current) == current, "run: python scripts/update_readme_options.py"
