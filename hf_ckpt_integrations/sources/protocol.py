"""What a source is (:class:`Source`), what it is handed (:class:`PlanContext`), what it may ask for
(:class:`SourceOption`), and the check the registry runs on each source it registers
(:func:`check_source`).

Call order (one export, one process; under ``torchrun`` or in a save-time hook rank 0 plans and
broadcasts the plan):

1. the registry asks each registered source, in order, ``detect(path, tag)`` (names only, never a
   pickle); the first that says yes — unless a source named in its ``YIELDS_TO`` holds a complete
   checkpoint there (``holds_checkpoint(path)``) — claims the path, finally;
2. the registry builds one :class:`PlanContext`: the path, the tag, the requested dtype, the
   options the source declared (checked, defaults filled in), and the config directory found
   through ``config_candidates(path, tag)`` (or ``--config``), whose ``config.json`` is read and
   validated once, on first use (:attr:`PlanContext.config`);
3. ``plan(ctx)`` returns an :class:`~..plan.ExportPlan` from metadata only;
4. the shared passes run on that plan with the same context (docs/architecture.md).
"""

import inspect
from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple,
                    runtime_checkable)

from ..errors import OptionError

if TYPE_CHECKING:
    from ..plan import ExportPlan

__all__ = ["SourceOption", "PlanContext", "Source", "SourceBase", "hook", "SourceProtocolError", "check_source",
           "parse_options", "tie_word_embeddings"]


@dataclass(frozen=True)
class SourceOption:
    """An option a source takes (a name map, a pipeline layout, TP merge rules), declared in the
    source's module as ``OPTIONS = (SourceOption(...), ...)``. The CLI passes it as
    ``--source-option NAME=VALUE`` and the API as ``source_options={NAME: VALUE}``; neither names it.

    ``parse(value)`` turns one given value (a string from the CLI) into what the source reads, raising
    ``ValueError`` (or ``TypeError``) with the reason for a bad one. ``repeated``: the option may be
    given several times; the source then receives a list. ``default``: what the source receives
    when the option is not given (a list is copied per export)."""

    name: str
    help: str
    parse: Callable[[Any], Any] = str
    repeated: bool = False
    default: Any = None


@runtime_checkable
class Source(Protocol):
    """A source: one module of ``sources/`` knowing one engine's on-disk layout.

    The members below are required; the optional hooks, and their defaults, are :class:`SourceBase`'s
    (read them through :func:`hook`). ``detect`` and ``config_candidates`` read names only (never a
    pickle) and answer on any path: a missing one, an empty directory or a file claims nothing
    (tests/sources/test_source_conformance.py runs every registered source through that)."""

    # Read-only members (properties here, plain module constants in a source): a module's ``OPTIONS = ()``
    # is then a ``Tuple[SourceOption, ...]`` to the type checker.
    @property
    def NAME(self) -> str: ...  # the engine name plans carry

    @property
    def LOOKS_FOR(self) -> str: ...  # what it recognises, in words (listed when no source claims a path)

    @property
    def MEMORY_NAMES(self) -> bool: ...  # its names are the model's in-memory ones: tied/Hub-layout passes apply

    @property
    def OPTIONS(self) -> Tuple[SourceOption, ...]: ...  # the options it takes

    def detect(self, path: str, tag: Optional[str]) -> bool: ...

    def config_candidates(self, path: str, tag: Optional[str]) -> List[str]: ...

    def plan(self, ctx: "PlanContext") -> "ExportPlan": ...


class SourceBase:
    """The optional hooks of a source and their defaults: what the registry and the later stages get
    from :func:`hook` when a source module does not define one. A source overrides a hook by defining
    the same name in its module; no module outside ``sources/`` asks which source it holds — it asks
    the hook.

    - ``ALLOWED``: the pickle allowlist its files are read with (module name -> {global name: inert
      stand-in}), handed to :func:`~..formats.torch_files.load`; default none.
    - ``TIED_UNDER_BOTH_NAMES``: its state dicts hold a tied weight under both names (the tied-weight
      pass drops the alias); default False.
    - ``YIELDS_TO``: names of sources whose complete checkpoint in the same directory comes first.
    - ``holds_checkpoint(path)``: a complete checkpoint of this kind resolves at ``path`` without a
      tag (what another source's ``YIELDS_TO`` asks); default False.
    - ``needs_config(path, tag)``: its plan cannot be made without the model's config.json (names or
      shapes come from it); ``verify`` then takes the config the export wrote into DST when none is
      beside the source. Default False.
    - ``check_integrity(ranges)``: ``ranges`` maps each file a plan reads to its ``(offset, nbytes)``
      ranges; returns, for the files this source checked itself, the problems found (full sentences,
      ``[]`` for a sound file). Files no source checks get the torch zip CRC-32 check
      (:func:`~.registry.integrity_problems`). Default: checks none (``{}``).
    - ``UNIVERSAL``: a DeepSpeed universal checkpoint can be written from its saves; it then defines
      ``universal_plan(ctx)`` (the plan under the names DeepSpeed's loader looks up) and
      ``universal_files(tag_dir) -> (optim, first_model_states_path)`` (``optim[mp][dp]``: the
      optimizer partition files, empty without ZeRO). Default False.
    """

    ALLOWED: Dict[str, Dict[str, Any]] = {}
    TIED_UNDER_BOTH_NAMES: bool = False
    YIELDS_TO: Tuple[str, ...] = ()
    UNIVERSAL: bool = False

    @staticmethod
    def holds_checkpoint(path: str) -> bool:
        return False

    @staticmethod
    def needs_config(path: str, tag: Optional[str] = None) -> bool:
        return False

    @staticmethod
    def check_integrity(ranges: Mapping[str, Sequence[Tuple[int, int]]]) -> Dict[str, List[str]]:
        return {}


