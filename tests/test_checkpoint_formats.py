"""The checkpoint-format registry (mindspeed_ha/checkpoint/formats): one key, --ckpt-format."""

import argparse
import subprocess
import sys

import pytest

from mindspeed_ha.checkpoint import formats
from mindspeed_ha.checkpoint.formats.base import CheckpointFormat
from mindspeed_ha.errors import CheckpointError, ConfigError


def test_built_in_formats_by_their_flag_value():
    assert formats.registered_formats() == ("torch", "torch_dist")
    assert formats.get_format("torch").name == "torch"
    assert formats.get_format(None).name == "torch"  # no --ckpt-format: the built-in trainer
    assert formats.format_of(argparse.Namespace(ckpt_format="torch_dist")).name == "torch_dist"
    assert formats.checkpoint_format(argparse.Namespace()) == "torch"


def test_unknown_format_names_the_flag_and_the_accepted_values():
    with pytest.raises(ConfigError, match="--ckpt-format torch_dcp .*torch or torch_dist"):
        formats.get_format("torch_dcp")


def test_a_registered_format_is_found_and_checked_at_start_up(monkeypatch):
    class Refusing(CheckpointFormat):
        name = "demo"

        def check(self, args):
            raise ConfigError("--ckpt-format demo: refused")

        def dump(self, ctx, iteration, snapshot, role):
            return "nothing"

        def assemble(self, ctx, iteration):
            return "nothing"

        def validate(self, ckpt_dir, iteration=None):
            return []

        def recognizes(self, ckpt_dir):
            return False

    monkeypatch.setattr(formats, "_FORMATS", dict(formats._FORMATS))
    formats.register_format("demo", Refusing())
    assert formats.get_format("demo").name == "demo"
    with pytest.raises(ConfigError, match="refused"):
        formats.check_args(argparse.Namespace(ckpt_format="demo"))


def test_a_directory_of_unknown_format_is_validated_by_its_own_format(tmp_path):
    (tmp_path / "metadata.json").write_text("{}")
    with pytest.raises(CheckpointError, match="not a readable torch_dist checkpoint"):
        formats.validate_checkpoint_dir(str(tmp_path / "."), 3)
    with pytest.raises(CheckpointError, match="not a checkpoint of any format"):
        formats.validate_checkpoint_dir(str(tmp_path / "missing"), 3)


def test_the_start_up_check_imports_no_torch():
    """The launcher checks --ckpt-format before any worker starts, without torch."""
    code = ("import sys, argparse; from mindspeed_ha.checkpoint import formats; "
            "formats.check_args(argparse.Namespace(ckpt_format='torch_dist')); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
