"""The `treespec` command.

    treespec decode [--model DIR] [--draft-model DIR] [--prompt ...] [flags]   generate (treespec_jax.decode_cli)
    treespec run CONFIG.toml [--out DIR]                 an experiment or a sweep (treespec_jax.experiment)
    treespec check-config [--config FILE.toml] [flags]   resolved config, or every refusal (exit 2)
    treespec demo [args]                                 runs treespec_jax.demo.main(args)

Config flags keep SGLang's spelling and are generated from the config dataclasses' field metadata
(`treespec_jax.config.opt`), so a new field gets its flag without touching this file. Flags
override values from `--config`; `decode` reuses `add_config_flags` and `config_from_args`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import tomllib
import typing
from collections.abc import Sequence
from pathlib import Path

from treespec_jax.config import SECTIONS, ConfigError, ServeConfig, base_type, to_toml

EXIT_REFUSED = 2  # also argparse's exit status for a malformed command line


def _flag_fields() -> list[tuple[str | None, dataclasses.Field, typing.Any]]:
    """(section or None for top level, field, annotation) for every field that has a flag."""
    out = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        out.extend((section, f, hints[f.name]) for f in dataclasses.fields(cls) if f.metadata.get("flag"))
    hints = typing.get_type_hints(ServeConfig)
    out.extend((None, f, hints[f.name]) for f in dataclasses.fields(ServeConfig) if f.metadata.get("flag"))
    return out


def flag_dest(section: str | None, name: str) -> str:
    """The argparse dest of a config field's flag (for callers that set their own defaults)."""
    return f"cfg__{section or ''}__{name}"


