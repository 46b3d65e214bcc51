"""``hf-ckpt inspect | export | verify | universal`` (also ``python -m hf_ckpt_integrations``).

Each command is ``X_command(args)`` plus ``X_command_parser(subparsers=None)``, so it works
standalone or as a subcommand and tests can call ``parser.parse_args([...])`` directly.
Exit codes: 0 success, 1 verification found a difference, 2 bad input or refused checkpoint
(one ``error:`` line on stderr naming the file and what to do), 3 an internal error (a bug: one
``error:`` line; the traceback only with ``--debug``), 128+N when stopped by signal N (SIGINT,
SIGTERM, SIGHUP) after removing what the export had staged. Every message goes through
:func:`~.errors.one_line`, so a hostile file name cannot break the one-line contract.
"""

import contextlib
import argparse
import json
import os
import signal
import sys
import threading
import traceback
from types import FrameType
from typing import Any, Callable, Dict, Iterable, List, Mapping, NoReturn, Optional, Sequence, Tuple, Union

from ._version import __version__
from .errors import EXIT_BAD_INPUT, EXIT_DIFFERENT, EXIT_INTERNAL, EXIT_OK, CheckpointError, cli_spelling, one_line
from .supported_inputs import SRC_HELP, help_epilog

__all__ = ["main", "build_parser", "inspect_command", "export_command", "verify_command", "universal_command"]

# The subcommands of the top-level parser, which each command's parser is made in (None: standalone).
# (of any ArgumentParser class: build_parser's make _ArgumentParser s)
Subparsers = Optional["argparse._SubParsersAction[Any]"]


