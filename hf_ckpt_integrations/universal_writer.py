"""A DeepSpeed universal checkpoint from a DeepSpeed ZeRO save: resume at another TP/DP size.

What DeepSpeed's loader (``"checkpoint": {"load_universal": true}``, 0.19) reads from the tag
directory, and so what is written:

- ``zero/<parameter name>/fp32.pt`` and one file per optimizer state (``exp_avg.pt``,
  ``exp_avg_sq.pt``, whatever else the optimizer holds per element): ``{"param": full tensor,
  "cat_dim": d}`` (plus ``"vocab_tensor": True`` for a vocabulary whose padding was dropped). The
  full tensor is merged from the data-parallel partitions and model-parallel slices by the same
  plan as the HF export (:mod:`.sources.deepspeed`: partitions placed by rank number and proven
  against the module weights; TP slices by recorded info -> HF tp plan -> ``--tp-rule`` ->
  shapes -> bytes; replicas written once after every copy of every state is found equal). The
  loader copies a tensor whose shape is its new local one, else cuts it along ``cat_dim``.
- ``zero/<name>/step.pt``: the optimizer's per-group step, as stored (ZeRO-1/2 read it here).
- ``zero/optimizer_state.pt``: ``param_groups`` (hyperparameters), ``ds_version``, ``clip_grad``,
  the loss-scaler flags, and ``optimizer_state_dict`` (``state[0].step`` + ``param_groups``, what
  ZeRO-3 reads) — one file any stage loads.
- ``mp_rank_00_model_states.pt`` and ``zero_pp_rank_0_mp_rank_00_model_states.pt`` (the name a
  ZeRO-3 engine looks for): the step counters, the lr scheduler state, ``dp_world_size``,
  ``mp_world_size`` 1 (one file: every target rank reads it), the buffers, the parameters' full
  shapes, and ``universal_checkpoint_info`` saying how each parameter was merged.

Frozen parameters get ``fp32.pt`` only (as ``ds_to_universal`` writes them). The loss scaler
object itself is not carried (the source file pickles a DeepSpeed class; its flags are): an fp16
run's dynamic loss scale restarts from the configured initial scale.

Reading stays metadata plus byte ranges (the restricted unpickler; never ``torch.load`` of a source
file). Every file is written in ``torch.save``'s format (DeepSpeed loads them with ``torch.load``) by
:mod:`.formats.torch_save_out`, without torch: a state's bytes go from the source's byte ranges to
the output a bounded chunk at a time (only a tensor that must be assembled, TP column slices or
unpadding, is held whole), and only plain data is written (a value that is not, in an optional
model-states field, is left out with a note). The directory is staged and made visible last through
:func:`~.writer.export_strategy` (the destination guard every output goes through): never inside
the source, nothing left behind on failure. Load it with
``engine.load_checkpoint(os.path.dirname(dst), tag=os.path.basename(dst))``; no
``latest_universal`` file is written (it would live outside ``dst``).
"""

import os
import re
import time
from collections import OrderedDict
from typing import Dict, Optional, Sequence

from .errors import CheckpointError, LayoutError, option, short_repr
from .guards import check_inside, plan_paths, source_root
from .formats.torch_files import TensorRef
from .formats.file_ranges import FileRange, SourceFiles
from .formats.out_tensor import OutTensor
from .formats.torch_save_out import TorchSize, archive_name, save as save_torch_file
from .mapped_files import MappedFiles
from .outfiles import open_new
from .plan import ExportPlan, TensorPlan, check_plan

__all__ = ["plan_universal", "write_universal_checkpoint", "universal_summary", "UC_VERSION",
           "STATE_LIMIT", "CLIENT_STATE_LIMIT"]

# deepspeed/checkpoint/constants.py UNIVERSAL_CHECKPOINT_VERSION_VALUE (0.19.8); shapes and cat_dim only,
# which every version reads.
UC_VERSION = 0.4
ZERO_DIR = "zero"
MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
# What the source's optimizer file holds besides the partitions that a loader reads (plain values).
_GLOBAL_FIELDS = ("ds_version", "clip_grad", "dynamic_loss_scale", "overflow", "zero_stage")
# A non-tensor optimizer state (``step``: a number, a 0-d tensor; a few per group) is copied into every
# parameter's folder: beyond this many bytes it is not an optimizer's per-group value.
STATE_LIMIT = 1 << 16
_MODEL_FIELDS = ("global_steps", "global_samples", "skipped_steps", "lr_scheduler", "dp_world_size", "ds_config",
                 "ds_version", "data_sampler", "random_ltd")
