"""The parts of ``mindspeed-ha-run`` (:mod:`mindspeed_ha.launcher`), one role each.

* :mod:`~mindspeed_ha.launch.survivors`: the agent-side state and the two torchrun patches
  (the poll that lets survivors finish the dying checkpoint, the graceful stop on SIGTERM
  and the escalation of later signals);
* :mod:`~mindspeed_ha.launch.standby`: controller failover on the launcher's side (the
  lease directory, taking a term, the standby that takes over);
* :mod:`~mindspeed_ha.launch.report`: the job's exit status, the closing line and the
  ``MINDSPEED_HA_REPORT`` JSON;
* :mod:`~mindspeed_ha.launch.checks`: what is checked before anything starts (the
  launcher's environment, torchrun's numeric flags, ``--save``);
* :mod:`~mindspeed_ha.launch.proctree`: ending a whole process tree (signals to the
  launcher or the demo).
"""
