"""Checks shared by the tests of the command-line scripts."""
import pytest


def assert_usage_error(parse, argv, text, capsys):
    """``parse(argv)`` stops as argparse does on bad input (exit status 2), naming ``text`` on stderr."""
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2
    assert text in capsys.readouterr().err