# What DeepSpeed's own ``_common_checkpoint_state`` (0.19.8, engine.py) and its MoE/AutoTP savers put in a
# model-states file; every other key is the training loop's ``client_state`` (GPT-NeoX's iteration and RNG
# states), which ``load_checkpoint`` hands back to the loop: carried when it is plain data.
_ENGINE_FIELDS = frozenset(_MODEL_FIELDS) | {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "mp_world_size", "sparse_tensor_module_names", "universal_checkpoint_info",
    "checkpoint_parallel_dimensions", "num_experts", "ds_autoep_layers"}
# Client state is copied into each of the model-states files: beyond this many bytes it is not a loop's
# counters and RNG states (tensors count their bytes; a bound like STATE_LIMIT's, for the whole of it).
CLIENT_STATE_LIMIT = 64 << 20


def plan_universal(src, *, tag: Optional[str] = None, config: Optional[str] = None,
                   tp_rules: Optional[Sequence[str]] = None):
    """``(plan, states, model_fields)``: the DeepSpeed source's plan of the fp32 masters (in-memory
    parameter names; no Hub-layout pass, no dtype change), the :class:`OptimizerStates` beside them
    and the first model-states file's fields. A ``PipelineModule`` save is planned by its own reader
    under the module's parameter names (:func:`.sources.deepspeed.pipeline.universal_plan`). Refuses
    what is not a DeepSpeed ZeRO or pipeline save, and what the export refuses (a TP-split tensor with
    no rule, replicas that disagree)."""
    from .sources.deepspeed.allowlist import load
    from .sources.deepspeed.optim_states import OptimizerStates
    from .sources.deepspeed.rank_files import resolve_tag_dir
    from .convert.passes import find_config_dir
    from .sources.protocol import PlanContext, hook
    from .sources.registry import find_source

    from .formats.config import config_dir_of

    config = config_dir_of(config)
    src = os.path.abspath(os.fspath(src))
    source = find_source(src, tag)
    if not hook(source, "UNIVERSAL"):
        raise CheckpointError(f"{src}: a {source.NAME} checkpoint; a universal checkpoint is written from a "
                              "DeepSpeed ZeRO save or PipelineModule save (engine.save_checkpoint output) only")
    if config is not None and not os.path.isfile(os.path.join(config, "config.json")):
        raise CheckpointError(f"{config}: no config.json there; pass {option('config', 'PATH')} the model's "
                              "config.json or the directory holding it")
    config_dir = config if config is not None else find_config_dir(source.config_candidates(src, tag))
    ctx = PlanContext(src, tag=tag, options={"tp_rules": list(tp_rules or [])}, config_dir=config_dir)
    # A PipelineModule save keeps the module's own names ("{layer}.{name}", what load_universal looks up);
    # its name map (from the config's model_type) gives only the TP rules.
    plan = source.universal_plan(ctx)
    check_inside(plan_paths(plan), source_root(src), what="a file of the checkpoint")  # as every plan (registry)
    plan.config_dir = config_dir
    check_plan(plan)
    tag_dir, _ = resolve_tag_dir(src, tag)
    for t in plan.tensors:
        _check_name(t.name, tag_dir)
    # The DeepSpeed reader kept the rank files it read (ctx.reads): every optimizer pickle and the
    # model-states file are read once (a 1,024-rank save: 1,024 pickles, seconds each time).
    reads = ctx.reads or {}
    optim, first = source.universal_files(tag_dir, *([reads] if "rank_files" in reads else []))
    if not any(optim.values()):
        # Without ZeRO the optimizer's state sits inside the model-states file, keyed by position
        # (no file ties it to a name), and DeepSpeed restores a universal checkpoint only through
        # its ZeRO optimizers (an engine without ZeRO never reads zero/; 0.19 engine.py
        # _load_checkpoint). Weights alone would not be the resume this command promises.
        raise CheckpointError(f"{tag_dir}: a DeepSpeed save without ZeRO (stage 0, "
                              f"{plan.detail.get('optimizer') or 'no ZeRO optimizer'}): no ZeRO optimizer partition "
                              "files to take the states from, and DeepSpeed loads universal checkpoints into ZeRO "
                              "stage 1-3 engines only; resume it at its own layout (engine.load_checkpoint), or "
                              "train with ZeRO stage 1-3 to change layouts (hf-ckpt export gives its weights)")
    states = OptimizerStates(tag_dir, optim)
    model = reads.get("model_states", {}).get(first) if first is not None else None
    return plan, states, model if model is not None else load(first)