def _value_of(kind: type, optional: bool):
    """Parses a flag's text as `kind` ("none" leaves an optional field unset). Text that does not
    parse is passed on as it is, for `ServeConfig.from_dict` to name with every other bad value:
    argparse would stop at the first."""

    def parse(text: str):
        if optional and text.lower() == "none":
            return None
        try:
            return kind(text)
        except ValueError:
            return text

    parse.__name__ = kind.__name__
    return parse


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """Adds `--config` and one flag per config field; unset flags leave the TOML/default value."""
    parser.add_argument("--config", type=Path, metavar="FILE.toml",
                        help="TOML config file; flags given here override its values")
    for section, f, annotation in _flag_fields():
        kind, optional = base_type(annotation)
        where = f"{section}.{f.name}" if section else f.name
        doc = f"{f.metadata['doc']} [{where}, default {f.default!r}]"
        common = dict(dest=flag_dest(section, f.name), default=argparse.SUPPRESS, help=doc)
        if kind is bool:
            parser.add_argument(f.metadata["flag"], action=argparse.BooleanOptionalAction, **common)
        else:
            # Choices are checked with the config's other rules (`ServeConfig.problems`), not by
            # argparse, which would stop at the first bad flag: a refusal lists every problem.
            choices = f.metadata.get("choices")
            parser.add_argument(
                f.metadata["flag"],
                type=_value_of(kind, optional),
                metavar="{" + ",".join(map(str, choices)) + "}" if choices else kind.__name__.upper(),
                **common,
            )
    parser.add_argument("--random-seed", dest=flag_dest(None, "seed"), type=int, default=argparse.SUPPRESS, metavar="INT",
                        help="alias of --seed")


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """TOML file (if any) with flag overrides applied; not yet validated."""
    data: dict[str, typing.Any] = {}
    source = "flags"
    if args.config is not None:
        source = str(args.config)
        try:
            with args.config.open("rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError([f"config file {source!r} does not exist"]) from None
        except tomllib.TOMLDecodeError as err:
            raise ConfigError([f"{source}: not valid TOML: {err}"]) from None
    for section, f, _ in _flag_fields():
        dest = flag_dest(section, f.name)
        if not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        table = data if section is None else data.setdefault(section, {})
        if not isinstance(table, dict):
            continue  # a malformed table; from_dict names it
        if value is None:
            table.pop(f.name, None)  # omitted means None for optional fields
        else:
            table[f.name] = value
    return ServeConfig.from_dict(data, source=source)


def describe(cfg: ServeConfig) -> str:
    """One-line summary of what the run does."""
    sp = cfg.speculative
    if not sp.enabled:
        return "plain decoding (no speculation)"
    shape = f"K={sp.topk} S={sp.steps} N={sp.verify_tokens}"
    if sp.topk == 1:
        return f"{sp.algorithm} chain, {shape}"
    return (f"{sp.algorithm} draft tree, {shape}: {sp.max_tree_nodes - 1} candidates per round, "
            f"{sp.lane_slots} draft-lane slots")


def _check_config(args: argparse.Namespace) -> int:
    from treespec_jax.support import check_startup

    try:
        cfg = config_from_args(args)
        resolved = check_startup(cfg)
    except ConfigError as err:
        print(f"treespec check-config: refused, {len(err.problems)} problem(s):", file=sys.stderr)
        for problem in err.problems:
            print(f"  - {problem}", file=sys.stderr)
        return EXIT_REFUSED
    print(f"# configuration accepted: {describe(cfg)}")
    if resolved.tree:
        print(f"# tree support: {len(resolved.verify_paths)} target and {len(resolved.lanes_paths)} "
              f"drafter backend nodes asked, no blocker")
    print(to_toml(cfg), end="")
    return 0


def _demo(argv: Sequence[str]) -> int:
    # Imported here so the CLI works (and check-config runs) without the demo's dependencies.
    try:
        demo = importlib.import_module("treespec_jax.demo")
    except ModuleNotFoundError as err:
        if err.name != "treespec_jax.demo":
            raise  # a dependency of the demo is missing: show the real error
        print("treespec demo: this build has no treespec_jax.demo module", file=sys.stderr)
        return EXIT_REFUSED
    code = demo.main(list(argv))
    return 0 if code is None else int(code)


def build_parser() -> argparse.ArgumentParser:
    from treespec_jax import __version__

    parser = argparse.ArgumentParser(prog="treespec", description="draft-tree speculative decoding in JAX")
    parser.add_argument("--version", action="version", version=f"treespec-jax {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    check = sub.add_parser("check-config", help="validate a configuration; exit 2 listing every refusal")
    add_config_flags(check)
    sub.add_parser("demo", help="tree speculation vs plain decoding on a small model", add_help=False)
    from treespec_jax.decode_cli import add_decode_parser
    from treespec_jax.experiment import add_run_parser

    add_decode_parser(sub)
    add_run_parser(sub)
    return parser


def use_compile_cache() -> str | None:
    """Turns on JAX's persistent compilation cache for `decode` and `run`, so a second run reuses
    the programs the first compiled (a GPU engine compiles for tens of seconds). Where: the
    directory JAX_COMPILATION_CACHE_DIR names if set (the user's own cache wins), else
    $TREESPEC_COMPILE_CACHE, else `xla/` under the model cache (`models.default.resolve_cache_dir`);
    TREESPEC_COMPILE_CACHE=off leaves it off. Returns the directory in use, or None."""
    import os

    import jax

    from treespec_jax.models.default import resolve_cache_dir

    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]  # JAX reads it itself
    where = os.environ.get("TREESPEC_COMPILE_CACHE", "")
    if where.lower() == "off":
        return None
    where = where or str(resolve_cache_dir() / "xla")
    jax.config.update("jax_compilation_cache_dir", where)
    return where


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        return _demo(argv[1:])  # the demo parses its own arguments
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse reports bad flags itself, with status 2
        return int(exit_.code or 0)
    if args.command == "check-config":
        return _check_config(args)
    if args.command == "decode":
        from treespec_jax.decode_cli import run_decode

        use_compile_cache()
        return run_decode(args)
    if args.command == "run":
        from treespec_jax.experiment import run_experiment

        use_compile_cache()
        return run_experiment(args)
    parser.print_help(sys.stderr)
    return EXIT_REFUSED


if __name__ == "__main__":
    sys.exit(main())
