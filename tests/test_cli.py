"""Flags built from configuration dataclasses."""

import pytest

from common.cli import UserError, add_config_flags, config_from_namespace, make_parser
from host.config import HostConfig
from runners.verify_model import VerifyConfig


def parse(config_cls, *argv):
    parser = make_parser("test", "")
    add_config_flags(parser, config_cls)
    return config_from_namespace(config_cls, parser.parse_args(list(argv)))


@pytest.mark.parametrize("words", [["15", "16", "17", "18"], ["15,16,17,18"], ["15,16", "17", "18"],
                                   ["15,", "16,17,18"]])
def test_a_list_flag_takes_spaces_commas_or_both(words):
    config = parse(HostConfig, "--machine_id", "0", "--layers_to_extract", *words, "--batch_size", "4")
    assert config.layers_to_extract == (15, 16, 17, 18) and config.batch_size == 4


def test_every_list_flag_does(tmp_path):
    assert parse(VerifyConfig, "--model_path", "m", "--layers_to_extract", "1", "2,3").layers_to_extract == (1, 2, 3)


def test_list_flag_errors_are_one_line():
    with pytest.raises(UserError, match="expected integers separated by commas or spaces, got '1x'"):
        parse(HostConfig, "--machine_id", "0", "--layers_to_extract", "1x")
    with pytest.raises(UserError, match="expected one argument|expected at least one argument"):
        parse(HostConfig, "--machine_id", "0", "--layers_to_extract")


def test_machine_id_is_a_number_or_auto():
    assert parse(HostConfig, "--machine_id", "auto").machine_id == "auto"
    assert parse(HostConfig, "--machine_id", "7").machine_id == 7
    with pytest.raises(UserError, match="expected a machine number or 'auto', got 'seven'"):
        parse(HostConfig, "--machine_id", "seven")


def test_the_last_of_a_boolean_flag_pair_wins():
    # A settings file's value comes first, as a flag; the command line may turn it over.
    assert parse(HostConfig, "--machine_id", "0", "--no_compress_shards", "--compress_shards").compress_shards
    assert not parse(HostConfig, "--machine_id", "0", "--compress_shards", "--no_compress_shards").compress_shards


def test_a_settings_file_then_flags(tmp_path):
    from ablation.config import AblationConfig
    from common.settings_file import read_settings, setting_words
    path = tmp_path / "experiments.yaml"
    path.write_text("model_path: m\ninterventions: [head:0-3.*, mlp:*]\ntensorboard: false\nbatch_size: 2\n")
    words = setting_words(read_settings(str(path), AblationConfig), AblationConfig, str(path))
    config = parse(AblationConfig, *words, "--tensorboard", "--batch_size", "8")
    assert config.interventions == ("head:0-3.*", "mlp:*") and config.tensorboard and config.batch_size == 8
    path.write_text("model_path: m\nlayers: 3\n")
    with pytest.raises(UserError, match="unknown setting\\(s\\) layers"):
        read_settings(str(path), AblationConfig)


@pytest.mark.parametrize("body, code, out, err", [
    ("print('written'); logging.getLogger('x').info('logged'); return 3", 3, "written\n", "logged"),
    ("print('partial'); raise UserError('bad input')", 2, "partial\n", "prog: error: bad input"),
])
def test_skipping_the_native_teardown_keeps_the_exit_code_and_every_line(body, code, out, err):
    """``run_main(..., skip_native_teardown=True)`` ends through ``os._exit``: what was printed
    and logged is flushed first, and the code is main's (2 for a user error)."""
    import os
    import subprocess
    import sys
    import textwrap
    script = textwrap.dedent(f"""
        import logging
        from common.cli import UserError, run_main
        def main(argv):
            {body}
        run_main("prog", main, [], skip_native_teardown=True)
        print("never")
    """)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=repo)
    assert result.returncode == code
    assert result.stdout == out and err in result.stderr and "never" not in result.stdout
