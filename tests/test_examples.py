"""The example launch scripts: shell syntax, the HA flags, and every flag checked against
Megatron-LM core_v0.12.1's own argument parser.

Each script prints its command instead of running it when ``DRY_RUN=1``. The Megatron-LM
script's pretrain_gpt.py arguments must pass Megatron-LM's ``parse_args`` and
``validate_args`` (both run on CPU: ``validate_args`` touches CUDA only for
``--moe-grouped-gemm``) with ``mindspeed_ha`` imported first, as ``mindspeed-ha-run``
does; the launcher part must pass torchrun's parser. The MindSpeed-LLM script cannot run
here (no NPU, no MindSpeed-LLM): its flags must be Megatron-LM's, ours, or one of the few
MindSpeed-LLM 2.3.0 defines, listed below with their source.
"""

import json
import os
import shlex
import subprocess
import sys
import tarfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(os.path.dirname(HERE), "scripts")
MEGATRON_SCRIPT = os.path.join(SCRIPTS, "pretrain_llama2_7b_ptd.sh")
LLM_SCRIPT = os.path.join(SCRIPTS, "pretrain_llama2_7b_ptd_mindspeed_llm.sh")
#: The stock Megatron-LM sources (shared/third_party/README.md), beside or inside the checkout.
TARBALL = next((p for p in (os.path.join(os.path.dirname(HERE), d, "shared", "third_party",
                                         "Megatron-LM-core_v0.12.1.tar.gz") for d in ("..", "."))
                if os.path.isfile(p)), None)

HA_FLAGS = ["--enable-high-availability", "--enable-hbmfault-repair", "--enable-worker-reboot",
            "--distributed-optimizer-no-replica"]

#: Flags of the MindSpeed-LLM script that Megatron-LM does not define: MindSpeed-LLM 2.3.0
#: mindspeed_llm/training/arguments.py lines 466-470 (_add_fusion_op_args) and MindSpeed
#: v2.3.0_core_r0.12.1 mindspeed/features_manager/megatron_basic/megatron_basic.py lines 10-11.
MINDSPEED_LLM_FLAGS = {"--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb"}

#: The environment the scripts read; cleared so the caller's shell cannot change the result.
SCRIPT_ENV = ("TINY", "BF16", "MEGATRON_LM", "DATA_PATH", "TOKENIZER_MODEL", "CKPT_DIR", "CKPT_FORMAT",
              "CKPT_SAVE_DIR", "CKPT_LOAD_DIR", "NPROC", "NPUS_PER_NODE", "NNODES", "NODE_RANK",
              "MASTER_ADDR", "MASTER_PORT", "TP", "PP", "TRAIN_ITERS", "SAVE_INTERVAL", "TTP_ADDR",
              "GLOO_SOCKET_IFNAME", "LAUNCHER", "DRY_RUN", "NO_REPLICA", "LOG_DIR", "CPU", "MINDSPEED_LLM")

# (name, script, env) of every dry run checked below.
CASES = {
    "megatron-tiny": (MEGATRON_SCRIPT, {"TINY": "1"}),
    "megatron-tiny-bf16-data": (MEGATRON_SCRIPT, {"TINY": "1", "BF16": "1", "DATA_PATH": "/data/x_text_document",
                                                  "TOKENIZER_MODEL": "/tok/tokenizer.model"}),
    "megatron-7b": (MEGATRON_SCRIPT, {"TINY": "0"}),
    "megatron-7b-data-dist": (MEGATRON_SCRIPT, {"DATA_PATH": "/data/x_text_document", "CKPT_FORMAT": "torch_dist",
                                                "TOKENIZER_MODEL": "/tok/tokenizer.model", "NNODES": "2",
                                                "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1"}),
    "mindspeed-llm-tiny": (LLM_SCRIPT, {"TINY": "1"}),
    "mindspeed-llm-7b": (LLM_SCRIPT, {"DATA_PATH": "/data/x_text_document", "TOKENIZER_MODEL": "/tok/tokenizer.model"}),
}


