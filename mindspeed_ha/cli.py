"""``mindspeed-ha``: the command-line front end.

Subcommands:
    demo        the main job: a fault-tolerant Megatron run on 4 CPU ranks with a killed
                rank, the dying checkpoint, a resume, and the loss curves side by side
    soak        one 4-rank job with a seeded schedule of many mixed faults (UCE, network,
                kill, hang), compared bitwise with an uninterrupted run; resources flat
    patches     list every registered patch, its feature and whether it is active
    controller  run a standalone controller (what rank 0 starts without the launcher)
    events      print a job's events file (--ha-events-file); --follow tails it
    preprocess  build a Megatron indexed dataset (.bin/.idx) from a text file
    status      a running job's phase, ranks, heartbeats, pauses and recoveries
    pause       graceful pause of a running job: every rank holds after one iteration
    resume      end a graceful pause
    stop        graceful stop: checkpoint of the last completed iteration, exit 75
    check       online check inside the paused ranks (GEMM bitwise across DP replicas and speed,
                memory patterns, p2p and all-reduce bandwidth): pause, check, resume
    relink      rebuild every process group with ranks bound to another address or interface
                (--back: the original): pause, relink, resume
    switch      hot switch: move live ranks to new processes at a step boundary

The operator verbs (status, pause, resume, stop, check, relink, switch) reach the job's controller over its
authenticated channel (the job key: MINDSPEED_HA_AUTH_KEY or --key-file; the address:
--addr HOST:PORT, MINDSPEED_HA_LEASE_DIR, CONTROLLER_ADDR/TTP_ADDR and TTP_PORT).
Exit codes: 0 done, 1 the action failed (check: its code was not 0; relink: it failed and
switched back), 2 usage, 4 refused in the job's current state, 5 unreachable, 6 authentication
failed. check's own code (0 ok, 1 not run, 2 fault, 3 timeout) is printed and in --json's result.code.
"""

from __future__ import annotations

import argparse
import json
import sys


def _cmd_patches(ns) -> int:
    import mindspeed_ha  # noqa: F401
    from mindspeed_ha.patches import registry

    if ns.import_megatron:
        import importlib

        for mod in sorted({r["target"].split(":")[0] for r in registry.report()}):
            try:
                importlib.import_module(mod)
            except ImportError:
                pass
    for f in ns.enable or ():
        registry.enable(f)
    rows = registry.report()
    if ns.json:
        print(json.dumps(rows, indent=1))
        return 0
    w = max(len(r["name"]) for r in rows) if rows else 5
    print(f"{'patch':{w}} {'feature':12} {'active':6}  {'status':16} target")
    for r in rows:
        print(f"{r['name']:{w}} {r['feature']:12} {str(r['active']):6}  {r['status'][:16]:16} {r['target']}")
    print(f"\nenabled features: {', '.join(registry.enabled_features())}")
    return 0


def _cmd_controller(ns, rest) -> int:
    from mindspeed_ha.control import controller

    return controller.main(rest) or 0


def _cmd_preprocess(ns, rest) -> int:
    from mindspeed_ha.testing.trainer import data

    return data.main(rest) or 0


def _cmd_demo(ns) -> int:
    from mindspeed_ha.launch.proctree import become_subreaper
    from mindspeed_ha.testing.demo import run_demo

    become_subreaper()  # a worker whose launcher died stays in this process's tree (ended on a signal)
    return run_demo(ns)