_HOOKS = ("ALLOWED", "TIED_UNDER_BOTH_NAMES", "YIELDS_TO", "UNIVERSAL", "holds_checkpoint", "needs_config",
          "check_integrity")


def hook(source: object, name: str) -> Any:
    """``source``'s own ``name`` (an optional hook or attribute of :class:`SourceBase`), else its default."""
    if name not in _HOOKS:
        raise AttributeError(f"{name!r} is not an optional source hook (one of {', '.join(_HOOKS)})")
    return getattr(source, name, getattr(SourceBase, name))


class SourceProtocolError(TypeError):
    """A module registered as a source that does not follow :class:`Source` (a bug in the package
    or in an extension, never bad input)."""


def _positional_arity(fn: Callable[..., Any]) -> Optional[Tuple[int, int]]:
    """(required, most) positional arguments ``fn`` takes; None when it cannot be inspected."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(p.default is p.empty for p in positional)
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return required, 1 << 30
    if any(p.kind is p.KEYWORD_ONLY and p.default is p.empty for p in params):
        return required, -1  # a required keyword-only argument: never callable as the registry calls it
    return required, len(positional)


def check_source(source: Any, registered: Sequence[object] = (), everyone: Sequence[object] = ()) -> None:
    """Raise :class:`SourceProtocolError` saying what is missing or wrong unless ``source`` follows
    :class:`Source`. ``registered``: the sources accepted before it (names must be unique);
    ``everyone``: all the sources being registered (``YIELDS_TO`` must name one of them)."""
    who = getattr(source, "__name__", None) or repr(source)
    problems = []
    for attr in ("NAME", "LOOKS_FOR"):
        value = getattr(source, attr, None)
        if not isinstance(value, str) or not value.strip():
            problems.append(f"{attr} must be a non-empty string (got {value!r})")
    if not isinstance(getattr(source, "MEMORY_NAMES", None), bool):
        problems.append("MEMORY_NAMES must be True or False")
    if not isinstance(getattr(source, "TIED_UNDER_BOTH_NAMES", False), bool):
        problems.append("TIED_UNDER_BOTH_NAMES, when given, must be True or False")
    allowed = getattr(source, "ALLOWED", {})
    if not isinstance(allowed, dict) or not all(isinstance(m, str) and isinstance(g, dict) and
                                                all(isinstance(n, str) for n in g) for m, g in allowed.items()):
        problems.append("ALLOWED, when given, must map module names to {global name: stand-in}")
    options = getattr(source, "OPTIONS", None)
    if not isinstance(options, tuple) or not all(isinstance(o, SourceOption) for o in options):
        problems.append("OPTIONS must be a tuple of SourceOption (() for none)")
    else:
        names = [o.name for o in options]
        if len(set(names)) != len(names) or not all(n.isidentifier() for n in names):
            problems.append(f"OPTIONS names must be unique identifiers (got {names})")
    hooks = [("detect", 2), ("config_candidates", 2), ("plan", 1)]
    hooks += [(name, want) for name, want in (("needs_config", 2), ("holds_checkpoint", 1), ("check_integrity", 1))
              if hasattr(source, name)]
    universal = getattr(source, "UNIVERSAL", False)
    if not isinstance(universal, bool):
        problems.append("UNIVERSAL, when given, must be True or False")
    elif universal:
        hooks += [("universal_plan", 1), ("universal_files", 1)]
    for attr, want in hooks:
        fn = getattr(source, attr, None)
        arity = _positional_arity(fn) if callable(fn) else None
        if not callable(fn):
            problems.append(f"{attr}() is missing")
        elif arity is not None and not arity[0] <= want <= arity[1]:
            shown = ("(path, tag)" if want == 2 else "(ctx: PlanContext)" if attr.endswith("plan") else
                     "(path)" if attr == "holds_checkpoint" else "(tag_dir)" if attr == "universal_files" else "(ranges)")
            problems.append(f"{attr}() must be callable as {attr}{shown}")
    plan_fn: Any = getattr(source, "plan", None)  # inspected: a missing one is reported above
    try:
        keywords = [p.name for p in inspect.signature(plan_fn).parameters.values() if p.kind is p.KEYWORD_ONLY]
    except (TypeError, ValueError):
        keywords = []
    if keywords:
        problems.append(f"plan() takes the PlanContext only (it has keyword-only {keywords}): declare options in "
                        "OPTIONS and read them from ctx.options")
    yields = getattr(source, "YIELDS_TO", ())
    holders = {getattr(s, "NAME", None) for s in everyone
               if s is not source and callable(getattr(s, "holds_checkpoint", None))}
    if not isinstance(yields, tuple) or not set(yields) <= holders:
        problems.append(f"YIELDS_TO must be a tuple of names of other registered sources that have "
                        f"holds_checkpoint(path) (got {yields!r})")
    if getattr(source, "NAME", None) in {getattr(s, "NAME", None) for s in registered}:
        problems.append(f"NAME {source.NAME!r} is already registered")
    if problems:
        raise SourceProtocolError(f"source {who} does not follow the source protocol "
                                  f"(hf_ckpt_integrations.sources.protocol.Source): " + "; ".join(problems))


def parse_options(given: Optional[Mapping[str, Any]], declared: Mapping[str, SourceOption]) -> Dict[str, Any]:
    """``given`` (option name -> a value or, for a repeated option, a list of values) checked against
    ``declared`` and parsed; raises :class:`~..errors.OptionError` naming the option and the fix."""
    out = {}
    for name, value in (given or {}).items():
        opt = declared.get(name)
        if opt is None:
            known = ", ".join(sorted(declared)) or "none"
            raise OptionError(f"--source-option {name}: no source takes this option (options: {known})")
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if len(values) != 1 and not opt.repeated:
            raise OptionError(f"--source-option {name}: given {len(values)} times; it takes one value")
        try:
            parsed = [opt.parse(v) for v in values]
        except (ValueError, TypeError) as e:
            raise OptionError(f"--source-option {name}: {e}") from None
        out[name] = parsed if opt.repeated else parsed[0]
    return out


@dataclass
class PlanContext:
    """What a source's ``plan`` and the shared passes are handed: ``path`` and ``tag`` as given,
    the requested ``dtype`` (a user name, or None), the ``options`` the source declared (parsed,
    defaults filled in), and ``config_dir`` (the model's config directory, or None). ``config``
    is its ``config.json``, read and validated (:func:`~..guards.read_config`) once, on first use."""

    path: str
    tag: Optional[str] = None
    dtype: Optional[str] = None
    options: Dict[str, Any] = field(default_factory=dict)
    config_dir: Optional[str] = None
    _config: Optional[dict] = field(default=None, repr=False)
    # What a plan read that a later step of the same call would read again (the universal writer:
    # the rank files and the first model-states file); None: keep nothing (a plain plan).
    reads: Optional[Dict[str, Any]] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # One place refuses an unknown dtype (OptionError), before any source reads a file.
        from ..formats.dtypes import from_user

        from_user(self.dtype)

    def option(self, name: str, default: Any = None) -> Any:
        """The value of option ``name`` (``default`` when the source declared no such option)."""
        return self.options.get(name, default)

    @property
    def config(self) -> dict:
        """``config_dir/config.json`` as a dict (``{}`` without a config directory)."""
        if self.config_dir is None:
            return {}
        if self._config is None:
            from ..guards import read_config

            self._config = read_config(self.config_dir)
        return self._config

    @property
    def tie_word_embeddings(self) -> Any:
        """The config's ``tie_word_embeddings`` (:func:`tie_word_embeddings`)."""
        return tie_word_embeddings(self.config)


# The names under which PreTrainedConfig.get_text_config(decoder=True) finds the text decoder's config.
_TEXT_CONFIG_NAMES = ("decoder", "generator", "text_config")


def tie_word_embeddings(cfg: Mapping[str, Any]) -> Any:
    """``tie_word_embeddings`` of a config.json dict, as recorded (the callers decide what a value
    other than True/False means), read as transformers reads it: the value at top level when the
    file records one (transformers 5 keeps it there, forwarding a pre-5 value from
    ``text_config``), else that of the text decoder's config — the one sub-config
    ``PreTrainedConfig.get_text_config(decoder=True)`` returns (``decoder``, ``generator`` or
    ``text_config``) — else True (``PretrainedConfig``'s default)."""
    if "tie_word_embeddings" in cfg:
        return cfg["tie_word_embeddings"]
    subs = [cfg[n] for n in _TEXT_CONFIG_NAMES if isinstance(cfg.get(n), dict)]
    if len(subs) == 1:  # several: get_text_config refuses to choose; neither do we
        return subs[0].get("tie_word_embeddings", True)
    return True
