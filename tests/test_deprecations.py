"""The suite fails on a FutureWarning that batchspec's own calls raise, and only on those.

Each test runs the suite's conftest.py and pytest settings over a small test file of its own (pytester), so the
outcome checked is the one a real deprecation would have.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

# A model whose ``config`` is deprecated as transformers deprecates an argument: the warning names the caller of the
# property (this file), not the batchspec function that reads it.
RENAMED_MODEL = '''
import warnings


class RenamedModel:
    @property
    def config(self):
        warnings.warn("`config` is deprecated; use `settings`", FutureWarning, stacklevel=2)
        return None
'''


@pytest.fixture
def suite(pytester):
    """A pytester folder with the suite's conftest.py and pytest settings."""
    pytester.syspathinsert(TESTS)
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    settings = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    pytester.makeini("\n    ".join(["[pytest]\nfilterwarnings =", *settings["filterwarnings"]]))
    return pytester


def test_a_future_warning_under_a_batchspec_call_fails_the_test(suite):
    suite.makepyfile(RENAMED_MODEL + '''
import pytest
from batchspec.model_checks import check_model


def test_checks_a_renamed_model():
    with pytest.raises(ValueError, match="causal LM"):  # what check_model says once the warning passes
        check_model(RenamedModel(), "target")
''')
    result = suite.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*FutureWarning: `config` is deprecated; use `settings`"])


def test_a_future_warning_of_a_tests_own_call_is_only_recorded(suite):
    suite.makepyfile(RENAMED_MODEL + '''
def test_reads_a_renamed_model():
    assert RenamedModel().config is None
''')
    result = suite.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, warnings=1)


def test_a_future_warning_ascribed_to_batchspec_at_import_is_an_error(suite):
    suite.makepyfile('''
import warnings

warnings.warn_explicit("`old` is deprecated", FutureWarning, "batchspec/fake.py", 1, module="batchspec.fake")


def test_nothing():
    pass
''')
    result = suite.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