def _cmd_operator(ns) -> int:
    import math
    import os
    import secrets

    from mindspeed_ha import env as ha_env
    from mindspeed_ha.config import HAConfig
    from mindspeed_ha.control import operator
    from mindspeed_ha.errors import ConfigError

    def say(code: int, text: str, result=None) -> int:
        if ns.json:
            print(json.dumps({"verb": ns.cmd, "code": code, "detail": text, "request_id": rid,
                              "result": result or {}}, sort_keys=True))
        elif ns.cmd == "status" and code == 0 and result:
            print(operator.format_status(result))
        elif ns.cmd in ("check", "relink") and result and "ranks" in result:
            print(operator.format_task(result), file=sys.stdout if code == 0 else sys.stderr)
        else:
            print(f"mindspeed-ha {ns.cmd}: {text}", file=sys.stdout if code == 0 else sys.stderr)
        return code

    rid = ns.request_id or secrets.token_hex(8)
    max_s = getattr(ns, "max", None)
    try:
        params = _task_params(ns)
        if ns.timeout is None:  # a pause task answers after the pause and the task
            ns.timeout = 30.0 + (float(params.get("budget_s", 60.0)) + 60.0 if params else 0.0)
        if not (math.isfinite(ns.timeout) and ns.timeout > 0):
            raise ConfigError(f"--timeout {ns.timeout}: accepted finite seconds > 0")
        if max_s is not None and not (math.isfinite(max_s) and 0 < max_s <= 7 * 24 * 3600):
            raise ConfigError(f"--max {max_s}: accepted range (0, 604800] seconds")
        if getattr(ns, "then_stop", False) and max_s is None:
            raise ConfigError("--then-stop goes with --max S")
        if not 0 < len(rid) <= 64:
            raise ConfigError("--request-id: 1..64 characters")
        key = operator.read_key(ns.key_file, os.environ)
        target = operator.find_controller(ns.addr, key, os.environ)
        max_bytes = HAConfig.from_args(None, {k: v for k, v in os.environ.items() if k != ha_env.AUTH_KEY}
                                       ).max_message_bytes  # the job's frame limit, checked as the ranks do
    except ConfigError as exc:
        return say(operator.EXIT_USAGE, str(exc))
    try:
        reply = operator.request(ns.cmd, key=key, target=target, timeout_s=ns.timeout, max_s=max_s or 0.0,
                                 then_stop=getattr(ns, "then_stop", False), request_id=rid, max_bytes=max_bytes,
                                 params=params)
    except operator.OperatorError as exc:
        return say(exc.code, str(exc))
    return say(operator.result_code(reply), reply.detail or "ok", reply.result)


def _csv_ranks(text):
    try:
        ranks = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated global ranks, e.g. 1,3") from None
    if not ranks or min(ranks) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated global ranks >= 0, e.g. 1,3")
    return ranks


def _task_params(ns) -> dict:
    """The request params of ``check`` / ``relink`` / ``switch`` ({} for the other verbs).
    Raises ConfigError."""
    import math

    from mindspeed_ha.control.policy.pause_task import CHECK_TESTS
    from mindspeed_ha.errors import ConfigError

    if ns.cmd == "switch":
        if (ns.ranks is None) == (ns.node is None):
            raise ConfigError("switch: give exactly one of --ranks R[,R..] and --node HOST")
        return {"ranks": sorted(set(ns.ranks))} if ns.ranks is not None else {"node": ns.node}
    if ns.cmd not in ("check", "relink"):
        return {}
    if not (math.isfinite(ns.budget) and 0 < ns.budget <= 3600):
        raise ConfigError(f"--budget {ns.budget}: accepted range (0, 3600] seconds")
    params = {"budget_s": float(ns.budget), "stay": bool(ns.stay_paused)}
    if ns.ranks:
        params["ranks"] = sorted(set(ns.ranks))
    if getattr(ns, "node", None):
        params["node"] = ns.node
    if ns.cmd == "check":
        tests = [t.strip() for t in ns.test.split(",") if t.strip()]
        if not tests or any(t not in CHECK_TESTS for t in tests):
            raise ConfigError(f"--test {ns.test!r}: a comma-separated subset of {','.join(CHECK_TESTS)}")
        params.update(tests=tests, on_fault=ns.on_fault)
        return params
    if sum(map(bool, (ns.link_addr, ns.iface, ns.back))) != 1:
        raise ConfigError("relink: give exactly one of --addr A, --iface I, --back")
    if not ns.ranks:
        raise ConfigError("relink: --ranks R is required")
    params.update(addr=ns.link_addr or "", iface=ns.iface or "", back=bool(ns.back))
    return params


