"""Checks at the trust boundary: which small files a source may read, which files an export may
copy, and which destinations an export may replace (docs/reliability.md, "Trust at the front door").

A checkpoint directory is input from whoever made it (a download, an archive, a shared disk): a
``latest`` or ``tokenizer.json`` may be a symbolic link to any file of this machine, a ``config.json``
may hold any JSON value, and a destination typed by a user may be the source itself. Every rule
here refuses (:class:`~.errors.CheckpointError`, exit 2) or skips; none reads more than it needs.
"""

import json
import os
import re
import stat
from contextlib import contextmanager
from typing import Any, BinaryIO, Iterable, Iterator, MutableMapping, Optional, Protocol, Sequence, Tuple, Union

from .errors import CheckpointError, DestinationError, LayoutError, OptionError, one_line, short_repr

# A path as callers hand it over (``str`` or ``pathlib.Path``): everything here takes it through os.fspath.
StrPath = Union[str, "os.PathLike[str]"]


class _Plan(Protocol):
    """What :func:`plan_paths` reads of an :class:`~.plan.ExportPlan` (plan.py imports from below
    guards, so it is named by shape: its files, and tensors with their piece groups)."""
    @property
    def files(self) -> Sequence[str]: ...
    @property
    def tensors(self) -> Sequence[Any]: ...

__all__ = ["open_regular", "check_inside", "source_root", "plan_paths", "read_small_text", "read_latest", "check_tag_name", "config_problem", "read_config", "copyable_problem",
           "check_destination", "is_or_holds", "bad_metadata_as_input", "refuse_unreadable_layouts", "claim_file", "LATEST_LIMIT", "CONFIG_LIMIT",
           "dims"]

LATEST_LIMIT = 4096  # DeepSpeed writes the tag name alone ("global_step1000")
CONFIG_LIMIT = 16 * 2**20  # config.json; a real one is a few KB
_TAG_SHOWN = 64  # at most this much of a tag name is ever quoted back


