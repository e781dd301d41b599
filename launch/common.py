"""Flags and start-up shared by every launcher (absl lives only in launch/).

`run(main, prog, module)` is every console script's entry point: it parses the command line (flag
names in absl's or vLLM's spelling: `--max_tokens` and `--max-tokens` are one flag, `--no-stream` is
`--nostream`), prints the tool's own flags for `--help` (exit 0), reports a usage error (a bad flag,
value, model, hardware or layout) as one line on stderr with exit status 2, and runs `main`.

`setup()` must run before JAX touches a device: it sets the XLA options that let collectives overlap
compute, turns on the persistent compilation cache and starts multi-process JAX when asked.

XLA options set by default on GPU (--xla_perf, on by default):
  JAX optimization level O1 (jax_optimization_level / JAX_OPTIMIZATION_LEVEL): turns on XLA:GPU's
    latency-hiding scheduler (async collectives are scheduled to overlap independent compute),
    collective pipelining, the SOL latency estimator on Hopper and while-loop double buffering.
  --xla_gpu_enable_latency_hiding_scheduler=true: the same scheduler, explicitly, for jax versions
    without optimization levels.
  NCCL_NVLS_ENABLE=0: NVLink multicast stays off (required on this project's machines).
--command_buffer_update_mode (XLA_FLAGS, read once at start): how XLA:GPU refreshes the CUDA graphs it runs
  the step's kernels in when buffers move (`command_buffer_xla_flag`).
"""
from __future__ import annotations

import os
import sys
import textwrap
from typing import Callable, Optional, Sequence

from absl import app, flags
from absl import logging as absl_logging

FLAGS = flags.FLAGS
# --command_buffer_update_mode auto
COMMAND_BUFFER_AUTO = "always"

flags.DEFINE_integer("tensor_parallel_size", 1, "devices that split heads / FFN width (TP)")
flags.DEFINE_integer("data_parallel_size", 1, "devices that split the batch (DP attention)")
flags.DEFINE_bool("enable_expert_parallel", False, "whole experts per device (EP) instead of TP slices")
flags.DEFINE_integer("prefill_chunk", None, "prompt tokens of one request per prefill step (a longer prompt "
                     "takes several steps, interleaved with decode steps); default: LLM's")
flags.DEFINE_integer("max_prefill_tokens", None, "prompt tokens of all requests per prefill step; default: LLM's")
flags.DEFINE_enum("step_layout", None, ["padded", "ragged"],
                  "padded: a prefill and a decode pass per iteration (padded programs); ragged: "
                  "one step over a flat token axis; default: LLM's (padded), kimi-serve's ragged "
                  "(padded with --speculative_config)")
flags.DEFINE_integer("max_num_batched_tokens", None, "tokens of one ragged step (decode rows and "
                     "prompt chunks); default: max(max_prefill_tokens, max_num_seqs)")
flags.DEFINE_integer("long_prefill_token_threshold", None, "a prompt chunk's most tokens in one "
                     "ragged step (0: the step's budget); default: LLM's")
flags.DEFINE_bool("enable_prefix_caching", True, "reuse the cache pages of a prompt prefix seen before "
                  "(kimi-generate, kimi-batch, kimi-serve)")
flags.DEFINE_bool("batch_invariant", None, "a request's greedy tokens and logprobs do not depend on the "
                  "other requests in its batch (default: on where VLLM_BATCH_INVARIANT=1)")
flags.DEFINE_bool("check_finite_weights", True, "check every loaded weight for NaN / Inf (on the host, as "
                  "each tensor is read) and refuse a checkpoint that has one")
flags.DEFINE_bool("xla_perf", True, "set XLA options that overlap collectives with compute (see launch/common.py)")
flags.DEFINE_enum("command_buffer_update_mode", "auto", ["auto", "always", "skip_temp", "skip_profiled"],
                  "XLA:GPU's CUDA-graph update mode (--xla_gpu_command_buffer_update_mode, jaxlib >= 0.11.2): "
                  "'always' patches every graph node whose buffers moved at each call; 'skip_temp' gives temporaries "
                  "fixed addresses; 'skip_profiled' also the arguments and results that kept theirs over the first "
                  f"calls; auto: {COMMAND_BUFFER_AUTO}")
