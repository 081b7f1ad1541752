"""``--max-restarts`` (up, serve jobs) and ``RayLauncher(max_restarts=…)``: a negative count is a usage
error (exit 2, one line) before anything starts."""

from __future__ import annotations

import pytest

from onpolicy.cli.main import main
from onpolicy.services.cluster.actors import DEFAULT_MAX_RESTARTS, RayLauncher


@pytest.mark.parametrize("argv", [["up", "--port", "0", "--max-restarts", "-1"],
                                  ["serve", "jobs", "--max-restarts", "-2"]])
def test_negative_max_restarts_is_a_usage_error(argv: list[str], capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--max-restarts must be >= 0" in err[0]


def test_launcher_restarts_by_default_and_refuses_a_negative_count() -> None:
    assert RayLauncher().max_restarts == DEFAULT_MAX_RESTARTS == 3
    with pytest.raises(ValueError, match="max_restarts"):
        RayLauncher(max_restarts=-1)
