"""Every environment variable mindspeed-ha reads or sets, named once.

The string literals live here and nowhere else in the product (``mindspeed_ha/``,
``patches/``, ``scripts/``): modules import the constants (``from mindspeed_ha import env
as ha_env``). :class:`mindspeed_ha.config.HAConfig` reads the job settings among them
(precedence: environment > flag > default, see its module docstring); the others are read
where they act, as documented per name. Imports nothing.
"""

# ---------------------------------------------------------------- the reference's contract
#: controller (master node) address for the ranks, an IPv4/IPv6 literal (MindIO TFT's name)
TTP_ADDR = "TTP_ADDR"
#: controller port (MindIO TFT's default 8000); the launcher sets the bound port here
TTP_PORT = "TTP_PORT"
#: controller address from the pod network (Kubernetes); wins over ``TTP_ADDR``
CONTROLLER_ADDR = "CONTROLLER_ADDR"
#: this rank's own interface address (Kubernetes pod network)
PROCESSOR_ADDR = "PROCESSOR_ADDR"

#: torchrun's: workers per node (a node's ranks are consecutive); sizes the fallback groups
#: for deciding without the controller (``runtime.bootstrap.fallback_group``)
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"

# ---------------------------------------------------------------- job settings (HAConfig)
#: seconds between a processor's heartbeats
HEARTBEAT_INTERVAL = "MINDSPEED_HA_HEARTBEAT_INTERVAL"
#: seconds of silence after which the controller counts a rank lost
HEARTBEAT_TIMEOUT = "MINDSPEED_HA_HEARTBEAT_TIMEOUT"
#: seconds the controller waits for every rank to stop
STOP_TIMEOUT = "MINDSPEED_HA_STOP_TIMEOUT"
#: seconds the controller waits for an action's result (dump, repair, ...)
ACTION_TIMEOUT = "MINDSPEED_HA_ACTION_TIMEOUT"
#: seconds a processor tries to reach the controller at start-up
CONNECT_TIMEOUT = "MINDSPEED_HA_CONNECT_TIMEOUT"
#: seconds from SIGTERM/SIGINT to the committed checkpoint (graceful stop)
PREEMPTION_DEADLINE = "MINDSPEED_HA_PREEMPTION_DEADLINE"
#: largest control-plane message, bytes
MAX_MESSAGE_BYTES = "MINDSPEED_HA_MAX_MESSAGE_BYTES"
#: the job key, hex (>= 16 bytes): CURVE keys and HMAC tags derive from it
AUTH_KEY = "MINDSPEED_HA_AUTH_KEY"
#: the torch caching allocators' switches (UCE repair needs the allocator on)
NO_CUDA_CACHING = "PYTORCH_NO_CUDA_MEMORY_CACHING"
NO_NPU_CACHING = "PYTORCH_NO_NPU_MEMORY_CACHING"

# ---------------------------------------------------------------- launcher -> ranks
#: "1" when the launcher runs the controller (ranks do not start their own)
CONTROLLER_HOSTED = "MINDSPEED_HA_CONTROLLER_HOSTED"
#: the incarnation of a restarted worker (0 = first start), set by the agent
INCARNATION = "MINDSPEED_HA_INCARNATION"
#: warm spares per node: pre-imported interpreters a restart takes over (0 or 1)
WARM_SPARES = "MINDSPEED_HA_WARM_SPARES"
#: ``1`` in the env of a hot switch's new process (set by the agent): it registers as the
#: incoming process of its rank, not as the rank (control/switch_desk.py)
SWITCH = "MINDSPEED_HA_SWITCH"
#: "1": fork the workers of a node from one pre-imported process (0 or 1, default 0)
FORKSERVER = "MINDSPEED_HA_FORKSERVER"
#: comma-separated modules that process imports besides torch and megatron.core
FORKSERVER_PRELOAD = "MINDSPEED_HA_FORKSERVER_PRELOAD"
#: seconds the launcher grants the survivors to write the dying checkpoint ((0, 86400], default 600)
DYING_GRACE_S = "MINDSPEED_HA_DYING_GRACE_S"
#: path of the launcher's JSON report (outcome, recoveries, phase seconds); its directory must exist
REPORT = "MINDSPEED_HA_REPORT"
#: parent of the controller-failover lease directories (default ``<--save>/.mindspeed_ha``)
LEASE_ROOT = "MINDSPEED_HA_LEASE_ROOT"
#: this job's lease directory (set by the launcher for its controllers)
LEASE_DIR = "MINDSPEED_HA_LEASE_DIR"
#: lease seconds of controller failover ((0, 3600], default 10)
LEASE_S = "MINDSPEED_HA_LEASE_S"
#: the node relay's socket path for the workers (``control/relay.py``, set by the launcher);
#: in the launcher's own environment ``0`` (no relay) or ``1`` / unset (the relay)
RELAY = "MINDSPEED_HA_RELAY"
#: this node's address for the other launchers' agent links
NODE_ADDR = "MINDSPEED_HA_NODE_ADDR"
#: the launcher's log level (a ``logging`` level name, any case; default INFO)
LOG = "MINDSPEED_HA_LOG"

# ---------------------------------------------------------------- patches and checkpoints
#: who acts on the four HA flags: ``mindspeed-ha`` (default) or ``mindio_ttp`` (MindSpeed-LLM's
#: own high-availability feature; then mindspeed-ha leaves the flags alone). Never both.
PROVIDER = "MINDSPEED_HA_PROVIDER"
#: comma-separated patch names not to apply (each one ``mindspeed-ha patches`` lists)
DISABLE_PATCHES = "MINDSPEED_HA_DISABLE_PATCHES"
#: "0"/"1": force the CPU backend off/on (default: on without CUDA and NPU)
CPU_BACKEND = "MINDSPEED_HA_CPU_BACKEND"
#: directory of built C++ helpers and datasets (Megatron's dataset helpers)
CACHE = "MINDSPEED_HA_CACHE"
#: "1": keep a failed dying checkpoint's staging directory (debugging)
KEEP_FAILED_STAGING = "MINDSPEED_HA_KEEP_FAILED_STAGING"

# ---------------------------------------------------------------- measurement and tests
#: JSON lines: one per rank when its re-run iteration is done after a recovery
RECOVERY_LOG = "MINDSPEED_HA_RECOVERY_LOG"
#: fault injector specs (``rank=R,iteration=K,point=P[,fault=F]``; ``;`` between specs)
INJECT = "MINDSPEED_HA_INJECT"
#: JSON lines: one per fired injected fault (wall clock)
INJECT_LOG = "MINDSPEED_HA_INJECT_LOG"
#: ``fault=hold``: the file whose existence lets the held rank go on (a test looks at the running job meanwhile);
#: holding an iteration, it releases the holds up to that one only (testing/injector.py, ``release``)
INJECT_RELEASE = "MINDSPEED_HA_INJECT_RELEASE"
#: JSON lines: per-iteration losses (tests compare them bit for bit)
LOSS_LOG = "MINDSPEED_HA_LOSS_LOG"
#: path: each rank writes which patches it applied
PATCH_REPORT = "MINDSPEED_HA_PATCH_REPORT"
#: test only: skip the repair from a replica (a test proves the losses then differ)
TESTING_SKIP_REPAIR = "MINDSPEED_HA_TESTING_SKIP_REPAIR"
#: test only: after a group rebuild, fail if an old group is still referenced
TESTING_CHECK_HOLDERS = "MINDSPEED_HA_TESTING_CHECK_HOLDERS"
#: benchmarks: the memory probe's output directory
BENCH_OUT = "MINDSPEED_HA_BENCH_OUT"