flags.DEFINE_string("compilation_cache_dir", None, "persistent JAX compilation cache (compiled programs are "
                    "reused by later runs); 'none' turns it off. Default: $KIMI_JAX_CACHE_DIR, else "
                    "$XDG_CACHE_HOME/kimi_jax/xla (~/.cache/kimi_jax/xla)")
flags.DEFINE_bool("progress", None, "one-line progress on stderr while loading and compiling (default: on)")
flags.DEFINE_string("coordinator_address", None, "multi-host: host:port of process 0")
flags.DEFINE_integer("num_processes", None, "multi-host: number of processes")
flags.DEFINE_integer("process_id", None, "multi-host: this process's index")

HELP_ARGS = ("--help", "-h", "-help", "--helpshort", "-?")
COMMON_MODULE = __name__


def command_buffer_xla_flag(mode: str, jaxlib_version: Optional[str]) -> Optional[str]:
    """The XLA_FLAGS entry for --command_buffer_update_mode `mode` under jaxlib `jaxlib_version` (None: not
    installed), or None where XLA keeps its own setting: 'auto' resolves to COMMAND_BUFFER_AUTO; jaxlib before
    0.11.2 knows none of the skip modes (0.10.2 aborts on them), so there any mode leaves XLA's."""
    mode = COMMAND_BUFFER_AUTO if mode == "auto" else mode
    if mode == "always" or jaxlib_version is None:
        return None
    import re
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", jaxlib_version)
    if m is None or tuple(int(g) for g in m.groups()) < (0, 11, 2):
        return None
    return f"--xla_gpu_command_buffer_update_mode={mode.upper()}"


def _jaxlib_version() -> Optional[str]:
    from importlib import metadata
    try:
        return metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return None


def add_xla_flag(entry: str) -> None:
    """Append `entry` ('--name=value') to XLA_FLAGS unless the user's XLA_FLAGS already set that name."""
    xf = os.environ.get("XLA_FLAGS", "")
    if entry.lstrip("-").split("=", 1)[0] not in xf:
        os.environ["XLA_FLAGS"] = (xf + " " + entry).strip()


