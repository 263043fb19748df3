"""Feature ``core``: add the HA flags to Megatron's own argument parser and act on them.

Wraps ``parse_args`` of Megatron-LM (``megatron.training.arguments``) and of our
Megatron-shaped trainer (``mindspeed_ha.testing.trainer.arguments``): the user's
``extra_args_provider`` still runs, then, when parsing starts,
:func:`mindspeed_ha.config.add_ha_arguments` adds ``--enable-high-availability`` and
friends (skipping any flag the framework already defines, e.g. MindSpeed-LLM's own
copies, whichever of its wrappers and ours is outside). After parsing, the flags are
validated (errors name the flag and the accepted range) and the features are switched on.
Under MindSpeed-LLM the flags are ours unless ``MINDSPEED_HA_PROVIDER=mindio_ttp``
(:mod:`mindspeed_ha.integrations.mindspeed_llm`): then none of our features is switched on;
else ``args.enable_high_availability`` is turned off in Megatron's namespace once our
runtime holds the config, so MindSpeed-LLM's own HA branches stay off, and rank 0 says so.
"""

from __future__ import annotations

from mindspeed_ha import env as ha_env
import argparse
import os
import sys

from mindspeed_ha.integrations.mindspeed_llm import ours as provider_ours, start_up_line

from .registry import Patch, enable


def _add_missing_ha_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add our flags; flags already defined by the framework are left as they are."""
    from mindspeed_ha.config import add_ha_arguments

    scratch = argparse.ArgumentParser(add_help=False)
    add_ha_arguments(scratch)
    existing = set(parser._option_string_actions)
    group = parser.add_argument_group("high availability (mindspeed-ha)")
    for action in scratch._actions:
        if not action.option_strings or set(action.option_strings) & existing:
            continue
        group._add_action(action)
    return parser


def _add_missing_ha_arguments_at_parse(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add our flags when ``parser`` starts parsing, after every provider has run.

    A framework's provider can run after ours and define the same flags: MindSpeed-LLM's
    parse_args decorator, when it is inside our wrapper, adds its providers to the one we
    pass (mindspeed_llm/training/arguments.py ``extra_args_provider_decorator``); adding
    ours first would make argparse reject its copies as conflicting.
    """
    parse_known_args = parser.parse_known_args  # parse_args() calls it too

    def parse_known_args_with_ha(*args, **kwargs):
        vars(parser).pop("parse_known_args", None)  # once; back to argparse's own method
        _add_missing_ha_arguments(parser)
        return parse_known_args(*args, **kwargs)

    parser.parse_known_args = parse_known_args_with_ha
    return parser


def apply_ha_args(parsed) -> None:
    """Validate the HA flags of a parsed Megatron namespace and switch features on.

    Raises:
        mindspeed_ha.config.ConfigError: a flag is out of range or inconsistent.
    """
    from mindspeed_ha import runtime
    from mindspeed_ha.config import HAConfig, validate_ha_args
    from mindspeed_ha.patches.registry import check_disabled

    check_disabled()
    mindspeed_llm = "mindspeed_llm" in sys.modules
    if not provider_ours():  # MINDSPEED_HA_PROVIDER=mindio_ttp: the flags are MindSpeed-LLM's alone
        if mindspeed_llm and _ha_flag_set(parsed):
            _say(start_up_line(parsed))
        return
    config = HAConfig.from_args(parsed)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    validate_ha_args(
        parsed, world,
        getattr(parsed, "tensor_model_parallel_size", 1) or 1,
        getattr(parsed, "pipeline_model_parallel_size", 1) or 1,
        getattr(parsed, "context_parallel_size", 1) or 1,
    )
    if not config.enabled:
        return
    features = ["ha"]
    if getattr(parsed, "use_distributed_optimizer", False) and config.replica_count > 1:
        parsed.num_distributed_optimizer_instances = config.replica_count
        features.append("replica")
    if config.hbm_repair:
        features.append("hbm_repair")
    if config.worker_reboot:
        features.append("worker_reboot")
    if os.environ.get(ha_env.INJECT):
        features.append("testing")
    enable(*features)
    runtime.configure(config, parsed)
    if mindspeed_llm:
        # MindSpeed-LLM's training loop takes its own HA path (mindio_ttp) on this flag
        # (mindspeed_llm/training/training.py pretrain/train); our runtime keeps the config
        parsed.enable_high_availability = False
        _say(start_up_line(parsed))


def _ha_flag_set(parsed) -> bool:
    return bool(getattr(parsed, "enable_high_availability", False))


def _say(line: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(line, flush=True)


def _parse_args_wrapper(wrapped, instance, args, kwargs):
    kwargs = dict(kwargs)
    args = list(args)
    provider = kwargs.pop("extra_args_provider", args.pop(0) if args else None)

    def provider_with_ha(parser):
        if provider is not None:
            parser = provider(parser)
        return _add_missing_ha_arguments_at_parse(parser)

    parsed = wrapped(provider_with_ha, *args, **kwargs)
    apply_ha_args(parsed)
    return parsed


PATCHES = [
    Patch(
        name="arguments.parse_args.megatron",
        module="megatron.training.arguments",
        attribute="parse_args",
        wrapper=_parse_args_wrapper,
        feature="core",
        versions=None,
        doc="add and validate the HA flags in Megatron-LM's parse_args",
    ),
    Patch(
        name="arguments.parse_args.trainer",
        module="mindspeed_ha.testing.trainer.arguments",
        attribute="parse_args",
        wrapper=_parse_args_wrapper,
        feature="core",
        versions=None,
        doc="add and validate the HA flags in mindspeed_ha.testing.trainer's parse_args",
    ),
]