def dry_run(script, env, *extra):
    """The command ``script`` would run (``DRY_RUN=1``), as an argument list."""
    base = {k: v for k, v in os.environ.items() if k not in SCRIPT_ENV}
    full = dict(base, DRY_RUN="1", MEGATRON_LM="/opt/Megatron-LM", **env)
    r = subprocess.run(["bash", script, *extra], env=full, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return shlex.split(r.stdout)


@pytest.mark.parametrize("script", [MEGATRON_SCRIPT, LLM_SCRIPT], ids=os.path.basename)
def test_shell_syntax(script):
    r = subprocess.run(["bash", "-n", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("script", [MEGATRON_SCRIPT, LLM_SCRIPT], ids=os.path.basename)
def test_exports_controller_address_and_gloo_interface(script):
    text = open(script).read()
    assert "export TTP_ADDR=" in text and "export GLOO_SOCKET_IFNAME=" in text


@pytest.mark.parametrize("name", sorted(CASES))
def test_ha_flags_and_launcher(name):
    script, env = CASES[name]
    cmd = dry_run(script, env, "--seed", "7")
    assert cmd[0] == "mindspeed-ha-run"
    assert cmd[-2:] == ["--seed", "7"], "extra arguments are appended last"
    for flag in HA_FLAGS:
        assert cmd.count(flag) == 1, flag
    if script == LLM_SCRIPT:
        i = cmd.index("--bf16")
        assert cmd[i + 1:i + 5] == HA_FLAGS, "the four HA flags follow --bf16"


def test_megatron_script_tiny_switch():
    tiny, full = dry_run(MEGATRON_SCRIPT, {"TINY": "1"}), dry_run(MEGATRON_SCRIPT, {"TINY": "0"})
    assert "--bf16" not in tiny and "--bf16" in full
    assert tiny[tiny.index("--nproc-per-node") + 1] == "4"
    assert full[full.index("--nproc-per-node") + 1] == "8"
    assert tiny[tiny.index("--distributed-backend") + 1] == "gloo"
    assert tiny[1 + tiny.index("--ckpt-format")] == "torch"
    assert dry_run(MEGATRON_SCRIPT, {"TINY": "1", "LAUNCHER": "python -m mindspeed_ha.launcher"})[:3] == [
        "python", "-m", "mindspeed_ha.launcher"]


@pytest.fixture(scope="module")
def megatron_lm(tmp_path_factory):
    """Megatron-LM core_v0.12.1 unpacked into a temporary directory; returns its root."""
    if TARBALL is None:
        pytest.skip("shared/third_party/Megatron-LM-core_v0.12.1.tar.gz not present")
    dest = tmp_path_factory.mktemp("megatron_lm")
    with tarfile.open(TARBALL) as tar:
        tar.extractall(dest, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(dest)
    root = dest / "Megatron-LM"
    assert (root / "megatron" / "training" / "arguments.py").is_file()
    return str(root)


# Runs in a subprocess with Megatron-LM on sys.path. For each case: the launcher part
# through torchrun's parser (as mindspeed-ha-run parses it), then pretrain_gpt.py's part
# through Megatron-LM's parse_args + validate_args (or, for the MindSpeed-LLM script,
# Megatron-LM's parser plus our flags, reporting what neither knows).
CHECK = r'''
import argparse, json, os, sys, traceback
import mindspeed_ha  # first, as mindspeed_ha.boot does: adds the HA flags to parse_args
from torch.distributed.run import get_args_parser
import megatron.training.arguments as A
from mindspeed_ha.patches.arguments import _add_missing_ha_arguments

out = {}
for name, kind, cmd in json.loads(sys.stdin.read()):
    res = out[name] = {}
    try:
        targs = get_args_parser().parse_args(cmd[1:])
        res["script"] = os.path.basename(targs.training_script)
        argv = list(targs.training_script_args)
        world = int(targs.nproc_per_node) * int(str(targs.nnodes).split(":")[-1])
        os.environ.update(WORLD_SIZE=str(world), RANK="0", LOCAL_RANK="0")
        if kind == "megatron":
            sys.argv = ["pretrain_gpt.py"] + argv
            args = A.parse_args()
            A.validate_args(args, {})
            res.update(world=world, dp=args.data_parallel_size, layers=args.num_layers, hidden=args.hidden_size,
                       ffn=args.ffn_hidden_size, heads=args.num_attention_heads, seq=args.seq_length,
                       swiglu=args.swiglu, norm=args.normalization, pos=args.position_embedding_type,
                       untied=args.untie_embeddings_and_output_weights, bias=args.add_bias_linear,
                       bf16=args.bf16, impl=args.transformer_impl, ckpt_format=args.ckpt_format,
                       dist_opt=args.use_distributed_optimizer, ha=args.enable_high_availability,
                       no_replica=args.distributed_optimizer_no_replica,
                       instances=args.num_distributed_optimizer_instances, mock=args.mock_data,
                       tokenizer=args.tokenizer_type)
        else:
            parser = A.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
            ns, unknown = _add_missing_ha_arguments(parser).parse_known_args(argv)
            res.update(unknown=unknown, ha=ns.enable_high_availability, bf16=ns.bf16)
    except BaseException as exc:  # argparse exits with SystemExit(2)
        res["error"] = "".join(traceback.format_exception(exc))[-2000:]
print("RESULT " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def checked(megatron_lm):
    """Every case's dry-run command checked in one subprocess (Megatron-LM imports once)."""
    cases = [(name, "megatron" if script == MEGATRON_SCRIPT else "llm", dry_run(script, env))
             for name, (script, env) in sorted(CASES.items())]
    env = dict(os.environ, PYTHONPATH=megatron_lm)
    env.pop("MINDSPEED_HA_INJECT", None)
    r = subprocess.run([sys.executable, "-c", CHECK], input=json.dumps(cases), env=env, capture_output=True,
                       text=True, timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("name", ["megatron-tiny", "megatron-tiny-bf16-data", "megatron-7b", "megatron-7b-data-dist"])
def test_megatron_script_accepted_by_megatron_parse_and_validate(checked, name):
    res = checked[name]
    assert "error" not in res, res.get("error")
    assert res["script"] == "pretrain_gpt.py"
    assert res["swiglu"] and res["norm"] == "RMSNorm" and res["pos"] == "rope"
    assert res["untied"] and not res["bias"] and res["dist_opt"]
    assert res["ha"] and res["no_replica"] and res["instances"] == 1
    tiny = "tiny" in name
    shape = (4, 64, 172, 4, 32) if tiny else (32, 4096, 11008, 32, 4096)
    assert (res["layers"], res["hidden"], res["ffn"], res["heads"], res["seq"]) == shape
    assert res["dp"] == res["world"] // 2, "TP=1 PP=2"
    assert res["impl"] == ("local" if tiny else "transformer_engine")
    assert res["bf16"] == (not tiny or "bf16" in name)
    assert res["mock"] == ("data" not in name)
    assert res["tokenizer"] == ("Llama2Tokenizer" if "data" in name else "NullTokenizer")
    assert res["ckpt_format"] == ("torch_dist" if name.endswith("dist") else "torch")


@pytest.mark.parametrize("name", ["mindspeed-llm-tiny", "mindspeed-llm-7b"])
def test_mindspeed_llm_script_flags_known(checked, name):
    res = checked[name]
    assert "error" not in res, res.get("error")
    assert res["script"] == "pretrain_gpt.py" and res["ha"] and res["bf16"]
    assert set(res["unknown"]) <= MINDSPEED_LLM_FLAGS, set(res["unknown"]) - MINDSPEED_LLM_FLAGS
