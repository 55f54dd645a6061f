"""Every refusal the tests exercise, replayed: the same `error:` lines and exit code as recorded.

tests/data/refusals.json holds each case (entry point, argv, YAML, files, a damaged checkpoint) with
what it printed when recorded; tests/refusals.py replays them in this process. A refactor of the
checks must leave every line as it was; a deliberate change is re-recorded
(`python tests/refusals.py --record ID_PREFIX`) and shows in the data file's diff.
"""
import pytest

from refusals import Models, load_cases, replay

CASES = load_cases()


@pytest.fixture(scope="module")
def models(tiny_model, text_model, tmp_path_factory):
    return Models(tmp_path_factory.mktemp("refusal_models"), tiny=tiny_model, text=text_model)


@pytest.mark.parametrize("case", CASES, ids=[case["id"] for case in CASES])
def test_a_refusal_gives_the_recorded_line(case, models, tmp_path):
    assert replay(case, tmp_path, models) == {"stderr": case["stderr"], "code": case["code"]}


def test_every_recorded_case_is_one_error_line():
    """What the file may hold: a refusal, never a traceback or a job that ran (a server's: a 4xx)."""
    def refused(case):
        return 400 <= case["code"] < 500 if case["entry"] == "server" else case["code"] in (1, 2)
    wrong = [(case["id"], case["code"], case["stderr"]) for case in CASES
             if not refused(case) or len(case["stderr"]) != 1 or not case["stderr"][0].startswith("error: ")]
    assert not wrong, wrong