def read_small_text(path: StrPath, *, limit: int, what: str) -> str:
    """The UTF-8 text of ``path``, which must be a regular file (not a link, FIFO or device) of at
    most ``limit`` bytes. Never quotes the content in an error."""
    path = os.fspath(path)
    try:
        st = os.lstat(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read {what} ({e.strerror}); check the path and permissions") from None
    if stat.S_ISLNK(st.st_mode):
        raise CheckpointError(f"{path}: {what} is a symbolic link; it must be a regular file of the checkpoint "
                              "(a link can point at any file of this machine): replace it with the file itself")
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: {what} is not a regular file; replace it with the file the engine wrote")
    if st.st_size > limit:
        raise CheckpointError(f"{path}: {what} is {st.st_size:,} bytes, more than the {limit:,} it can be; "
                              "the file is not what the engine wrote: replace it")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as fh:
            raw = fh.read(limit + 1)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read {what} ({e.strerror}); check the path and permissions") from None
    try:
        return raw[:limit].decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: {what} is not UTF-8 text; the file is corrupt: replace it") from None


def _outside(path: str, root: StrPath, what: str) -> Optional[str]:
    real, real_root = os.path.realpath(path), os.path.realpath(os.fspath(root))
    if _inside(real, real_root):
        return None
    return (f"{path}: {what} resolves to {real}, outside {os.fspath(root)} (a symbolic link leading out of the "
            "checkpoint: what it points at is no part of it, and reading it would mix another file into the "
            "export); replace the link with the file itself, or remove it")


def source_root(src: StrPath) -> str:
    """The tree the files of the checkpoint ``src`` belong to: ``src`` itself, except for a Hugging
    Face cache snapshot (``…/models--x/snapshots/<rev>``, whose files are links into ``…/blobs``),
    which belongs to its repository folder."""
    real = os.path.realpath(os.fspath(src))
    parent = os.path.dirname(real)
    if os.path.basename(parent) == "snapshots" and os.path.isdir(os.path.join(os.path.dirname(parent), "blobs")):
        return os.path.dirname(parent)
    return real


def check_inside(paths: Iterable[StrPath], root: StrPath, *, what: str = "a file the export reads") -> None:
    """Refuse (:class:`CheckpointError`, naming the first) a path of ``paths`` that resolves outside
    ``root``: a link inside the tree is fine, one leading out of it is not."""
    seen = set()
    for path in paths:
        path = os.fspath(path)
        if path in seen:
            continue
        seen.add(path)
        problem = _outside(path, root, what)
        if problem:
            raise CheckpointError(problem)


def plan_paths(plan: _Plan) -> Iterator[str]:
    """Every file path an :class:`~.plan.ExportPlan` reads bytes from (its pieces, replicas, chunks,
    module copies, tied copies) and the files it lists."""
    from .boxes import groups_paths

    yield from plan.files

    def groups():
        for t in plan.tensors:
            yield from t.parts
            yield from t.replicas
            if t.module_check:
                yield from t.module_check[0]
                yield from t.module_check[1]
            yield from (c.pieces for c in (t.chunks or ()))
            yield from (c.pieces for _, chunks in t.tied_copies for c in chunks)

    yield from groups_paths(groups())  # a ZeRO-3 plan's rank files once, not once per piece


def open_regular(path: StrPath, *, root: Optional[StrPath] = None, limit: Optional[int] = None,
                 what: str = "the file") -> BinaryIO:
    """A binary file object reading ``path``, the way every file a source or an option reads is
    opened: it must resolve inside ``root`` when one is given (:func:`check_inside`), be a regular
    file (opened ``O_NONBLOCK``, then checked on the descriptor: a FIFO refuses instead of hanging,
    a device or directory is refused) of at most ``limit`` bytes when given. Raises
    :class:`CheckpointError` naming ``path`` and the fix; never quotes the content."""
    path = os.fspath(path)
    if root is not None:
        check_inside([path], root, what=what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read {what} ({e.strerror}); check the path and permissions") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # on the descriptor: what was opened, not what was looked at
            raise CheckpointError(f"{path}: {what} is not a regular file (a FIFO, device or directory); replace it "
                                  "with the file itself")
        if limit is not None and st.st_size > limit:
            raise CheckpointError(f"{path}: {what} is {st.st_size:,} bytes, more than the {limit:,} it can be; the "
                                  "file is not what it should be: replace it")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def check_tag_name(tag: str, origin: str) -> str:
    """``tag`` if it can name a directory inside the save dir; else CheckpointError quoting at
    most a short escaped prefix of it (``origin``: where the name came from)."""
    if not isinstance(tag, str):
        raise OptionError(f"{origin}: a tag is a directory name (a str), not {type(tag).__name__}")
    shown = one_line(tag[:_TAG_SHOWN]) + ("…" if len(tag) > _TAG_SHOWN else "")
    if (not tag or tag in (".", "..") or "/" in tag or "\\" in tag or len(tag) > 255
            or not tag.isprintable()):
        raise CheckpointError(f"{origin}: '{shown}' is not a tag name (a directory name inside the save dir); "
                              "pass --tag with the tag directory to read")
    return tag


def read_latest(path: StrPath) -> str:
    """The tag name the DeepSpeed ``latest`` file at ``path`` holds (checked by :func:`check_tag_name`)."""
    text = read_small_text(path, limit=LATEST_LIMIT, what="the 'latest' file")
    tag = text.strip()
    if not tag.strip("\0"):
        what = f"{len(text)} NUL bytes" if text and not text.strip("\0") else "nothing"
        raise CheckpointError(f"{path}: holds {what} instead of a tag name (the save was interrupted while writing "
                              "it); pass --tag with the tag directory to read")
    return check_tag_name(tag, os.fspath(path))


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def is_or_holds(path: StrPath, other: StrPath) -> bool:
    """Whether ``path`` (after resolving links) is ``other`` or a directory holding it."""
    return _inside(os.path.realpath(os.fspath(other)), os.path.realpath(os.fspath(path)))


def copyable_problem(path: StrPath, root: StrPath) -> Optional[str]:
    """Why ``path`` must not be read or copied as a file of the directory ``root`` (None when it may):
    it must resolve to a regular file inside ``root`` (a link inside the tree is fine; one that
    leads out of it could expose any file of this machine in an export that users upload)."""
    path, root = os.fspath(path), os.fspath(root)
    real, real_root = os.path.realpath(path), os.path.realpath(root)
    if not _inside(real, real_root):
        return (f"{path}: a symbolic link to a file outside {root}; not copied (copy the file itself into the "
                "export by hand if it is meant to be there)")
    try:
        st = os.stat(real)
    except OSError as e:
        return f"{path}: cannot read it ({e.strerror}); not copied"
    if not stat.S_ISREG(st.st_mode):
        return f"{path}: not a regular file; not copied"
    return None


def config_problem(config_dir: StrPath) -> Optional[str]:
    """Why ``config_dir/config.json`` cannot serve as the model's config (None when it can)."""
    p = os.path.join(os.fspath(config_dir), "config.json")
    if not os.path.lexists(p):
        return f"{p}: does not exist"
    return copyable_problem(p, config_dir)


def read_config(config_dir: StrPath) -> dict[str, Any]:
    """``config_dir/config.json`` as a dict: a regular file inside ``config_dir``, bounded, a JSON object."""
    p = os.path.join(os.fspath(config_dir), "config.json")
    problem = config_problem(config_dir)
    if problem:
        raise CheckpointError(f"{problem}; pass --config a directory holding the model's config.json")
    try:
        if os.path.getsize(p) > CONFIG_LIMIT:
            raise CheckpointError(f"{p}: larger than {CONFIG_LIMIT:,} bytes, not a model config; pass --config a "
                                  "directory holding the model's config.json")
        with open_regular(p, root=config_dir, limit=CONFIG_LIMIT, what="config.json") as fh:
            cfg = json.loads(fh.read(CONFIG_LIMIT + 1).decode("utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{p}: unreadable ({one_line(str(e))[:200]}); fix it or pass --config a directory "
                              "holding the model's config.json") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{p}: holds a JSON {type(cfg).__name__ if cfg is not None else 'null'}, not an "
                              "object; fix it or pass --config a directory holding the model's config.json")
    return cfg


def check_destination(dst: StrPath, *, inputs: Iterable[Union[str, Tuple[str, str]]] = (),
                      configs: Iterable[Optional[str]] = ()) -> str:
    """The real path to export into, after refusing destinations that would lose data.

    ``inputs`` are the directories read (the source, the directories of its files; an item may be
    ``(path, role)``, the role naming it in the refusal, e.g. "the adapter config directory"): the
    destination must not be one of them, hold one (an ancestor: replacing it deletes the
    source) or lie inside one (writing there changes the source tree). ``configs`` (the config
    directory) must not be the destination or inside it. An empty destination (an unset shell
    variable) is refused: it would mean the working directory. Paths are compared after
    resolving symbolic links, so a link to the source is the source.
    """
    raw = os.fspath(dst)
    if not raw.strip():
        raise DestinationError("the destination is an empty path (an unset shell variable?); it would mean the "
                               "working directory: pass the directory to write")
    real = os.path.realpath(raw)
    if real == os.path.dirname(real):
        raise DestinationError(f"{raw}: is the root of the file system; pass a new directory to write")
    for src in inputs:
        src, role = src if isinstance(src, tuple) else (src, "the source")
        if not src:
            continue
        r = os.path.realpath(src)
        if _inside(r, real):
            what = f"is {role}" if r == real else f"contains {role}"
            via = f" (it resolves to {real})" if real != os.path.abspath(raw) else ""
            raise DestinationError(f"{raw}: {what} {src}{via}; replacing it would delete what the export reads: "
                                   "choose a directory outside it")
        if _inside(real, r):
            raise DestinationError(f"{raw}: lies inside {role} {src}; writing there would change what the export "
                                   "reads: choose a directory outside it")
    for cfg in configs:
        if cfg and _inside(os.path.realpath(cfg), real):
            raise DestinationError(f"{raw}: is or contains the config directory {cfg}; replacing it would "
                                   "delete the config: choose a directory outside it")
    return real


@contextmanager
def bad_metadata_as_input(where: StrPath) -> Iterator[None]:
    """Turn the errors that malformed metadata raises while a plan is built (a list where a dict
    belongs, a missing key, a number that is a string) into :class:`~.errors.LayoutError` naming
    ``where``: they are bad input (exit 2), not bugs. The original stays chained for ``--debug``."""
    try:
        yield
    except CheckpointError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError, UnicodeError) as e:
        detail = one_line(f"{type(e).__name__}: {e}")
        if len(detail) > 200:
            detail = detail[:200] + "…"
        raise LayoutError(f"{where}: unexpected metadata ({detail}); the checkpoint is corrupt or was written by an "
                          "engine version hf-ckpt does not read yet — run with --debug for where it failed, and "
                          "report it if the engine itself loads this checkpoint") from e


_PIPELINE_RE = re.compile(r"^layer_\d+(?:-[a-z]+_\d+)*-model_states\.pt$")
_ZERO12_MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_ZERO3_MODEL_RE = re.compile(r"^zero_pp_rank_\d+_mp_rank_(\d+)_model_states\.pt$")


def refuse_unreadable_layouts(tag_dir: str, names: Iterable[str]) -> None:
    """Name two layouts by their file names before anything is read (each used to surface as a
    misleading layout error or a crash):

    - DeepSpeed ``PipelineModule`` saves each layer as ``layer_XX[-model_YY]-model_states.pt``;
      those tags are read by ``sources/deepspeed/pipeline.py``, never by the ZeRO rank-file reader;
    - a ZeRO-1/2 model-states file (``mp_rank_XX_model_states.pt``) beside ZeRO-3 ones
      (``zero_pp_rank_N_mp_rank_XX_model_states.pt``) of the same model-parallel rank: two saves mixed.
    """
    names = sorted(names)
    found = [n for n in names if _PIPELINE_RE.match(n)]
    if found:
        raise LayoutError(f"{tag_dir}: a DeepSpeed pipeline-parallel checkpoint ({len(found)} "
                          f"layer_*-model_states.pt files, e.g. {found[0]}): the ZeRO rank-file reader does not "
                          "read it; hf-ckpt export/inspect read it with the pipeline source (sources/deepspeed/pipeline.py)")
    zero3 = {m.group(1) for m in map(_ZERO3_MODEL_RE.match, names) if m}
    both = [n for n in names if (m := _ZERO12_MODEL_RE.match(n)) and m.group(1) in zero3]
    if both:
        m12 = _ZERO12_MODEL_RE.match(both[0])
        assert m12 is not None  # both[0] was chosen by this match
        raise LayoutError(f"{tag_dir}: holds {both[0]} (a ZeRO-1/2 save) beside zero_pp_rank_*_mp_rank_"
                          f"{m12.group(1)}_model_states.pt (ZeRO-3 saves); files from "
                          "different saves are mixed: copy one save's tag directory again")


def claim_file(slots: MutableMapping[Any, Any], key: object, path: str, *, where: str, what: str = "rank",
               canonical: Optional[str] = None, value: object = None) -> None:
    """Place the file ``path`` (or ``value`` standing for it, which must keep a ``path`` attribute or be
    the path) at ``slots[key]``: the one rule every source listing per-rank, per-layer or
    per-partition files follows. Ranks come from the numbers in the names, so ``rank_1`` and
    ``rank_01`` are one rank: a second file for a key taken is refused naming both (reading either
    would silently drop the other, and one of them was copied in or edited). ``canonical`` is the
    name the engine writes for ``key``: when one of the two is it, the refusal says to remove the other.
    """
    if key in slots:
        held = slots[key]
        first = os.path.basename(getattr(held, "path", held))
        name = os.path.basename(path)
        odd = [n for n in (first, name) if n != canonical] if canonical in (first, name) else []
        fix = (f"remove {odd[0]} (the engine writes {canonical})" if len(odd) == 1 else
               "remove the one this save did not write (copied in from elsewhere, or renamed)")
        raise LayoutError(f"{where}: {first} and {name} both claim {what} {key}; one was copied in from elsewhere "
                          f"or renamed: {fix}")
    slots[key] = path if value is None else value


def dims(value: Any, what: str, where: Optional[str] = None, *, limit: Optional[int] = None) -> Tuple[int, ...]:
    """``value`` (a shape, stride, offsets... read from a checkpoint's metadata) as a tuple, if it is a
    list or tuple of at most ``limit`` (default :data:`~.formats.dtypes.MAX_NDIM`) non-negative
    integers (``bool`` is not one); :class:`~.errors.LayoutError` naming ``where`` and ``what`` otherwise.
    The one validator every reader of such metadata uses."""
    from .formats.dtypes import MAX_NDIM

    limit = MAX_NDIM if limit is None else limit
    if type(value) not in (tuple, list) or len(value) > limit or not all(type(v) is int and v >= 0 for v in value):
        raise LayoutError(f"{where + ': ' if where else ''}{what} {short_repr(value)} is not a list of at most {limit} "
                          "non-negative integers; the file is corrupt or crafted: copy it again from the training run")
    return tuple(value)