class _ArgumentParser(argparse.ArgumentParser):
    """argparse with the package's error contract: one ``error:`` line, exit 2 (no usage block)."""

    commands: Mapping[str, argparse.ArgumentParser]  # the top-level parser's subcommands (build_parser)

    def error(self, message: str) -> NoReturn:
        print(f"error: {one_line(message)} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)

    # (argparse's overloads type a namespace passed in as its own class; this override keeps one signature)
    def parse_args(self, args: Optional[Sequence[str]] = None,  # type: ignore[override]
                   namespace: Optional[argparse.Namespace] = None) -> argparse.Namespace:
        # argparse reports options it does not know on the top-level parser; a user who typed
        # `hf-ckpt export ... --bogus` needs `hf-ckpt export --help`, so the command's parser says it.
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = getattr(self, "commands", {}).get(getattr(parsed, "command", None), self)
            command.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed


def _parser(subparsers: Subparsers, name: str, help_text: str, epilog: Optional[str] = None
            ) -> argparse.ArgumentParser:
    kw: Dict[str, Any] = dict(description=help_text, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    p: argparse.ArgumentParser
    default: Any
    if subparsers is not None:
        p = subparsers.add_parser(name, help=help_text, **kw)
        default = argparse.SUPPRESS  # keep a --debug given before the command
    else:
        p = _ArgumentParser(prog=f"hf-ckpt {name}", **kw)
        default = False
    p.add_argument("--debug", action="store_true", default=default,
                   help="on an internal error (exit 3), print the traceback too")
    return p


def inspect_command_parser(subparsers: Subparsers = None) -> argparse.ArgumentParser:
    p = _parser(subparsers, "inspect", "Describe a checkpoint: engine, stage, world layout, dtypes, tensors, problems.",
                help_epilog())
    p.add_argument("src", help=SRC_HELP)
    p.add_argument("--tag", help="tag to read (default: the one named by 'latest')")
    p.add_argument("--config", metavar="PATH", help=_CONFIG_HELP)
    _source_args(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--universal", action="store_true", help="also show what `hf-ckpt universal` would write from "
                   "it: the optimizer states carried and, per parameter, how its model-parallel slices merge")
    p.set_defaults(func=inspect_command)
    return p


_CONFIG_HELP = ("the model's config.json, or the directory holding it (default: the one next to the checkpoint); "
                "its tokenizer and generation files are copied too")


def _dtype(text: str) -> Optional[str]:
    from .formats.dtypes import from_user, to_user

    try:
        return to_user(from_user(text))
    except CheckpointError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _source_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp-rule", action="append", default=[], metavar="PATTERN=0|1|replicated",
                   help="how to merge model-parallel slices of parameters matching PATTERN (fnmatch) that "
                        "neither the checkpoint nor the HF config describes; repeatable")
    from .sources.registry import declared_options

    declared = declared_options()
    p.add_argument("--source-option", action="append", default=[], metavar="KEY=VALUE", type=_key_value,
                   help="an option a source declares, repeatable; "
                        + ("; ".join(f"{o.name}: {o.help}" for o in declared.values()) or "none declared"))


def _universal_lines(summary: Optional[Mapping[str, Any]]) -> List[str]:
    """``inspect --universal`` in text: the states carried, then how many parameters merge each way."""
    if not summary:
        return []
    params = summary["parameters"]
    merges: Dict[str, int] = {}
    for p in params:
        key = p["merge"] + (f" ({p['rule']})" if p["rule"] and p["merge"] != "one copy" else "")
        merges[key] = merges.get(key, 0) + 1
    return ([f"{len(params)} parameter(s) x fp32 + {', '.join(summary['optimizer_states']) or 'no optimizer state'}"]
            + [f"{n:3d} by {how}" for how, n in sorted(merges.items())])


def _report_json(obj: Any, level: int = 0) -> str:
    """``json.dumps(obj, indent=2)``, except that the items of a list longer than 64 are one compact
    line each: a 45,395-parameter report took seconds in json's pure-Python indenting encoder (the C
    one only writes unindented), and one line per tensor still reads and greps."""
    pad, end = "  " * (level + 1), "  " * level
    if isinstance(obj, dict) and obj and all(type(k) is str for k in obj):
        return "{\n" + ",\n".join(f"{pad}{json.dumps(k)}: {_report_json(v, level + 1)}" for k, v in obj.items()) \
            + f"\n{end}}}"
    if isinstance(obj, list) and len(obj) > 64:
        return "[\n" + ",\n".join(pad + json.dumps(v) for v in obj) + f"\n{end}]"
    return json.dumps(obj, indent=2).replace("\n", "\n" + end)


def _key_value(text: str) -> Tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def _source_options(args: argparse.Namespace) -> Dict[str, Union[str, List[str]]]:
    """``--source-option KEY=VALUE`` pairs as the API takes them: a repeated key gives a list (the
    registry checks each key and value against the sources' declarations)."""
    out: Dict[str, List[str]] = {}
    for key, value in args.source_option:
        out.setdefault(key, []).append(value)
    return {k: v[0] if len(v) == 1 else v for k, v in out.items()}


def inspect_command(args: argparse.Namespace) -> int:
    from .api import inspect_checkpoint

    # What reading imports may print to stdout (DeepSpeed's accelerator banner when transformers 4
    # imports it to build the meta model) goes to stderr: stdout is this report alone (--json parses).
    with contextlib.redirect_stdout(sys.stderr):
        info = inspect_checkpoint(args.src, tag=args.tag, config=args.config, tp_rules=args.tp_rule,
                                  source_options=_source_options(args))
        if args.universal:  # the universal writer's own plan, not a guess from the export's
            from .universal_writer import plan_universal, universal_summary

            plan, states, _ = plan_universal(args.src, tag=args.tag, config=args.config, tp_rules=args.tp_rule)
            info["universal"] = universal_summary(plan, states)
    if args.json:
        print(_report_json(info))
        return EXIT_OK
    stage = f" (ZeRO stage {info['zero_stage']})" if info.get("zero_stage") is not None else ""
    if info.get("optimizer") and info["optimizer"] != "ZeRO":  # DeepSpeed without a ZeRO optimizer
        stage = f" (ZeRO stage {info['zero_stage']}, {info['optimizer']})"
    written = f", written by {info['engine_version']}" if info.get("engine_version") else ""
    print(f"engine      {info['engine']}{stage}{written}")
    print(f"tag         {info['tag']}   source {info['source']}")
    if "dp_size" in info or "mp_size" in info:  # a source's world layout (ExportPlan.detail)
        print(f"world       dp={info.get('dp_size', 1)} mp={info.get('mp_size', 1)} "
              f"(mp axis: {info.get('mp_axis', 'none')})")
    if info.get("mp_axis_reason"):
        print(f"            {info['mp_axis_reason']}")
    merged = [t for t in info["tensors"] if t["rule"]]
    if merged:
        by_rule: Dict[str, List[str]] = {}
        for t in merged:
            by_rule.setdefault(t["rule"], []).append(t["name"])
        for rule, names in by_rule.items():
            print(f"merge       {len(names):3d} tensor(s) by {rule}")
    for line in _conversion_lines(info.get("conversions") or []):
        print(f"hub layout  {line}")
    for name, (before, after) in info["padding_removed"].items():
        print(f"padding     {name}: {before} -> {after} rows")
    print("dtypes      " + ", ".join(f"{k}={v}" for k, v in info["dtypes"].items()))
    print(f"tensors     {info['tensor_count']} ({', '.join(f'{v} {k}' for k, v in info['tensors_by_kind'].items())}), "
          f"{info['parameters']:,} parameters, {info['bytes_fp32']:,} bytes in fp32")
    for line in _kept_fp32_lines(info.get("keep_fp32")):
        print(f"fp32 kept   {line}")
    if info.get("missing_tensors"):
        miss = info["missing_tensors"]
        print(f"missing     {len(miss)} tensor(s) the model has and the checkpoint does not hold: {', '.join(miss[:8])}"
              + (" ..." if len(miss) > 8 else "") + " (export refuses them without --allow-missing)")
    if info["aliases"]:
        print("tied        " + ", ".join(f"{a} -> {t}" for a, t in info["aliases"].items()))
    adapter = info.get("adapter")
    if adapter:
        targets = adapter["target_modules"]
        print(f"adapter     {adapter['peft_type']} r={adapter['r']} alpha={adapter['lora_alpha']}"
              f"{' rslora' if adapter['use_rslora'] else ''} name={adapter['name']}   config {adapter['config']}")
        print(f"targets     {', '.join(targets) if isinstance(targets, list) else targets}"
              + (f"; modules_to_save {', '.join(adapter['modules_to_save'])}" if adapter["modules_to_save"] else ""))
        print(f"base        {adapter['base_model_name_or_path']}")
    else:
        print(f"config      {info['config_dir'] or 'not found (export needs --config PATH, or --weights-only)'}")
    for note in info["notes"]:
        print(f"note        {note}")
    for line in _universal_lines(info.get("universal")):
        print(f"universal   {line}")
    return EXIT_OK


def _kept_fp32_lines(keep: Optional[Mapping[str, Any]]) -> List[str]:
    """The tensors a 16-bit export keeps in fp32, grouped by reason and source (layers read as ``*``)."""
    import re

    if not keep or not keep["tensors"]:
        return []
    groups: Dict[Tuple[str, str, str, str], int] = {}
    for t in keep["tensors"]:
        key = (re.sub(r"\.\d+\.", ".*.", t["name"]), "/".join(t["when"]), t["why"], t["from"])
        groups[key] = groups.get(key, 0) + 1
    return [f"{name} ({n}) in {when}: {why}; from {src}" for (name, when, why, src), n in groups.items()]


def _conversion_lines(conversions: Iterable[Mapping[str, Any]]) -> List[str]:
    """One line per group of like conversions (layer and expert numbers read as ``*``)."""
    import re

    def pattern(name: str) -> str:
        return re.sub(r"\.\d+(?=\.)", ".*", name)

    groups: Dict[Tuple[str, str, Tuple[str, ...]], List[Mapping[str, Any]]] = {}
    for c in conversions:
        into = tuple(dict.fromkeys(pattern(n) for n in c["into"]))
        groups.setdefault((pattern(c["source"]), c["op"], into), []).append(c)
    return [f"{src} -> {', '.join(into)} ({op}; {len(cs)} tensor(s))" for (src, op, into), cs in groups.items()]


def export_command_parser(subparsers: Subparsers = None) -> argparse.ArgumentParser:
    p = _parser(subparsers, "export", "Write a checkpoint as a HuggingFace directory that from_pretrained loads.",
                help_epilog())
    p.add_argument("src", help=SRC_HELP)
    p.add_argument("dst", help="output directory (must not exist unless --overwrite)")
    p.add_argument("--tag", help="tag to read (default: the one named by 'latest')")
    p.add_argument("--dtype", type=_dtype, metavar="{fp32,bf16,fp16}",
                   help="output dtype of floating tensors, also by torch's names (float32, float, bfloat16, "
                        "float16, half) (default: fp32 masters when the checkpoint has them)")
    p.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help="largest shard: 5GB, 500MB, 5GiB (what save_pretrained takes) or a byte count, 5000000 "
                        "(default: the installed transformers' save_pretrained default, read from its signature: "
                        "50GB on transformers 5, 5GB on 4.x)")
    p.add_argument("--config", metavar="PATH", help=_CONFIG_HELP)
    p.add_argument("--weights-only", action="store_true",
                   help="write the weights without a config.json when none is found (from_pretrained cannot load "
                        "the result until one is added); without it, no config is an error")
    _source_args(p)
    p.add_argument("--overwrite", action="store_true", help="replace dst if it exists (atomically)")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="write N shards at once from threads in this process (default 1); under torchrun "
                        "the ranks split the shards instead")
    p.add_argument("--merge-adapters", action="store_true",
                   help="a PEFT (LoRA) checkpoint: write the base model with the adapter merged in, instead of "
                        "the adapter directory")
    p.add_argument("--base", metavar="DIR", help="with --merge-adapters: the base model's directory (default: "
                   "adapter_config.json's base_model_name_or_path when it is a local directory)")
    p.add_argument("--allow-missing", action="store_true",
                   help="export even when the model has tensors the checkpoint does not hold (inspect lists them: "
                        "a save with exclude_frozen_parameters=True); from_pretrained initialises them")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no summary")
    p.set_defaults(func=export_command)
    return p


