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