_SAFE_NAME = re.compile(r"^[^/\\\x00]{1,255}$")


def _check_name(name: str, where: str) -> None:
    # Parameter names become directory names (DeepSpeed's layout): one path component each.
    if not isinstance(name, str) or not _SAFE_NAME.match(name) or name in (".", "..") or \
            any(ord(c) < 32 for c in name):
        raise LayoutError(f"{where}: parameter name {short_repr(name)} cannot be a directory name of a universal "
                          "checkpoint; the checkpoint is corrupt or crafted: copy it again")


def _rules(plan: ExportPlan):
    """How each parameter was merged, as DeepSpeed's ``universal_checkpoint_info`` records it."""
    info = {"universal_checkpoint_version": UC_VERSION, "tp_replicated_parameter_patterns": [],
            "parameter_with_row_parallelism_patterns": [], "vocabulary_parameter_patterns": []}
    for t in plan.tensors:
        pattern = "^" + re.escape(t.name) + "$"
        if len(t.parts) == 1:
            if t.replicas:
                info["tp_replicated_parameter_patterns"].append(pattern)
            continue
        if t.cat_dim == 1:
            info["parameter_with_row_parallelism_patterns"].append(pattern)
        if t.keep_rows is not None:
            info["vocabulary_parameter_patterns"].append(pattern)
            info["original_vocab_size"] = t.keep_rows
    return info


def universal_summary(plan: ExportPlan, states) -> dict:
    """What ``universal`` will write (``inspect`` shows it): per parameter its full shape, how its
    model-parallel slices merge, and the states written."""
    params = []
    for t in plan.tensors:
        trained = states.has_states(t)
        params.append({"name": t.name, "shape": list(t.shape), "kind": t.kind,
                       "merge": "replicas: one copy, the others checked" if t.replicas else
                       (f"cat dim {t.cat_dim}" if len(t.parts) > 1 else "one copy"), "rule": t.rule,
                       "vocab_rows_kept": t.keep_rows,
                       "states": (["fp32"] + states.tensor_names + states.scalar_names) if trained else
                       (["fp32"] if t.kind != "buffer" else [])})
    return {"optimizer_states": states.tensor_names + states.scalar_names, "parameters": params}


def _plain(value, files, what):
    """``value`` (read by the restricted unpickler) as plain data for :func:`_save`: containers,
    numbers, strings; a tensor as an :class:`OutTensor` whose bytes are copied from its file when
    written. :class:`_NotPlain` for anything else. (``files`` is unused: kept for callers.)"""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, TensorRef):
        where = FileRange(value.path, *value.byte_range())  # refuses a non-contiguous tensor now, not mid-file
        return OutTensor(what, value.dtype, value.shape, lambda: [where])
    if isinstance(value, (list, tuple)):
        out = [_plain(v, files, what) for v in value]
        return tuple(out) if isinstance(value, tuple) else out
    if isinstance(value, dict):
        out = OrderedDict() if isinstance(value, OrderedDict) else {}
        for k, v in value.items():
            out[_plain(k, files, what)] = _plain(v, files, what)
        return out
    raise _NotPlain(f"{what} holds a {type(value).__name__}")


class _NotPlain(Exception):
    pass


def _save(obj, path, out) -> int:
    """``obj`` written as ``torch.save(obj, path)`` writes it (``torch.load`` reads it; torch is not
    imported), source ranges read through ``out["sources"]``; the bytes written. ``out["syncer"]``
    (:class:`_Syncer`) fsyncs the file."""
    with open_new(path) as fh:
        n = save_torch_file(obj, fh, archive=archive_name(path), files=out["sources"])
    out["syncer"].add(path)
    return n