def export_command(args: argparse.Namespace) -> int:
    import time

    from .api import export_checkpoint

    started = time.perf_counter()  # the summary's time is the command's: planning (a first run fills
    # the Hub-layout cache) as well as writing
    # Under `torchrun --nproc_per_node N -m hf_ckpt_integrations export ...` the ranks split the shards.
    report = export_checkpoint(args.src, args.dst, tag=args.tag, dtype=args.dtype, max_shard_size=args.max_shard_size,
                               config=args.config, overwrite=args.overwrite, quiet=args.quiet, tp_rules=args.tp_rule,
                               workers=args.workers, merge_adapters=args.merge_adapters, base=args.base,
                               source_options=_source_options(args), allow_missing=args.allow_missing,
                               weights_only=args.weights_only)
    if os.environ.get("RANK", "0") != "0":
        return EXIT_OK
    for note in [n for n in report.get("notes", []) if "config.json" in n] + report.get("warnings", []):
        print(f"warning: {one_line(note)}", file=sys.stderr)
    if not args.quiet:
        print(f"wrote {report['destination']}: {report['shards']} shard(s), {report['tensor_bytes']:,} tensor bytes, "
              f"{report['bytes_on_disk']:,} bytes on disk, {_seconds(time.perf_counter() - started, report)}")
    return EXIT_OK


