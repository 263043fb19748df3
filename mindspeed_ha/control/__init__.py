"""Control plane: one controller thread per job, one processor thread per rank.

Nothing here imports torch, so the controller can run in the launcher process.
Modules: ``wire`` (messages), ``auth`` (CURVE keys and ZAP), ``admission`` (rate
budgets, bounded rejection logs), ``state`` (state machines), ``policy`` (pure
decisions), ``controller`` (I/O thread applying decisions), ``processor`` (per rank).
"""
