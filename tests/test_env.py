"""flashtile.env: environment switches read from os.environ's own table follow every change to it."""
import os

import pytest

from flashtile import env

NAME = "FLASHTILE_TEST_SWITCH"


@pytest.mark.parametrize("through_table", [True, False], ids=["table", "os.environ.get"])
def test_get_and_flag_follow_os_environ(monkeypatch, through_table):
    if not through_table:
        monkeypatch.setattr(env, "_DATA", None)
    monkeypatch.delenv(NAME, raising=False)
    assert env.get(NAME) is None and env.get(NAME, "default") == "default" and not env.flag(NAME)
    for value, on in [("1", True), ("0", False), ("", False), ("yes", True), ("é", True)]:
        monkeypatch.setenv(NAME, value)
        assert env.get(NAME) == value == os.environ.get(NAME)
        assert env.flag(NAME) is on, value
    os.environ[NAME] = "2"
    assert env.get(NAME) == "2"
    del os.environ[NAME]
    assert env.get(NAME) is None and not env.flag(NAME)