def _seconds(total: float, report: Mapping[str, Any]) -> str:
    """The command's wall time, and the write's share when reading the plan took a visible part."""
    write = report.get("seconds")
    if write is None or total - write < 0.5:
        return f"{total:.2f} s"
    return f"{total:.2f} s ({total - write:.2f} s planning, {write:.2f} s writing)"


def verify_command_parser(subparsers: Subparsers = None) -> argparse.ArgumentParser:
    p = _parser(subparsers, "verify", "Compare an exported directory with its source, every tensor bitwise.")
    p.add_argument("dst", help="the exported HuggingFace directory")
    p.add_argument("--against", required=True, metavar="SRC", help="the source checkpoint it was exported from")
    p.add_argument("--tag", help="tag of the source (default: the one named by 'latest')")
    p.add_argument("--config", metavar="PATH", help="the model's config.json or its directory (default: next to the "
                   "source; for a pipeline save that keeps none there, DST's own config.json)")
    _source_args(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=verify_command)
    return p


def verify_command(args: argparse.Namespace) -> int:
    from .api import verify_checkpoint

    report = verify_checkpoint(args.dst, args.against, tag=args.tag, config=args.config, tp_rules=args.tp_rule,
                               source_options=_source_options(args), quiet=args.quiet)
    if report.ok:
        print(f"ok: {report.checked} tensors bitwise equal to {args.against}")
        return EXIT_OK
    for line in report.differences:
        print(f"differs: {one_line(line)}")
    print(f"{len(report.differences)} of {report.checked} tensors differ", file=sys.stderr)
    return EXIT_DIFFERENT


def universal_command_parser(subparsers: Subparsers = None) -> argparse.ArgumentParser:
    p = _parser(subparsers, "universal", "Write a DeepSpeed universal checkpoint of a ZeRO or PipelineModule save, to resume "
                "training at another tensor/pipeline/data-parallel size. Load it with \"checkpoint\": {\"load_universal\": true} in the "
                "DeepSpeed config and engine.load_checkpoint(PARENT, tag=NAME), where DST is PARENT/NAME.")
    p.add_argument("src", help="DeepSpeed save dir, tag dir, or Trainer checkpoint-N dir (ZeRO-1/2/3, or a "
                   "PipelineModule's: its parameters keep the module's own names)")
    p.add_argument("dst", help="new directory to write (the tag directory DeepSpeed loads; never inside SRC; never "
                   "replaced: universal has no --overwrite, remove an old one yourself)")
    p.add_argument("--tag", help="tag to read (default: the one named by 'latest')")
    p.add_argument("--config", metavar="PATH", help="the model's config.json or its directory, whose HF tp plan "
                   "(a pipeline save: the name map of its model_type) tells how tensor-parallel slices merge "
                   "(default: next to the checkpoint)")
    p.add_argument("--tp-rule", action="append", default=[], metavar="PATTERN=0|1|replicated",
                   help="how to merge model-parallel slices of parameters matching PATTERN (fnmatch) that "
                        "neither the checkpoint nor the HF config describes; repeatable")
    p.add_argument("--dry-run", action="store_true", help="write nothing: print as JSON what would be written, "
                   "per parameter its full shape, how its model-parallel slices merge (rule and where it came from) "
                   "and which states")
    p.add_argument("--quiet", action="store_true", help="no progress bar, no summary")
    p.set_defaults(func=universal_command)
    return p