class _Syncer:
    """fsyncs the files written, on a few threads, while the next ones are written; :meth:`wait`
    (before the directory is renamed into place) returns once every one is durable, or raises the
    first error.

    One fsync per file in the writing thread cost a journal commit each (~9 ms here: 10 of the 14 s
    of a 1 GB universal checkpoint of 1,169 files; deferring them all to the end was no better:
    ext4 allocates the delayed blocks at each fsync). fsyncs in flight together share a journal
    commit, and run while the writer goes on. Same guarantee: every file durable before the rename."""

    THREADS = 8

    def __init__(self):
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(self.THREADS, thread_name_prefix="hfckpt-fsync")
        self.futures = []

    @staticmethod
    def _fsync(path) -> None:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))  # a file of our own staging directory
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def add(self, path) -> None:
        self.futures.append(self.pool.submit(self._fsync, path))

    def wait(self) -> None:
        try:
            for f in self.futures:
                f.result()
        finally:
            self.close()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _tensor(t: TensorPlan, dtype: str) -> OutTensor:
    """The tensor ``t`` describes, in ``dtype``, read while its file is written (the writer's own
    descriptor, :func:`~.writer.out_tensor`): stored bytes as file ranges copied a bounded chunk at a
    time (a ZeRO merge is its partitions' ranges in order), a cast a chunk at a time, only a tensor
    that must be assembled (TP column slices, unpadding) in memory, mapped only while it is read.
    The replicas are checked before the first byte (:func:`~.assemble.iter_bytes`)."""
    from .writer import out_tensor

    return out_tensor(t, dtype, None, ranges=True)


def write_universal_checkpoint(src, dst, *, tag: Optional[str] = None, config: Optional[str] = None,
                               tp_rules: Optional[Sequence[str]] = None, quiet: bool = True) -> dict:
    """Write the DeepSpeed universal checkpoint of the ZeRO save ``src`` (a save dir, tag dir or
    Trainer ``checkpoint-N``) into the new directory ``dst`` (see the module doc for the layout).

    ``tp_rules``: ``["PATTERN=0|1|replicated", ...]`` for model-parallel parameters that neither the
    checkpoint nor the HF config (``config``, default next to the checkpoint) describes. Resume with
    ``"checkpoint": {"load_universal": true}`` in the DeepSpeed config and
    ``engine.load_checkpoint(os.path.dirname(dst), tag=os.path.basename(dst))``, at any data- or
    tensor-parallel size. ``config``: the model's config.json or its directory. Not ``quiet``: a
    progress bar (one step per parameter) on stderr when it is a terminal. Returns a report (``destination``, ``parameters``, ``states``, ``files``,
    ``bytes``, ``seconds``, ``notes``). Raises a :class:`~.errors.CheckpointError` subclass for every
    refusal; nothing is written then.
    """
    from .writer import export_strategy

    start = time.monotonic()
    plan, states, model = plan_universal(src, tag=tag, config=config, tp_rules=tp_rules)
    check_states(plan, states)  # before anything is written
    notes = list(plan.notes)
    strategy = export_strategy(dst, plan, overwrite=None)  # never replaced: no --overwrite to name
    staging = strategy.begin()
    written = {"files": 0, "bytes": 0}
    try:
        written = _write(plan, states, model, staging, notes, quiet, f"writing {strategy.dst}")
        strategy.commit()
    except BaseException:
        strategy.abort()
        raise
    return {"destination": strategy.dst, "parameters": sum(1 for t in plan.tensors if t.kind != "buffer"),
            "states": ["fp32"] + states.tensor_names + states.scalar_names, **written,
            "seconds": round(time.monotonic() - start, 3), "notes": notes,
            "load": f"engine.load_checkpoint({os.path.dirname(strategy.dst)!r}, "
                    f"tag={os.path.basename(strategy.dst)!r}) with \"checkpoint\": {{\"load_universal\": true}}"}


