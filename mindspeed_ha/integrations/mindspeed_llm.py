"""MindSpeed-LLM 2.3.0: who acts on the four high-availability flags.

MindSpeed-LLM defines ``--enable-high-availability``, ``--enable-hbmfault-repair``,
``--enable-worker-reboot`` and ``--distributed-optimizer-no-replica`` itself (its feature
``mindspeed_llm/features_manager/high_availability/high_availability.py``, which imports
Huawei's ``mindio_ttp`` SDK). Exactly one of the two acts on them:

* ``mindspeed-ha`` (default): our flags are on; MindSpeed-LLM's feature sees them off
  (``patches/mindspeed_llm.py``), so it neither imports ``mindio_ttp`` nor registers its
  patches, and its training loop's ``args.enable_high_availability`` branches stay off.
* ``mindio_ttp``: ``MINDSPEED_HA_PROVIDER=mindio_ttp`` (needs an importable ``mindio_ttp``):
  mindspeed-ha leaves the flags to MindSpeed-LLM; no HA feature of ours is switched on and
  ``mindspeed-ha-run`` acts as plain torchrun.

Imports nothing heavy (the launcher calls :func:`provider` before any worker starts).
"""

from __future__ import annotations

import importlib.util
import logging
import os

from mindspeed_ha import env as ha_env

OURS = "mindspeed-ha"
MINDIO = "mindio_ttp"
ACCEPTED = (OURS, MINDIO)

log = logging.getLogger("mindspeed_ha.integrations.mindspeed_llm")


def provider() -> str:
    """``mindspeed-ha`` or ``mindio_ttp``, from ``MINDSPEED_HA_PROVIDER`` (default ``mindspeed-ha``).

    Raises:
        mindspeed_ha.errors.ConfigError: a value outside :data:`ACCEPTED`, or ``mindio_ttp``
            chosen where ``mindio_ttp`` cannot be found.
    """
    from mindspeed_ha.errors import ConfigError

    value = os.environ.get(ha_env.PROVIDER, "").strip() or OURS
    if value not in ACCEPTED:
        raise ConfigError(f"{ha_env.PROVIDER}={value!r}: accepted {' or '.join(ACCEPTED)}")
    if value == MINDIO and importlib.util.find_spec("mindio_ttp") is None:
        raise ConfigError(f"{ha_env.PROVIDER}=mindio_ttp but mindio_ttp is not installed "
                          f"(unset it to use mindspeed-ha)")
    return value


def ours() -> bool:
    """Whether mindspeed-ha acts on the HA flags (see :func:`provider`)."""
    return provider() == OURS


def start_up_line(parsed) -> str:
    """The start-up log line saying who owns the flags (rank 0 prints it)."""
    if not ours():
        return ("mindspeed-ha: MINDSPEED_HA_PROVIDER=mindio_ttp: the high-availability flags are left to "
                "MindSpeed-LLM's own feature (mindio_ttp); no mindspeed-ha feature is on")
    also = " (mindio_ttp is installed too: MINDSPEED_HA_PROVIDER=mindio_ttp selects it instead)" \
        if importlib.util.find_spec("mindio_ttp") is not None else ""
    return ("mindspeed-ha: the high-availability flags are handled by mindspeed-ha; MindSpeed-LLM's own "
            f"high-availability feature (mindio_ttp) stays off{also}")
