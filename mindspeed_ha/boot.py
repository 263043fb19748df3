"""Worker entry used by ``mindspeed-ha-run``: import mindspeed_ha, then run the user's script.

``python -m mindspeed_ha.boot pretrain_gpt.py ARGS`` runs ``pretrain_gpt.py`` as
``__main__`` (its directory first on ``sys.path``, as ``python pretrain_gpt.py`` would);
``python -m mindspeed_ha.boot -m pkg.module ARGS`` runs a module. Importing
``mindspeed_ha`` first installs the patch registry's post-import hooks, so an unmodified
Megatron-LM ``pretrain_gpt.py`` gets the HA flags.
"""

import os
import runpy
import sys

import mindspeed_ha  # noqa: F401  (installs the post-import hooks)


def main() -> None:
    """Run the script; a :class:`~mindspeed_ha.errors.ConfigError` it lets out (a flag the
    launcher does not read, refused by the rank's ``parse_args``) ends the rank with one
    ``error:`` line and status 2, as argparse ends on a bad flag."""
    from mindspeed_ha.errors import ConfigError
    from mindspeed_ha.teardown import skip_final_collection

    skip_final_collection()  # first: it runs after the runtime's exit hooks
    try:
        try:
            _run()
        except ConfigError as exc:
            print(f"{os.path.basename(sys.argv[0])}: error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
    except SystemExit as exc:  # the exit status, for the runtime's exit hook (after an in-place recovery)
        from mindspeed_ha.runtime import record_exit_status

        record_exit_status(exc.code)
        raise


def _run() -> None:
    argv = sys.argv[1:]
    if not argv:
        raise SystemExit("usage: python -m mindspeed_ha.boot (SCRIPT | -m MODULE) [ARGS...]")
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit("mindspeed_ha.boot: -m needs a module name")
        sys.argv = [argv[1]] + argv[2:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = argv[0]
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