def _param_dict(t: TensorPlan, tensor: OutTensor) -> dict:
    out = {"param": tensor, "cat_dim": t.cat_dim if len(t.parts) > 1 and t.cat_dim is not None else 0}
    if t.keep_rows is not None:
        out["vocab_tensor"] = True  # padding dropped: the loader pads again for its TP size
    return out


def check_states(plan: ExportPlan, states) -> None:
    """Refuse, by name, optimizer states this layout cannot hold: a state whose file name
    (``zero/<param>/<state>.pt``) is another's — ``fp32`` (the master's file), or two names one file
    system takes for one (``exp_avg``/``EXP_AVG`` where case is folded) — and a non-tensor state
    larger than :data:`STATE_LIMIT` (it is copied into every parameter's folder)."""
    where = f"{plan.source} (optimizer state)"
    taken = {"fp32": "the fp32 master weights"}
    for name in states.tensor_names + states.scalar_names:  # each becomes a file name
        _check_name(name, where)
        key = name.casefold()
        if key in taken:
            raise LayoutError(f"{where}: the optimizer holds a state named {short_repr(name)}, whose file {name}.pt "
                              f"is {taken[key]}'s in a universal checkpoint (zero/<param>/<state>.pt); "
                              "DeepSpeed's layout cannot hold both: rename the state in the optimizer")
        taken[key] = f"optimizer state {short_repr(name)}"
    for t in plan.tensors:
        if t.kind == "buffer" or not states.has_states(t):
            continue
        for name in states.scalar_names:
            size = _plain_size(states.scalar(t, name), STATE_LIMIT)
            if size > STATE_LIMIT:
                raise LayoutError(f"{plan.source}: optimizer state {short_repr(name)} of {t.name} holds more than "
                                  f"{STATE_LIMIT:,} bytes of non-tensor data (a per-group value such as the step is "
                                  "a number), and would be copied into every parameter's folder; the optimizer "
                                  "state is corrupt or not one a universal checkpoint carries")


def _plain_size(value, limit: int) -> int:
    """About how many bytes ``value`` (plain data or tensors) pickles to; stops counting past ``limit``."""
    total, todo = 0, [value]
    while todo and total <= limit:
        v = todo.pop()
        if isinstance(v, TensorRef):
            total += v.numel * 8
        elif isinstance(v, (str, bytes)):
            total += len(v) + 8
        elif isinstance(v, dict):
            total += 8
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, (list, tuple)):
            total += 8
            todo.extend(v)
        else:
            total += 8
    return total


def _write(plan: ExportPlan, states, model, staging, notes, quiet=True, desc="writing") -> Dict[str, int]:
    from .writer import progress_bar

    check_states(plan, states)
    zero = os.path.join(staging, ZERO_DIR)
    os.mkdir(zero)
    out = {"files": 0, "bytes": 0, "buffers": OrderedDict(), "steps": [], "shapes": OrderedDict(),
           "frozen": OrderedDict(), "syncer": _Syncer(), "sources": SourceFiles()}
    try:
        with progress_bar(len(plan.tensors), desc, quiet, unit="tensor") as bar:
            for t in plan.tensors:
                _write_param(plan, states, t, zero, out)
                bar.update()
        with MappedFiles() as files:
            nbytes = _save(_optimizer_state(plan, states, out["steps"], files),
                           os.path.join(zero, "optimizer_state.pt"), out)
            states_file = _model_states(plan, model, out["shapes"], out["frozen"], out["buffers"], files, notes)
        for name in MODEL_STATES:
            nbytes += _save(states_file, os.path.join(staging, name), out)
        out["syncer"].wait()
    finally:
        out["syncer"].close()  # a refusal half-way: the pending fsyncs end before the staging goes
        out["sources"].close()
    return {"files": out["files"] + 1 + len(MODEL_STATES), "bytes": out["bytes"] + nbytes}


