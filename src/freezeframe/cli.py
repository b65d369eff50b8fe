"""The ``freezeframe`` command.

Subcommands are registered in :data:`SUBCOMMANDS` as ``(name, "module[:function]")``; the
function (default ``add_parser``) receives argparse's subparsers object, adds its parser and sets
``func`` (``handler(args) -> int`` exit code) with ``set_defaults``. A module is imported only
when its command runs (or for ``--help``), and a module that does not exist yet is skipped, so one
command's missing or heavy dependencies never break another. Keep module-level imports of such
modules light (import torch inside the handler).

Every error a user can cause is one line on stderr, ``freezeframe COMMAND: error: ...``:

* a bad argument (wrong type, out of range, unknown choice) — argparse's error, without the
  usage block — exits 2;
* :class:`~freezeframe.errors.ConfigError` raised by a command (a bad config, a device that is
  not there, an output directory that cannot be written) exits 2;
* any other :class:`~freezeframe.errors.FreezeframeError` (compiling or capturing failed) exits 1;
* Ctrl-C exits 130;
* a closed stdout (``freezeframe demo | head -1``) ends the command quietly with 141, the status
  of a command that SIGPIPE ended (what ``seq 100000 | head -1`` leaves in ``PIPESTATUS``).

``freezeframe --debug COMMAND ...`` or ``FREEZEFRAME_DEBUG=1`` prints the traceback above that
line. Any other exception is a bug in freezeframe and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import tempfile
import textwrap
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from freezeframe.errors import ConfigError, FreezeframeError

if TYPE_CHECKING:  # the CLI imports torch and the compile stage only for the commands that run
    from freezeframe.compilation import CompiledModel

__all__ = ["DEBUG_ENV", "SUBCOMMANDS", "build_parser", "int_at_least", "int_list", "main"]

SUBCOMMANDS: list[tuple[str, str]] = [
    ("config", "freezeframe.cli:add_config_parser"),
    ("demo", "freezeframe.cli:add_demo_parser"),
    ("bench", "freezeframe.bench.cli"),
    ("cache", "freezeframe.cache.cli"),
    ("plan", "freezeframe.cli:add_plan_parser"),
]

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE (13), as a shell reports a command a closed pipe ended
DEBUG_ENV = "FREEZEFRAME_DEBUG"
logger = logging.getLogger(__name__)


# -- argument parsing -------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``PROG: error: MESSAGE (see 'PROG --help')``, exit 2."""

    def error(self, message: str) -> Any:  # argparse declares NoReturn
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` accepting an int ``>= minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an int >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse


def int_list(minimum: int = 1) -> Callable[[str], tuple[int, ...]]:
    """An argparse ``type`` for ``"1,2,4"``: at least one int, each ``>= minimum``."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(part) for part in text.split(",") if part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated ints >= {minimum}, got {text!r}") from None
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(
                f"give at least one value, each >= {minimum}; got {text!r}")
        return values

    parse.__name__ = "comma-separated ints"
    return parse


# -- registration -----------------------------------------------------------------------------


def _load_registrar(target: str) -> Callable[[Any], Any] | None:
    module_name, _, func_name = target.partition(":")
    try:
        module: ModuleType = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Only "this command's module is not there (yet)" is tolerated; a missing dependency
        # *inside* an existing module is a real error and propagates.
        if exc.name is not None and module_name.startswith(exc.name):
            return None
        raise
    registrar = getattr(module, func_name or "add_parser", None)
    return registrar if callable(registrar) else None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; with ``only`` set, just that subcommand's module is imported."""
    parser = _Parser(
        prog="freezeframe",
        description="Trace once, split, compile per shape and capture graphs per padded batch "
                    "size, for any nn.Module.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--debug", action="store_true",
                        help=f"print the traceback of an error (or set {DEBUG_ENV}=1)")
    # Subcommand parsers are _Parser too (argparse uses the parent's class).
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, target in SUBCOMMANDS:
        if only is not None and name != only:
            continue
        registrar = _load_registrar(target)
        if registrar is not None:
            registrar(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    try:
        code = _run(argv)
        sys.stdout.flush()  # output still buffered meets a closed pipe here, not at exit
    except BrokenPipeError:
        # The reader went away (``| head``): nothing more can be shown, and that is no error
        # of ours. Pointing stdout at devnull lets the interpreter's final flush of what is
        # still buffered succeed instead of printing a second BrokenPipeError.
        _stdout_to_devnull()
        return EXIT_BROKEN_PIPE
    return code


def _stdout_to_devnull() -> None:
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (replaced, or closed)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def _run(argv: Sequence[str] | None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    names = {name for name, _ in SUBCOMMANDS}
    first = next((a for a in args_list if not a.startswith("-")), None)
    parser = build_parser(only=first if first in names else None)
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # argparse: --help (0) or a one-line usage error (2)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s: %(message)s", stream=sys.stderr)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    debug = args.debug or os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false")
    prog = f"freezeframe {args.command}"
    try:
        return int(func(args) or 0)
    except FreezeframeError as exc:
        code = EXIT_USAGE if isinstance(exc, ConfigError) else EXIT_FAILURE
        if debug:
            traceback.print_exc(file=sys.stderr)
        hint = ("" if debug or code == EXIT_USAGE
                else f" (rerun with freezeframe --debug or {DEBUG_ENV}=1 for the traceback)")
        print(f"{prog}: error: {_one_line(str(exc))}{hint}", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc(file=sys.stderr)
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


# -- freezeframe config -----------------------------------------------------------------------


def add_config_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "config", help="print the resolved compilation config",
        description="Resolve a compilation config (a vLLM compilation-config JSON with the "
                    "fields freezeframe supports is accepted as is) and print what it means.")
    p.add_argument("config", help="a JSON object, '-' to read it from stdin, or @FILE")
    p.add_argument("--json", action="store_true",
                   help="print the resolved config as JSON (with cache_key) instead")
    p.set_defaults(func=run_config)


def _read_config_text(source: str) -> str:
    if source == "-":
        return sys.stdin.read()
    if source.startswith("@"):
        path = Path(source[1:])
        try:
            return path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {str(path)!r} is not UTF-8 text ({exc.reason} at "
                              f"byte {exc.start}); give a JSON file") from None
    return source


def run_config(args: argparse.Namespace) -> int:
    from freezeframe.config import CompilationConfig

    cfg = CompilationConfig.from_json(_read_config_text(args.config))
    if args.json:
        print(json.dumps({**cfg.to_dict(), "cache_key": cfg.cache_key()}, indent=2,
                         sort_keys=True))
    else:
        print(describe_config(cfg))
    return 0


def describe_config(cfg: Any) -> str:
    """A human-readable summary of a resolved :class:`CompilationConfig`."""
    from freezeframe.sizes import padding_intervals

    def wrap(text: str) -> str:
        return textwrap.fill(text, width=96, subsequent_indent=" " * 20)

    graph_mode = cfg.cudagraph_mode
    mode_text = graph_mode.name
    if graph_mode.separate_routine():
        mode_text += (f" (uniform decode: {graph_mode.decode_mode().name}, "
                      f"mixed: {graph_mode.mixed_mode().name})")
    sizes = cfg.cudagraph_capture_sizes
    if sizes:
        size_text = f"{len(sizes)} sizes, max {sizes[-1]}: " + " ".join(map(str, sizes))
        padding_text = (_padding_cells(padding_intervals(sizes))
                        + f"; 0 and above {sizes[-1]}: no graph (unpadded)")
    else:
        size_text = "none (CUDA graphs off)"
        padding_text = "none: every batch runs unpadded without a graph"
    if cfg.splitting_ops is None:
        ops_text = "none given (the graph is not split: one piece)"
    elif not cfg.splitting_ops:
        ops_text = "[] (no split)"
    else:
        ops_text = " ".join(cfg.splitting_ops)
    rows = [
        ("mode", f"{cfg.mode.name} ({int(cfg.mode)})"),
        ("backend", cfg.backend),
        ("splitting_ops", ops_text),
        ("cudagraph_mode", mode_text),
        ("graph_backend", cfg.graph_backend),
        ("capture sizes", size_text),
        ("padding", padding_text),
        ("compile ranges", " ".join(str(r) for r in cfg.compile_ranges())),
        ("compile sizes", " ".join(map(str, cfg.compile_sizes)) or "none"),
        ("batch limits", f"max_num_tokens={cfg.max_num_tokens} max_num_seqs={cfg.max_num_seqs} "
                         f"num_speculative_tokens={cfg.num_speculative_tokens} "
                         f"max_loras={cfg.max_loras}"),
        ("cache key", cfg.cache_key()),
    ]
    return "\n".join(wrap(f"{name:<19} {value}") for name, value in rows)


def _padding_cells(intervals: list[Any]) -> str:
    """``lo..hi->size`` cells; a run of 3+ evenly spaced sizes, each covering exactly its step,
    is folded into ``lo..hi->next multiple of STEP``-style cells to keep 51 sizes readable."""
    cells, i = [], 0
    while i < len(intervals):
        r, size = intervals[i]
        step = r.end - r.start + 1
        j = i
        while (j + 1 < len(intervals) and intervals[j + 1][0].end - intervals[j + 1][0].start
               + 1 == step and intervals[j + 1][1] == intervals[j][1] + step):
            j += 1
        if j - i >= 2:
            last = intervals[j]
            cells.append(f"{r.start}..{last[0].end}->{size},{size + step},..,{last[1]} "
                         f"(every {step})")
            i = j + 1
            continue
        cells.append(f"{r.start}->{size}" if r.is_single_size() else f"{r.start}..{r.end}->{size}")
        i += 1
    return " ".join(cells)


# -- freezeframe demo -------------------------------------------------------------------------


def add_demo_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo", help="compile and run the built-in example model",
        description="Compile the built-in example model (split at freezeframe_example::mix), "
                    "run it for several batch sizes and check the outputs against eager.")
    p.add_argument("--backend", default="eager", choices=["eager", "inductor"],
                   help="compiler for each piece (default: eager)")
    p.add_argument("--layers", type=int_at_least(1), default=2,
                   help="number of layers (default: 2)")
    p.add_argument("--hidden", type=int_at_least(1), default=32,
                   help="hidden size (default: 32)")
    p.add_argument("--sizes", type=int_list(1), default=(1, 2, 3, 8, 17, 64),
                   help="comma-separated batch sizes to run (default: 1,2,3,8,17,64)")
    p.add_argument("--max-num-tokens", type=int_at_least(1), default=256,
                   help="largest batch the config allows (default: 256)")
    p.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    import torch

    import freezeframe as ff
    from freezeframe.models.example import MIX_OP, ExampleMLP

    sizes = list(args.sizes)
    too_big = [s for s in sizes if s > args.max_num_tokens]
    if too_big:
        raise ConfigError(f"--sizes: {too_big} exceed --max-num-tokens={args.max_num_tokens}; "
                          "raise --max-num-tokens or drop them")
    cfg = ff.CompilationConfig(mode="piecewise", backend=args.backend, splitting_ops=[MIX_OP],
                               cudagraph_mode="none", max_num_tokens=args.max_num_tokens)
    module = ExampleMLP(hidden_size=args.hidden, num_layers=args.layers).eval()
    model = ff.compile(module, cfg, dynamic_arg_dims={"x": 0})
    print(f"freezeframe demo: ExampleMLP(hidden={args.hidden}, layers={args.layers}), "
          f"split at {MIX_OP}, compiler {cfg.backend}")

    failures = 0
    with torch.no_grad():
        for i, n in enumerate(sizes):
            x = module.example_input(n)                  # [n, hidden]
            start = time.perf_counter()
            got = model(x)
            elapsed = time.perf_counter() - start
            want = module(x)
            if i == 0:
                print(f"first call (trace + split + compile + run): {elapsed:.3f} s")
                _print_pieces(model)
            ok = got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
            diff = (got - want).abs().max().item() if got.shape == want.shape else float("nan")
            failures += not ok
            print(f"  batch {n:>5}: {'ok  ' if ok else 'FAIL'} max |compiled - eager| = "
                  f"{diff:.2e}  ({elapsed * 1e3:.2f} ms)")
    stats = model.stats.snapshot()
    print("stats: " + " ".join(f"{k}={v}" for k, v in sorted(stats.items())))
    if failures:
        print(f"{failures} of {len(sizes)} batch sizes differ from eager", file=sys.stderr)
        return 1
    print(f"all {len(sizes)} batch sizes match eager")
    return 0


def _print_pieces(model: CompiledModel) -> None:
    pieces = model.pieces
    capturable = sum(1 for p in pieces if p.capturable)
    print(f"pieces: {len(pieces)} ({capturable} capturable)")
    for p in pieces:
        kind = "splitting op (eager)" if p.is_splitting_op else "compiled"
        ops = sum(1 for node in p.graph.graph.nodes
                  if node.op in ("call_function", "call_method", "call_module"))
        print(f"  piece {p.index}: {p.name} {kind}, {ops} ops")


# -- freezeframe plan -------------------------------------------------------------------------


def add_plan_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan", help="choose capture sizes from a histogram of batch sizes",
        description="Choose the capture sizes that minimise the expected padded work of a "
                    "histogram of step sizes within a budget, and compare them with vLLM's "
                    "default ladder. HISTOGRAM is a JSON object of batch size -> step count, "
                    '{"1": 120, "3": 40, ...}, or the same object under a "histogram" key.')
    p.add_argument("histogram", metavar="HISTOGRAM.json", help="the histogram file")
    p.add_argument("--max-sizes", type=int_at_least(1), default=None,
                   help="capture at most N sizes")
    p.add_argument("--budget-mib", type=float, default=None,
                   help="keep the estimated graph memory of the sizes within M MiB")
    p.add_argument("--max-size", type=int_at_least(1), default=None,
                   help="the largest size to capture (default: the largest in the histogram)")
    p.add_argument("--step-times", metavar="FILE", default=None,
                   help="measured step time per size, JSON {size: time} (default: 16 + padded "
                        "tokens); interpolated between the sizes given")
    p.add_argument("--graph-mib", metavar="FILE", default=None,
                   help="measured graph memory per size in MiB, JSON {size: MiB} (default: "
                        "6 MiB + 8 KiB per token)")
    p.add_argument("--out", metavar="CONFIG.json", default=None,
                   help="write the planned sizes as a compilation config")
    p.add_argument("--plot", metavar="PNG", default=None,
                   help="plot the histogram and each ladder's padding (needs matplotlib)")
    p.set_defaults(func=run_plan)


def _read_file(path: str, argument: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{argument}: cannot read {path!r}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{argument}: {path!r} is not UTF-8 text; give a JSON file") from None


def _check_output_file(path: str, flag: str, example: str) -> None:
    """Raise :class:`ConfigError` naming ``flag``, ``path`` and the fix unless a file can be
    written at ``path``: checked before a command's work, not when it writes its result. An
    existing file is opened for appending (nothing is written to it); for a new one, a probe
    file is created and removed next to it."""
    target = Path(path)
    prefix = f"{flag}: cannot write {path!r}"
    if target.is_dir():
        raise ConfigError(f"{prefix}: Is a directory; give a file path such as "
                          f"{str(target / example)!r}")
    parent = target.parent
    if not parent.is_dir():
        blocker = next((p for p in (parent, *parent.parents) if p.exists()), None)
        if blocker is not None and not blocker.is_dir():  # a file where a directory is due
            raise ConfigError(f"{prefix}: Not a directory ({str(blocker)!r} is a file); choose "
                              "a path inside a directory")
        raise ConfigError(f"{prefix}: No such file or directory (directory {str(parent)!r} "
                          "does not exist); create it first or choose another path")
    try:
        if target.exists():
            with target.open("a", encoding="utf-8"):
                pass
        else:
            fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=parent)
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        raise ConfigError(f"{prefix}: {exc.strerror or exc}; choose a writable location") \
            from None


def run_plan(args: argparse.Namespace) -> int:
    from freezeframe import planning

    if args.budget_mib is not None and not args.budget_mib >= 0:
        raise ConfigError(f"--budget-mib: must be a number >= 0, got {args.budget_mib}")
    if args.plot is not None:  # before the work, so a missing matplotlib costs nothing
        try:
            import matplotlib  # noqa: F401
        except ModuleNotFoundError:
            raise ConfigError("--plot: matplotlib is not installed; pip install matplotlib (or "
                              "freezeframe[bench]), or leave out --plot") from None
    for flag, path, example in (("--out", args.out, "config.json"),
                                ("--plot", args.plot, "plan.png")):
        if path is not None:  # before the work, so a bad path does not cost the run
            _check_output_file(path, flag, example)
    histogram = planning.read_histogram(_read_file(args.histogram, "HISTOGRAM"), args.histogram)
    models = {}
    for name, flag in (("step_times", "--step-times"), ("graph_mib", "--graph-mib")):
        path = getattr(args, name)
        if path is not None:
            models[name] = planning.read_size_map(_read_file(path, flag), f"{flag} {path}",
                                                  name, "number")
    cost, memory = models.get("step_times"), models.get("graph_mib")
    plan = planning.plan_capture_sizes(histogram, max_sizes=args.max_sizes,
                                       budget_mib=args.budget_mib, cost=cost, memory=memory,
                                       max_size=args.max_size)
    default = planning.evaluate_ladder(histogram, planning.default_ladder(), cost=cost,
                                       memory=memory)
    limits = [f"<= {args.max_sizes} sizes" if args.max_sizes else "",
              f"<= {args.budget_mib:g} MiB" if args.budget_mib is not None else ""]
    label = "plan" + (f" ({', '.join(x for x in limits if x)})" if any(limits) else "")
    sizes = sorted(s for s, c in histogram.items() if c)
    print(f"{args.histogram}: {plan.steps} steps, {len(sizes)} distinct sizes from {sizes[0]} "
          f"to {sizes[-1]}, {plan.real_tokens / plan.steps:.2f} tokens per step")
    print(format_plan_table([(label, plan), (f"vLLM default (to {default.max_size})", default)],
                            measured=cost is not None))
    print("plan sizes: " + " ".join(map(str, plan.sizes)))
    if args.out is not None:
        try:
            Path(args.out).write_text(json.dumps(plan.config_dict(), indent=2) + "\n",
                                      encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"--out: cannot write {args.out!r}: {exc.strerror}") from None
        print(f"wrote {args.out} (freezeframe config @{args.out} shows what it captures)")
    if args.plot is not None:
        _plot_plan(histogram, [(label, plan), ("vLLM default", default)], args.plot)
        print(f"wrote {args.plot}")
    return 0


def format_plan_table(rows: Sequence[tuple[str, Any]], *, measured: bool = False) -> str:
    """One line per ladder: sizes, padding waste, padded tokens and step cost per step, graph
    memory, steps above the ladder (which run without a graph)."""
    cost_head = "step time/step" if measured else "cost/step"
    header = (f"{'ladder':<28} {'sizes':>5} {'padding waste':>13} {'padded tokens/step':>18} "
              f"{cost_head:>14} {'graph MiB':>9} {'steps without graph':>19}")
    lines = [header]
    for name, plan in rows:
        lines.append(f"{name:<28} {len(plan.sizes):>5} {plan.waste:>13.2%} "
                     f"{plan.expected_padded_tokens:>18.2f} {plan.expected_work:>14.2f} "
                     f"{plan.total_memory_mib:>9.1f} {plan.uncovered_steps:>19}")
    return "\n".join(lines)


def _plot_plan(histogram: dict[int, int], rows: Sequence[tuple[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(s for s, c in histogram.items() if c)
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    top.bar(sizes, [histogram[s] for s in sizes], width=1.0, color="0.6")
    top.set_ylabel("steps")
    top.set_title("observed batch sizes")
    for name, plan in rows:
        padding = []
        for s in sizes:
            rung = next((r for r in plan.sizes if r >= s), s)
            padding.append(rung - s)
        bottom.step(sizes, padding, where="mid",
                    label=f"{name}: {len(plan.sizes)} sizes, {plan.total_memory_mib:.0f} MiB, "
                          f"waste {plan.waste:.2%}")
    bottom.set_xlabel("batch size (tokens)")
    bottom.set_ylabel("padding per step (tokens)")
    bottom.legend()
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as exc:
        raise ConfigError(f"--plot: cannot write {path!r}: {exc.strerror}") from None
    finally:
        plt.close(fig)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