def _operator_parser(sub, verb: str, help_text: str, addr_flags=("--addr", "--controller")):
    p = sub.add_parser(verb, help=help_text)
    p.add_argument(*addr_flags, dest="addr", default=None,
                   help="the controller's HOST:PORT (default: the leader in the job's lease "
                        "directory, MINDSPEED_HA_LEASE_DIR or under MINDSPEED_HA_LEASE_ROOT; "
                        "else CONTROLLER_ADDR/TTP_ADDR and TTP_PORT)")
    p.add_argument("--key-file", default=None, help="file holding the job key in hex (default: MINDSPEED_HA_AUTH_KEY)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds to wait for the answer (default 30; check / relink: 90 + --budget)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--request-id", default=None,
                   help="idempotency key (default: random); a repeated id gets the first answer, never a second action")
    return p


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="mindspeed-ha", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="fault-tolerant Megatron run with a killed rank, on 4 CPU ranks")
    d.add_argument("--fault", default="kill", choices=["kill", "uce", "network"],
                   help="kill: SIGKILL a rank, dying checkpoint, resume with --load (default); uce: a device "
                        "memory error (memory really damaged), repaired in place from a replica; network: a link "
                        "error inside a real collective, the step re-run in place")
    d.add_argument("--reboot", action="store_true",
                   help="with --fault kill: --enable-worker-reboot, the killed process is restarted alone and "
                        "rejoins the survivors (no dying checkpoint, no --load)")
    d.add_argument("--kill-rank", "--fault-rank", dest="kill_rank", type=int, default=1,
                   help="global rank the fault hits (default 1)")
    d.add_argument("--kill-iteration", "--fault-iteration", dest="kill_iteration", type=int, default=6,
                   help="iteration the fault hits (default 6)")
    d.add_argument("--kill-point", "--fault-point", dest="kill_point", default=None,
                   choices=["forward", "backward", "optimizer", "between", "grad_sync", "pp", "tp"],
                   help="where: kill and uce: forward|backward|optimizer|between (default backward); "
                        "network: grad_sync|pp|tp (default grad_sync)")
    d.add_argument("--tensor-model-parallel-size", type=int, default=1)
    d.add_argument("--pipeline-model-parallel-size", type=int, default=2)
    d.add_argument("--train-iters", type=int, default=12)
    d.add_argument("--nproc", type=int, default=4, help="ranks (default 4)")
    d.add_argument("--report", default=None, help="write the summary as JSON to this file")
    d.add_argument("--workdir", default=None, help="keep checkpoints and logs here (default: a temp dir, removed)")
    d.add_argument("--data-path", default=None, help="Megatron indexed dataset prefix (default: embedded corpus)")

    s = sub.add_parser("soak", help="many faults of mixed kinds in one 4-rank job: every one recovered, losses "
                                    "bitwise, fds/threads/RSS flat")
    s.add_argument("--faults", type=int, default=100, help="faults, one per iteration from iteration 2 (default 100)")
    s.add_argument("--seed", type=int, default=0, help="seed of the fault schedule (default 0)")
    s.add_argument("--kinds", default="uce=4,network=4,kill=1,hang=1",
                   help="kind=weight, kinds uce, network, kill, hang (default uce=4,network=4,kill=1,hang=1)")
    s.add_argument("--layout", default="tp1pp2", choices=["tp1pp2", "tp2pp1", "dp4"])
    s.add_argument("--report", default=None, help="write the report as JSON to this file")
    s.add_argument("--workdir", default=None, help="keep the logs here (default: a temp dir, removed)")

    p = sub.add_parser("patches", help="list registered patches and whether they are active")
    p.add_argument("--json", action="store_true")
    p.add_argument("--import-megatron", action="store_true", help="import the target modules first")
    p.add_argument("--enable", action="append", help="enable a feature before listing (to preview)")

    e = sub.add_parser("events", help="print the job's events (the --ha-events-file JSON lines)")
    e.add_argument("--file", required=True, help="the job's --ha-events-file")
    e.add_argument("--follow", action="store_true", help="go on printing the events appended, until --timeout")
    e.add_argument("--timeout", type=float, default=3600.0, help="seconds --follow runs (default 3600)")
    e.add_argument("--json", action="store_true", help="one JSON object per line (the file's schema)")
    _operator_parser(sub, "status", "a running job's status (phase, ranks, heartbeats, pauses, recoveries)")
    pz = _operator_parser(sub, "pause", "graceful pause: every rank holds after one iteration (answers once all do)")
    pz.add_argument("--max", type=float, default=None, metavar="S", help="resume by itself after S seconds")
    pz.add_argument("--then-stop", action="store_true",
                    help="with --max: at S, stop instead (checkpoint of the iteration held at, exit 75)")
    _operator_parser(sub, "resume", "end a graceful pause")
    _operator_parser(sub, "stop", "graceful stop: checkpoint of the last completed iteration, exit 75")
    for verb, text in (("check", "online check inside the paused ranks: pause, check, resume (codes: 0 ok, 1 not "
                                 "run, 2 fault, 3 timeout)"),
                       ("relink", "rebuild every process group with --ranks bound to --addr / --iface (--back: the "
                                  "original): pause, relink, resume")):
        t = _operator_parser(sub, verb, text, ("--controller",) if verb == "relink" else ("--addr", "--controller"))
        t.add_argument("--ranks", type=_csv_ranks, default=None,
                       help="global ranks, comma-separated (check: default every rank; relink: required)")
        t.add_argument("--budget", type=float, default=60.0, metavar="S",
                       help="seconds the ranks may take (check: else code 3; relink: each group's rendezvous) "
                            "(default 60)")
        t.add_argument("--stay-paused", action="store_true",
                       help="keep the job paused afterwards (default: as it was found: a running job resumes)")
    ck, rl = sub.choices["check"], sub.choices["relink"]
    ck.add_argument("--node", default=None, metavar="HOST",
                    help="every rank whose process runs on HOST (the host status lists; instead of --ranks)")
    ck.add_argument("--test", default="gemm,memory,p2p,allreduce", help="comma-separated: gemm,memory,p2p,allreduce")
    ck.add_argument("--on-fault", default="report", choices=["report", "exit", "switch"],
                    help="on code 2: report (default), exit (graceful stop: checkpoint of the paused iteration, "
                         "exit 75), switch (the hot switch of the faulty ranks)")
    rl.add_argument("--addr", dest="link_addr", default=None, metavar="A",
                    help="the ranks' new local address (gloo: the device's hostname)")
    rl.add_argument("--iface", default=None, metavar="I",
                    help="the ranks' new interface (GLOO_/NCCL_/HCCL_SOCKET_IFNAME)")
    rl.add_argument("--back", action="store_true", help="back to the ranks' original address")
    sw = _operator_parser(sub, "switch", "hot switch: move live ranks to new processes at a step boundary (answers "
                                         "when it is done or abandoned)")
    sw.add_argument("--ranks", type=_csv_ranks, default=None, metavar="R[,R..]",
                    help="global ranks to move to new processes")
    sw.add_argument("--node", default=None, metavar="HOST",
                    help="every rank whose process runs on HOST (the host status lists), in one switch "
                         "(instead of --ranks)")
    sw.set_defaults(timeout=300.0)  # the reply comes once the spares started and the switch ended

    sub.add_parser("controller", help="standalone controller (see --help of mindspeed_ha.control.controller)",
                   add_help=False)
    sub.add_parser("preprocess", help="text file -> Megatron indexed dataset", add_help=False)

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("controller", "preprocess"):
        ns = argparse.Namespace(cmd=argv[0])
        fn = _cmd_controller if argv[0] == "controller" else _cmd_preprocess
        return fn(ns, argv[1:])
    ns = parser.parse_args(argv)
    if ns.cmd == "patches":
        return _cmd_patches(ns)
    if ns.cmd == "events":
        from mindspeed_ha.control import job_events

        return job_events.cli(ns.file, ns.follow, ns.timeout, ns.json)
    if ns.cmd in ("status", "pause", "resume", "stop", "check", "relink", "switch"):
        return _cmd_operator(ns)
    if ns.cmd == "soak":
        from mindspeed_ha.launch.proctree import become_subreaper
        from mindspeed_ha.testing import soak

        become_subreaper()  # as the demo's
        return soak.main(ns)
    return _cmd_demo(ns)


if __name__ == "__main__":
    sys.exit(main())