def _write_param(plan, states, t: TensorPlan, zero, out) -> None:
    if t.kind == "buffer":
        out["buffers"][t.name] = _tensor(t, t.src_dtype)  # read when the model-states file is written
        return
    folder = os.path.join(zero, t.name)
    os.mkdir(folder)
    trained = states.has_states(t)
    out["bytes"] += _save(_param_dict(t, _tensor(t, "F32")), os.path.join(folder, "fp32.pt"), out)
    out["files"] += 1
    if not trained:
        out["frozen"][t.name] = TorchSize(t.shape)
        return
    out["shapes"][t.name] = TorchSize(t.shape)
    for name in states.tensor_names:
        # every state of every copy is checked against the first copy, not only the weights
        sp = states.state_plan(t, name)
        out["bytes"] += _save(_param_dict(t, _tensor(sp, sp.src_dtype)), os.path.join(folder, f"{name}.pt"),
                              out)
        out["files"] += 1
    for name in states.scalar_names:
        try:
            value = _plain(states.scalar(t, name), None, f"optimizer {name} of {t.name}")
        except _NotPlain as e:
            raise CheckpointError(f"{plan.source}: {e}; not an optimizer state this writer knows") from None
        if name == "step":
            out["steps"].append(value)
        out["bytes"] += _save(value, os.path.join(folder, f"{name}.pt"), out)
        out["files"] += 1


def _optimizer_state(plan, states, steps, files) -> dict:
    fields = states.fields
    try:
        groups = _plain(states.param_groups, files, "param_groups")
    except _NotPlain as e:
        raise CheckpointError(f"{plan.source}: the optimizer's {e}; not an optimizer this writer knows") from None
    out = {k: _plain(fields[k], files, k) for k in _GLOBAL_FIELDS if k in fields and _is_plain(fields[k])}
    if "ds_version" not in out and plan.engine_version:  # ZeRO-3 files record it in the model states only;
        out["ds_version"] = plan.engine_version          # a ZeRO-1/2 loader requires it
    out["param_groups"] = groups
    step = steps[0] if steps else None
    # ZeRO-3's loader takes the step from here (state 0), ZeRO-1/2's from each zero/<name>/step.pt.
    out["optimizer_state_dict"] = {"state": {0: {"step": step}} if step is not None else {},
                                   "param_groups": groups}
    return out


def _is_plain(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _model_states(plan, model, shapes, frozen, buffers, files, notes) -> dict:
    out = {}
    for k in _MODEL_FIELDS:
        if k not in model:
            continue
        try:
            out[k] = _plain(model[k], files, k)
        except _NotPlain as e:  # the reader built an inert stand-in, never the object: nothing to copy
            notes.append(f"{k} not carried into the universal checkpoint ({e}): the resumed run starts it afresh" +
                         (" (DeepSpeed's loader reads it: pass load_lr_scheduler_states=False to load_checkpoint)"
                          if k == "lr_scheduler" else ""))
    out.update(_client_state(plan, model, files, notes))
    out.update({"module": buffers, "buffer_names": list(buffers), "param_shapes": [shapes],
                "frozen_param_shapes": frozen, "shared_params": dict(plan.aliases), "mp_world_size": 1,
                "optimizer": None, "universal_checkpoint_info": _rules(plan)})
    return out


def _client_state(plan, model, files, notes) -> dict:
    """The source's client state (the first model-states file's: one file serves every target rank),
    each key that is plain data (numbers, strings, containers, tensors) as saved; a key holding
    anything else (numpy's RNG state, an ``argparse.Namespace``: read as inert stand-ins, never
    rebuilt) is left out with a note, and so is the whole when over :data:`CLIENT_STATE_LIMIT`."""
    keys = [k for k in model if isinstance(k, str) and k not in _ENGINE_FIELDS]
    if not keys:
        return {}
    size = _plain_size([model[k] for k in keys], CLIENT_STATE_LIMIT)
    if size > CLIENT_STATE_LIMIT:
        notes.append(f"client state ({', '.join(map(short_repr, keys[:8]))}) not carried: more than "
                     f"{CLIENT_STATE_LIMIT >> 20} MiB; the training loop restores it from the source checkpoint")
        return {}
    out, left = {}, []
    for k in keys:
        try:
            out[k] = _plain(model[k], files, k)
        except _NotPlain as e:
            left.append(f"{k} ({e.args[0].split(' holds ', 1)[-1]})")
    if left:
        notes.append(f"client state not carried (not plain data; the reader never rebuilds it): {', '.join(left)}; "
                     "a training loop that reads it on resume must skip it (GPT-NeoX: no_load_rng)")
    return out
