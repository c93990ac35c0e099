"""`tokenyard bench ray`'s section (`cli/ray_bench.py`): the table gives the median, min and
max over the rounds of created -> healthy, of the part inside the actor, and of Ray's part
(their difference), with the rounds counted and the load average stated."""

from __future__ import annotations

from tokenyard.cli.ray_bench import TITLE, Round, render


def test_the_table_gives_median_min_max_of_each_part() -> None:
    rounds = [Round(10.0, 6.0), Round(8.0, 5.5), Round(12.0, 9.0)]
    text = render(rounds, 4.31, (1.5, 2.75), "tokenyard bench ray")
    assert text.startswith(TITLE + "\n")
    assert "| 3 rounds, seconds | median | min | max |" in text
    assert "| created → healthy | 10.00 | 8.00 | 12.00 |" in text
    assert "| process → listening (inside the actor) | 6.00 | 5.50 | 9.00 |" in text
    assert "| Ray's part (the difference) | 3.00 | 2.50 | 4.00 |" in text
    assert "load average 1.50 at the start, 2.75 at the end" in text
    assert "the local Ray cluster itself started in 4.3 s" in text