def setup() -> None:
    """XLA options, the compilation cache, progress and multi-process start; call first in every
    launcher's main()."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if FLAGS.xla_perf:
        os.environ.setdefault("JAX_OPTIMIZATION_LEVEL", "O1")
        add_xla_flag("--xla_gpu_enable_latency_hiding_scheduler=true")
    cb = command_buffer_xla_flag(FLAGS.command_buffer_update_mode, _jaxlib_version())
    if cb:
        add_xla_flag(cb)
    from kimi_jax.entrypoints import compilation_cache, progress
    compilation_cache.enable(FLAGS.compilation_cache_dir)
    if FLAGS.progress is False:
        progress.pause()
    else:
        progress.enable()
    if FLAGS.num_processes and FLAGS.num_processes > 1:
        from kimi_jax.parallel.distributed import initialize
        initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)


def layout_kwargs() -> dict:
    """The layout arguments from the flags."""
    return dict(tensor_parallel_size=FLAGS.tensor_parallel_size, data_parallel_size=FLAGS.data_parallel_size,
                enable_expert_parallel=FLAGS.enable_expert_parallel)


#: EngineConfig fields whose launcher flags carry vLLM's other names
FLAG_NAMES = {"overlap_scheduling": "async_scheduling"}
#: the --dtype help every launcher that builds an engine shows
DTYPE_HELP = "compute dtype; auto: float32 on CPU, else the checkpoint's torch_dtype (bfloat16 if it has none)"


def engine_config(**fixed):
    """The EngineConfig of the command line: each field from its flag where one is defined and set
    (FLAG_NAMES for vLLM's names), `fixed` over those, EngineConfig's defaults for the rest."""
    import dataclasses
    from kimi_jax.engine.args import EngineConfig
    kw = {}
    for f in dataclasses.fields(EngineConfig):
        name = FLAG_NAMES.get(f.name, f.name)
        if name in FLAGS and FLAGS[name].value is not None:
            kw[f.name] = FLAGS[name].value
    kw.update(fixed)
    if kw.get("enforce_eager") and kw.get("precompile"):
        raise app.UsageError("--enforce_eager compiles each program on first use; it cannot be "
                             "combined with --precompile")
    try:
        return EngineConfig(**kw)
    except (TypeError, ValueError) as e:
        field, _, rest = str(e).partition(" ")
        raise app.UsageError(f"--{FLAG_NAMES.get(field, field)} {rest}") from None


#: the scheduling flags every launcher passes on to its engine
SCHEDULING_FLAGS = ("prefill_chunk", "max_prefill_tokens", "step_layout", "max_num_batched_tokens",
                    "long_prefill_token_threshold")


def engine_kwargs() -> dict:
    """LLM(...) keywords of the layout and scheduling flags (launch/tool_eval.py)."""
    sched = {k: getattr(FLAGS, k) for k in SCHEDULING_FLAGS if getattr(FLAGS, k) is not None}
    return dict(layout_kwargs(), **sched, check_finite_weights=FLAGS.check_finite_weights,
                enable_prefix_caching=FLAGS.enable_prefix_caching)


def check_loopback(url: str, hint: str = "") -> None:
    """ValueError unless every address of `url`'s host is a loopback address (load tools and evals
    target the local server only)."""
    import ipaddress
    import socket
    from urllib.parse import urlparse
    host = urlparse(url).hostname
    if host is None:
        raise ValueError(f"--base_url {url!r} has no host")
    for info in socket.getaddrinfo(host, None):
        if not ipaddress.ip_address(info[4][0]).is_loopback:
            raise ValueError(f"--base_url host {host} is not a loopback address{hint}")


def fail(prog: str, message) -> None:
    """A user error (bad checkpoint, config, layout, flag or input): one line on stderr, exit status 2."""
    sys.stderr.write(f"{prog}: error: {' '.join(str(message).split())}\n")
    sys.stderr.flush()
    sys.exit(2)


# ---- the command line -------------------------------------------------------------------------------
def normalize_argv(argv: Sequence[str]) -> list[str]:
    """vLLM's spelling -> absl's: `--max-tokens=8` -> `--max_tokens=8`, `--no-stream` -> `--nostream`
    (a boolean flag's negation). Arguments after `--` and values are left as they are."""
    out: list[str] = []
    rest = False
    for a in argv:
        if rest or not a.startswith("--") or a == "--":
            rest = rest or a == "--"
            out.append(a)
            continue
        name, eq, value = a[2:].partition("=")
        under = name.replace("-", "_")
        if under not in FLAGS and under.startswith("no_") and under[3:] in FLAGS:
            under = "no" + under[3:]
        out.append("--" + under + eq + value)
    return out


def _module_key(module: str) -> Optional[str]:
    """The key absl files a module's flags under: its name, or for `python -m` / a script (__main__)
    the script's path."""
    known = FLAGS.flags_by_module_dict()
    if module in known:
        return module
    if module == "__main__":
        main = sys.modules.get("__main__")
        for key in (sys.argv[0] if sys.argv else None, getattr(main, "__file__", None)):
            if key in known:
                return key
    return None


def _flag_lines(module: str) -> list[str]:
    key = _module_key(module)
    names = sorted(f.name for f in FLAGS.get_flags_for_module(key)) if key else []
    lines = []
    for name in names:
        f = FLAGS[name]
        if f.default is None or f.default == []:
            default = ""
        elif isinstance(f.default, bool):
            default = f" (default: {'on' if f.default else 'off'})"
        elif isinstance(f.default, (list, tuple)):
            default = f" (default: {','.join(map(str, f.default))})"
        else:
            default = f" (default: {f.default})"
        head = f"  --{name.replace('_', '-')}"
        text = f.help
        kind = f.flag_type()
        if kind == "bool":
            head += f" / --no-{name.replace('_', '-')}"
        elif isinstance(f.parser, flags.EnumParser):
            head += "={" + ",".join(f.parser.enum_values) + "}"
            text = text.split(">: ", 1)[1] if text.startswith("<") and ">: " in text else text
        else:
            head += "=" + {"int": "INT", "float": "FLOAT", "string": "STR", "comma separated list of strings": "LIST"}.get(
                kind, "VALUE")
        body = textwrap.fill(f"{text}{default}", width=96, initial_indent=" " * 6, subsequent_indent=" " * 6)
        lines += [head, body]
    return lines


def help_text(prog: str, module: str, doc: Optional[str] = None, *, common: bool = True) -> str:
    """`prog --help`: the tool's description and its own flags, then the shared launcher flags."""
    parts = [f"usage: {prog} [flags]", ""]
    if doc:
        parts += [textwrap.dedent(doc).strip(), ""]
    own = _flag_lines(module)
    if own:
        parts += [f"{prog} flags:"] + own + [""]
    if common and module != COMMON_MODULE:
        parts += ["shared launcher flags (launch/common.py):"] + _flag_lines(COMMON_MODULE) + [""]
    parts.append("Flag names may be spelled with dashes or underscores (--max-tokens or --max_tokens); "
                 "--helpfull lists every flag, absl's included.")
    return "\n".join(parts) + "\n"


def flags_parser(prog: str, module: str = "__main__", doc: Optional[str] = None, positional_hint: str = "",
                 common: bool = True, positionals: int = 0):
    """An absl flags_parser for app.run: --help prints the tool's own flags (exit 0); a bad flag is one
    line on stderr and exit status 2; vLLM's dash spelling is accepted; at most `positionals`
    positional arguments (a path given positionally gets a hint naming --model)."""
    def parse(argv):
        argv = [argv[0]] + normalize_argv(argv[1:])
        if any(a in HELP_ARGS for a in argv[1:]):
            sys.stdout.write(help_text(prog, module, doc, common=common))
            sys.exit(0)
        if "--helpfull" in argv[1:]:
            sys.stdout.write(FLAGS.get_help() + "\n")
            sys.exit(0)
        try:
            rest = FLAGS(argv)
        except flags.Error as e:
            fail(prog, f"{e} (see {prog} --help)")
        if len(rest) > 1 + positionals:
            hint = positional_hint or next((f" (a path goes in a flag: --model {a}, or see {prog} --help)"
                                            for a in rest[1:] if os.path.exists(a) or "/" in a), "")
            fail(prog, f"unexpected positional arguments {rest[1 + positionals:]!r}{hint}")
        return rest
    return parse


def user_errors():
    """The exception types that launchers report as one line with exit status 2."""
    from checkpoints.safetensors_io import CheckpointError
    from kimi_jax.config import ConfigError
    from kimi_jax.parallel.sharding import LayoutError
    return (CheckpointError, ConfigError, LayoutError, app.UsageError)


def quiet_logs() -> None:
    """Library logs at WARNING (absl's INFO lines, JAX's note that no TPU backend exists, XLA's C++
    INFO), unless the command line sets --verbosity."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    if not any(a.startswith(("--verbosity", "-v=", "--v=")) for a in sys.argv[1:]):
        absl_logging.set_verbosity(absl_logging.WARNING)
    import logging
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)     # "Unable to initialize backend 'tpu'"


def run(main: Callable, prog: str, module: str, doc: Optional[str] = None, *,
        argv: Optional[Sequence[str]] = None, positional_hint: str = "", errors: tuple = (),
        common: bool = True, positionals: int = 0) -> None:
    """Run a launcher: parse (see flags_parser), then main(argv); the exceptions of user_errors() and
    `errors` are reported as one line with exit status 2."""
    quiet_logs()
    argv = list(sys.argv if argv is None else argv)
    argv[0] = prog

    def guarded(rest):
        try:
            return main(rest)
        except user_errors() + tuple(errors) as e:
            fail(prog, e)
    app.run(guarded, argv=argv, flags_parser=flags_parser(prog, module, doc, positional_hint, common, positionals))
