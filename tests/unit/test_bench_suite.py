from tokenyard.bench.suite import replace_section

PAGE = "# B\n\n## Engine\n\nold engine\n\n## Async\n\nold async\n\n## Profile\n\nkept\n"


def test_one_section_is_replaced_and_the_rest_of_the_page_kept() -> None:
    new = replace_section(PAGE, "## Async\n\nnew async\n")
    assert new == "# B\n\n## Engine\n\nold engine\n\n## Async\n\nnew async\n\n## Profile\n\nkept\n"


def test_a_section_the_page_lacks_goes_before_the_profile() -> None:
    new = replace_section(PAGE, "## Fleet\n\nfleet\n")
    assert new.index("## Fleet") < new.index("## Profile")
    assert "old async" in new and new.endswith("## Profile\n\nkept\n")
