import pytest

from tokenyard.bench import suite
from tokenyard.bench.suite import replace_section

PAGE = "# B\n\n## Engine\n\nold engine\n\n## Async\n\nold async\n\n## Profile\n\nkept\n"


def test_one_section_is_replaced_and_the_rest_of_the_page_kept() -> None:
    new = replace_section(PAGE, "## Async\n\nnew async\n")
    assert new == "# B\n\n## Engine\n\nold engine\n\n## Async\n\nnew async\n\n## Profile\n\nkept\n"


def test_a_section_the_page_lacks_goes_before_the_profile() -> None:
    new = replace_section(PAGE, "## Fleet\n\nfleet\n")
    assert new.index("## Fleet") < new.index("## Profile")
    assert "old async" in new and new.endswith("## Profile\n\nkept\n")


def test_the_lora_section_runs_bench_lora_and_replaces_its_section(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench suite --only lora`: one `tokenyard bench lora --rounds 3` run, its table
    under the section's own title, the rest of the page kept."""
    runs: list[list[str]] = []

    def run(cmd: list[str]) -> str:
        runs.append(cmd)
        return "| side | tok/s median | min | max |\n|---|---:|---:|---:|\n| base | 1 | 1 | 1 |"

    monkeypatch.setattr(suite, "_run", run)
    section = suite.SECTIONS["lora"](None)
    assert [c[3:] for c in runs] == [["bench", "lora", "--rounds", "3"]]
    assert section.startswith("## LoRA adapters (`tokenyard bench lora`)\n")
    assert "`tokenyard bench lora --rounds 3`" in section and "| base | 1 | 1 | 1 |" in section
    page = replace_section(PAGE, section)
    assert page.index("## LoRA adapters") < page.index("## Profile")
    assert "old async" in page
    assert replace_section(page, section.replace("| base | 1", "| base | 2")).count(
        "## LoRA adapters") == 1
