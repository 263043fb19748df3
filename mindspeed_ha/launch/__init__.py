"""The parts of ``mindspeed-ha-run`` (:mod:`mindspeed_ha.launcher`), one role each.

* :mod:`~mindspeed_ha.launch.survivors`: the agent-side state and the two torchrun patches
  (the poll that lets survivors finish the dying checkpoint, the graceful stop on SIGTERM);
* :mod:`~mindspeed_ha.launch.standby`: controller failover on the launcher's side (the
  lease directory, taking a term, the standby that takes over);
* :mod:`~mindspeed_ha.launch.report`: the job's exit status, the closing line and the
  ``MINDSPEED_HA_REPORT`` JSON.
"""