def universal_command(args: argparse.Namespace) -> int:
    from .universal_writer import plan_universal, universal_summary, write_universal_checkpoint

    if args.dry_run:
        with contextlib.redirect_stdout(sys.stderr):
            plan, states, _ = plan_universal(args.src, tag=args.tag, config=args.config, tp_rules=args.tp_rule)
        print(_report_json({**plan.summary(), "universal": universal_summary(plan, states)}))
        return EXIT_OK
    with contextlib.redirect_stdout(sys.stderr):  # what importing engines prints never mixes with the summary
        report = write_universal_checkpoint(args.src, args.dst, tag=args.tag, config=args.config,
                                            tp_rules=args.tp_rule, quiet=args.quiet)
    for note in report.get("notes", []):
        print(f"warning: {one_line(note)}", file=sys.stderr)
    if not args.quiet:
        print(f"wrote {report['destination']}: {report['parameters']} parameters x {', '.join(report['states'])}, "
              f"{report['files']} files, {report['bytes']:,} bytes, {report['seconds']} s; resume with "
              f"{report['load']}")
    return EXIT_OK


def build_parser() -> _ArgumentParser:
    parser = _ArgumentParser(prog="hf-ckpt", description="Make distributed training checkpoints "
                             "loadable with from_pretrained: inspect, export, verify; resumable at another layout: universal.")
    parser.add_argument("--debug", action="store_true", help="on an internal error (exit 3), print the traceback too")
    parser.add_argument("--version", action="version", version=f"hf-ckpt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{inspect,export,verify,universal}")
    inspect_command_parser(sub)
    export_command_parser(sub)
    verify_command_parser(sub)
    universal_command_parser(sub)
    parser.commands = sub.choices  # the unknown-option error names the command's --help
    return parser


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP (what a scheduler or a closed terminal sends), raised where the program
    is, so the commit strategy on the way out removes what it staged, as for Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop(signum: int, frame: Optional[FrameType]) -> NoReturn:
    for s in _STOP_SIGNALS:  # a second signal must not cut the cleanup short
        signal.signal(s, signal.SIG_IGN)
    raise Stopped(signum)


_STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))
# What signal.signal returns: the handler before (a function, SIG_DFL/SIG_IGN, or None when not set from Python).
_Handler = Union[Callable[[int, Optional[FrameType]], Any], int, None]


def _error(message: object) -> None:
    print(f"error: {one_line(message)}", file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:  # `hf-ckpt` alone: nothing was asked, so nothing failed
        parser.print_help()
        return EXIT_OK
    previous: Dict[int, _Handler] = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, _stop) for s in _STOP_SIGNALS}
    try:
        with cli_spelling():  # messages name options as flags (--overwrite), not keywords (overwrite=True)
            return args.func(args)
    except CheckpointError as e:
        if getattr(args, "debug", False):
            traceback.print_exc()
        _error(e)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
        _error(f"stopped by {signal.Signals(signum).name}; no partial export and no temporary directory were left")
        return 128 + signum
    except OSError as e:  # the machine, not the package: a path, a permission, a device
        _error(f"{e.filename or ''}{': ' if e.filename else ''}{e.strerror or e}; check the path, permissions "
               "and free space")
        return EXIT_BAD_INPUT
    except Exception as e:
        if getattr(args, "debug", False):
            traceback.print_exc()
        _error(f"internal error ({type(e).__name__}: {str(e)[:300]}); this is a bug in hf-ckpt: please report it "
               "with the command" + ("" if getattr(args, "debug", False) else " and the output of the same command "
                                     "with --debug"))
        return EXIT_INTERNAL
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    sys.exit(main())
