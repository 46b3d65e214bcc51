"""The budgeted, restricted unpickler: plain data from a pickle without running code from it.

:func:`loads` accepts only the globals of the allowlist it is given (module -> name -> stand-in),
each rebuilt into an inert value; any other global (``os.system``, ``builtins.eval``, an unknown
class) raises :class:`~..errors.UnsafeCheckpointError` before anything is called. Nothing is
allowed by default: each reader declares its list (:data:`CONTAINERS` for plain containers,
:data:`CLIENT_STATE` for the RNG states and args training loops save beside the weights,
:mod:`.torch_files` for torch's tensor rebuilds, each source for its engine's own classes, e.g.
``sources/deepspeed/allowlist.py``, ``sources/dcp.py``).

A few hundred bytes of pickle can describe a tuple nested a million deep, or a DAG whose
every level references the previous one twice (2^N nodes once walked, hashed or printed).
So the unpickler is the pure-Python one, instrumented: it counts opcodes and the objects it holds
before any tree exists (stack, marked stacks, memo), hashes only
shallow keys, calls allowlisted callables only with arguments they cannot blow up on, and
the loaded tree is walked once, iteratively, within :data:`MAX_DEPTH` and :data:`MAX_NODES`
(counting shared nodes every time they are reached, but a small shared stand-in once:
:data:`SHARED_SMALL`). Anything over a budget is a
:class:`~..errors.CheckpointError`, in bounded time and memory. The budgets of a pickle read whole grow
with its size (:data:`OPS_PER_BYTE`, :data:`NODES_PER_BYTE`, :data:`HELD_PER_BYTE`): a real metadata
pickle of 50-500 MB (torch DCP's, at 0.4-3.8M chunks) passes, and its time and memory stay a
multiple of its size.
"""

import _compat_pickle
import collections
import contextlib
import gc
import io
import os
import pickle
import reprlib
import struct
from typing import Any, Callable, Iterable, Iterator, Mapping, NoReturn, Optional, Protocol

from ..errors import CheckpointError, UnsafeCheckpointError, short_repr
from .pickle_memo import HOLE as _HOLE, Memo as _Memo
# The stand-ins and shared allowlists live beside; re-exported here, where readers look for them.
from .pickle_values import (ATOMS, CLIENT_STATE, CONTAINERS, EnumMember, Leaf, NumpyArray, NumpyDtype,
                            NumpyScalar, Opaque, Record, StandIn, check_key, check_keys, record_type)

# An allowlist: module -> {name -> the stand-in (a class, function or marker) a global becomes}.
Allowlist = Mapping[str, Any]
# pickle's pure-Python unpickler: typeshed types its public face only (no _Unframer, _Stop, load_* methods).
_pickle: Any = pickle


class PickleInput(Protocol):
    """What the unpickler reads from: a binary file, or a reader bounding one (``torch_legacy``)."""
    def read(self, n: int, /) -> bytes: ...
    def readline(self) -> bytes: ...

__all__ = ["StandIn", "Leaf", "Opaque", "Record", "record_type", "CONTAINERS", "CLIENT_STATE", "NumpyArray",
           "NumpyDtype", "NumpyScalar", "EnumMember", "loads",
           "load_pickle", "load_stream", "gc_paused", "MAX_PICKLE_BYTES", "MAX_OPS", "MAX_NODES", "MAX_DEPTH", "SHARED_SMALL",
           "OPS_PER_BYTE", "NODES_PER_BYTE", "HELD_PER_BYTE"]

# Budgets for one file's pickle (a DeepSpeed data.pkl of a 70B model is a few MB, its tree
# ~10^5 nodes, 8 levels deep): far above any real checkpoint, far below what hurts a machine.
MAX_PICKLE_BYTES = 512 * 2**20
MAX_OPS = 20_000_000  # opcodes executed (each makes at most one object)
MAX_NODES = 2_000_000  # tree nodes, a shared node counted each time it is reached (but see SHARED_SMALL)
SHARED_SMALL = 256  # a shared stand-in of at most this many nodes counts once, then 1 per reference
MAX_DEPTH = 100
# A pickle in memory gets budgets that grow with its size, so that a real one of any size up to
# MAX_PICKLE_BYTES passes: torch DCP's ``.metadata`` holds ~140 bytes, ~35 opcodes and ~14 nodes per
# chunk, and a DeepSeek-V3 save over 8 ranks has 363k chunks (~50 MB: 5.2M nodes, refused as crafted under
# the fixed budgets alone). Time and memory then stay within a multiple of the pickle's size, and what the
# budgets are for still runs into them: a DAG or a shared container referenced over and over describes
# far more nodes than it has bytes. (A pickle read as a stream, torch.save's legacy format, keeps the
# fixed budgets: its size is not known up front.)
OPS_PER_BYTE = 1  # (every opcode is at least a byte: an in-memory pickle cannot run past its size)
NODES_PER_BYTE = 1  # DCP metadata describes 0.1-0.2 nodes per byte, a rank file of DTensors 0.04
HELD_PER_BYTE = 0.5  # objects held at once: DCP metadata ~0.1 per byte
_CHECK_EVERY = 65536  # opcodes between two checks of the objects the unpickler holds


class _Unpickler(_pickle._Unpickler):
    """The pure-Python unpickler (the C one cannot be instrumented) with budgets at the opcodes
    that can blow up: see the module docstring. About 2x slower than the C one here (most of the
    time is in our own rebuild functions either way): 2.2 s instead of 1.1 s for a 3.8 MB pickle
    of 20,000 tensors, milliseconds for the engine files of the tests."""

    def __init__(self, file: PickleInput, path: str, allowed: Allowlist,
                 persistent_load: Optional[Callable[[Any], Any]] = None, size: int = 0) -> None:
        super().__init__(file)
        # the budgets of this pickle (``size``: its bytes when in memory, else 0: the fixed budgets)
        self.max_ops = max(MAX_OPS, int(OPS_PER_BYTE * size))
        self._max_held = max(2 * MAX_NODES, int(HELD_PER_BYTE * size))
        self.max_nodes = max(MAX_NODES, int(NODES_PER_BYTE * size))
        self._path = path
        self._allowed = allowed
        self._persistent_load = persistent_load  # None: a plain pickle, persistent ids refused
        self._file = file
        self.memo: Any = _Memo(self._max_held)
        self._parked = 0  # objects on the stacks that MARKs set aside (self.metastack)
        # The whole pickle, when it is in memory (:func:`loads`): the common opcodes run inline.
        self._memfile: Optional[io.BytesIO] = file if type(file) is io.BytesIO else None

    def load(self) -> Any:
        # pickle._Unpickler.load with an opcode budget (CPython 3.8+ internals: _Unframer, _Stop),
        # and, every _CHECK_EVERY opcodes, a budget on the objects it holds before any tree exists
        # (each opcode makes at most one: the overshoot is bounded too).
        self._unframer = _pickle._Unframer(self._file_read, self._file_readline)
        self.read = self._unframer.read
        self.readinto = self._unframer.readinto
        self.readline = self._unframer.readline
        self.metastack: list[list[Any]] = []
        self.stack: list[Any] = []
        self.append = self.stack.append
        self.proto = 0
        read, dispatch, left = self.read, self._dispatch, self.max_ops
        try:
            if self._memfile is not None:
                left = self._load_inline(self._memfile, self._memfile.getvalue(), left)
            while left > 0:
                n = min(left, _CHECK_EVERY)
                for _ in range(n):
                    key = read(1)
                    if not key:
                        raise EOFError
                    dispatch[key[0]](self)
                left -= n
                if len(self.stack) + self._parked + len(self.metastack) + len(self.memo) > self._max_held:
                    self._too_many_held()
        except _pickle._Stop as stop:
            return stop.value
        raise CheckpointError(f"{self._path}: its pickle runs past {self.max_ops} operations; no checkpoint's "
                              "metadata is that large: the file is corrupt or crafted")

    def _too_many_held(self) -> NoReturn:
        raise CheckpointError(f"{self._path}: its pickle holds over {self._max_held} objects at once; no "
                              "checkpoint's metadata is that large: the file is corrupt or crafted")

    def _load_inline(self, file: io.BytesIO, data: bytes, left: int) -> int:
        """Run the pickle in ``data`` from the file's position, the opcodes torch's pickles are made
        of (~95% of a DTensor state dict's: memo, small ints, strings, tuples, marks) inline on the
        bytes, each as :class:`pickle._Unpickler` runs it; every other opcode through the dispatch
        table above (so through the same checks), the file positioned at it. Up to STOP (raised as
        the standard loop raises it), or a FRAME, after which the standard loop reads through the
        frames. Returns the opcode budget left; the same budgets and checks as :meth:`load`, ~3x
        faster: 9.8M opcodes of a 45,395-DTensor rank file took 4 s in the standard loop."""
        dispatch, unpack_from = self._dispatch, struct.unpack_from
        memo = self.memo
        pos = file.tell()
        stack = self.stack
        append = stack.append
        end = len(data)
        while left > 0:  # the opcode budget, as in load()
            n = min(left, _CHECK_EVERY)
            for done in range(n):
                if pos >= end:
                    raise EOFError
                op = data[pos]
                pos += 1
                if op == _LONG_BINPUT:
                    memo[unpack_from("<I", data, pos)[0]] = stack[-1]
                    pos += 4
                elif op == _BINGET or op == _LONG_BINGET:
                    if op == _BINGET:
                        i = data[pos]
                        pos += 1
                    else:
                        i = unpack_from("<I", data, pos)[0]
                        pos += 4
                    if i >= len(memo) or memo[i] is _HOLE:
                        memo.get(i)  # (raises: not found)
                    append(memo[i])
                elif op == _MEMOIZE:
                    memo.append(stack[-1])
                elif op == _BININT1:
                    append(data[pos])
                    pos += 1
                elif op == _TUPLE2:
                    stack[-2:] = [(stack[-2], stack[-1])]
                elif op == _MARK:
                    self._parked += len(stack)
                    self.metastack.append(stack)
                    self.stack = stack = []
                    self.append = append = stack.append
                elif op == _TUPLE1:
                    stack[-1] = (stack[-1],)
                elif op == _TUPLE:
                    items = stack
                    self.stack = stack = self.metastack.pop()
                    self.append = append = stack.append
                    self._parked -= len(stack)
                    append(tuple(items))
                elif op == _BINUNICODE or op == _SHORT_BINUNICODE:
                    if op == _BINUNICODE:
                        size = unpack_from("<I", data, pos)[0]
                        pos += 4
                    else:
                        size = data[pos]
                        pos += 1
                    if pos + size > end:
                        raise EOFError
                    append(str(data[pos:pos + size], "utf-8", "surrogatepass"))
                    pos += size
                elif op == _EMPTY_TUPLE:
                    append(())
                elif op == _EMPTY_DICT:
                    append({})
                elif op == _NEWFALSE:
                    append(False)
                elif op == _NONE:
                    append(None)
                elif op == _BINPUT:
                    memo[data[pos]] = stack[-1]
                    pos += 1
                elif op == _TUPLE3:
                    stack[-3:] = [(stack[-3], stack[-2], stack[-1])]
                elif op == _FRAME:  # framed (protocol 4+): the standard loop from here
                    file.seek(pos - 1)
                    return left - done  # the FRAME itself is the standard loop's first opcode
                elif op == _BININT2:
                    append(data[pos] | data[pos + 1] << 8)
                    pos += 2
                else:
                    file.seek(pos)
                    dispatch[op](self)  # STOP raises _Stop with the value
                    pos = file.tell()
                    stack = self.stack
                    append = stack.append
            left -= n
            if len(stack) + self._parked + len(self.metastack) + len(memo) > self._max_held:
                self._too_many_held()
        file.seek(pos)
        return left

    def _load_mark(self) -> None:
        self._parked += len(self.stack)
        _pickle._Unpickler.load_mark(self)

    def pop_mark(self) -> list[Any]:
        items = _pickle._Unpickler.pop_mark(self)
        self._parked -= len(self.stack)
        return items

    # Opcodes that hash (dict and set builders) see only shallow keys.
    def _load_setitem(self) -> None:
        check_key(self.stack[-2])
        _pickle._Unpickler.load_setitem(self)

    def _load_setitems(self) -> None:
        check_keys(self.stack[0::2])  # (after MARK the stack holds k1 v1 k2 v2 ...)
        _pickle._Unpickler.load_setitems(self)

    def _load_dict(self) -> None:
        check_keys(self.stack[0::2])
        _pickle._Unpickler.load_dict(self)

    def _load_newobj(self) -> None:
        # NEWOBJ builds the stand-ins of allowlisted classes (DeepSpeed's fragment_address, DCP's records)
        cls = self.stack[-2]
        if not (isinstance(cls, type) and issubclass(cls, StandIn)):
            raise UnsafeCheckpointError(f"{self._path}: refused for safety: its pickle creates "
                                        f"{short_repr(self.stack[-2])} by NEWOBJ; the file was not executed")
        _pickle._Unpickler.load_newobj(self)

    def _load_build(self) -> None:
        # BUILD sets an object's state: only on our stand-ins (never on a TensorRef, once checked).
        # A state dict's attributes (``_metadata``: module versions) are dropped, nothing reads them.
        if type(self.stack[-2]) is collections.OrderedDict:
            self.stack.pop()
            return
        if not isinstance(self.stack[-2], StandIn):
            raise UnsafeCheckpointError(f"{self._path}: refused for safety: its pickle sets the state of a "
                                        f"{type(self.stack[-2]).__name__}; the file was not executed")
        _pickle._Unpickler.load_build(self)

    # The GETs through the list memo's checked lookup (a negative index, a hole: not found)
    def _load_get(self) -> None:
        self.append(self.memo.get(int(self.readline()[:-1])))

    def _load_binget(self) -> None:
        self.append(self.memo.get(self.read(1)[0]))

    def _load_long_binget(self) -> None:
        self.append(self.memo.get(struct.unpack("<I", self.read(4))[0]))

    def _refuse(self) -> NoReturn:
        raise UnsafeCheckpointError(f"{self._path}: refused for safety: its pickle uses a protocol-0/1 "
                                    "or keyword object constructor that torch.save never writes; the file "
                                    "was not executed")

    def find_class(self, module: str, name: str) -> Any:
        asked = f"{module}.{name}"
        # Protocol < 3 (torch.save writes 2) spells builtins the Python 2 way (``__builtin__.set``).
        # The standard unpickler's find_class maps those names, and we replace it, so map them here
        # exactly as it does (fix_imports=True; ``proto``: what the PROTO opcode said, 0 without one).
        if self.proto < 3:
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            elif module in _compat_pickle.IMPORT_MAPPING:
                module = _compat_pickle.IMPORT_MAPPING[module]
        # The allowlist applies to the mapped name: mapping never widens what may be built.
        target = self._allowed.get(module, {}).get(name)
        if target is None:
            raise UnsafeCheckpointError(
                f"{self._path}: refused for safety: its pickle asks for `{asked}`, which is not "
                f"on the allowlist of types this format contains; the file was not executed. "
                "Only export checkpoints you trust through torch.load, or re-save it with plain tensors")
        return target

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent_load is None:
            raise UnsafeCheckpointError(f"{self._path}: refused for safety: unexpected persistent id "
                                        f"{short_repr(pid)}")
        return self._persistent_load(pid)


_OPS = {name: getattr(pickle, name)[0] for name in (
    "LONG_BINPUT", "BINPUT", "BINGET", "BININT1", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "MARK", "BINUNICODE",
    "SHORT_BINUNICODE", "EMPTY_TUPLE", "EMPTY_DICT", "NEWFALSE", "NONE", "FRAME", "LONG_BINGET", "MEMOIZE",
    "BININT2")}
(_LONG_BINPUT, _BINPUT, _BINGET, _BININT1, _TUPLE, _TUPLE1, _TUPLE2, _TUPLE3, _MARK, _BINUNICODE, _SHORT_BINUNICODE,
 _EMPTY_TUPLE, _EMPTY_DICT, _NEWFALSE, _NONE, _FRAME, _LONG_BINGET, _MEMOIZE, _BININT2) = _OPS.values()


def _hashed_items(real: Callable[["_Unpickler"], None]) -> Callable[["_Unpickler"], None]:
    def load(self: "_Unpickler") -> None:  # set builders: every element on the (marked) stack gets hashed
        check_keys(self.stack)
        real(self)
    return load


_D = _pickle._Unpickler.dispatch
_Unpickler._dispatch = {
    **_D,
    pickle.SETITEM[0]: _Unpickler._load_setitem,
    pickle.SETITEMS[0]: _Unpickler._load_setitems,
    pickle.DICT[0]: _Unpickler._load_dict,
    pickle.ADDITEMS[0]: _hashed_items(_D[pickle.ADDITEMS[0]]),
    pickle.FROZENSET[0]: _hashed_items(_D[pickle.FROZENSET[0]]),
    pickle.MARK[0]: _Unpickler._load_mark,
    pickle.NEWOBJ[0]: _Unpickler._load_newobj,
    pickle.BUILD[0]: _Unpickler._load_build,
    pickle.GET[0]: _Unpickler._load_get,
    pickle.BINGET[0]: _Unpickler._load_binget,
    pickle.LONG_BINGET[0]: _Unpickler._load_long_binget,
    pickle.NEWOBJ_EX[0]: _Unpickler._refuse,
    pickle.OBJ[0]: _Unpickler._refuse,
    pickle.INST[0]: _Unpickler._refuse,
}
del _D


def load_pickle(path: "str | os.PathLike[str]", *, allowed: Allowlist) -> Any:
    """Unpickle a plain pickle file (not a torch zip: torch DCP's ``.metadata``) safely, with the
    allowlist ``allowed``; same budgets and refusals as :func:`loads`, no persistent ids."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_PICKLE_BYTES + 1)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e}); check the path and permissions") from e
    if not data:
        raise CheckpointError(f"{path}: empty file (0 bytes); the save was interrupted, "
                              "use an earlier checkpoint or copy it again")
    if len(data) > MAX_PICKLE_BYTES:
        raise CheckpointError(f"{path}: over {MAX_PICKLE_BYTES} bytes, more metadata than hf-ckpt reads (torch DCP "
                              "reaches it at ~3.8M chunks: a 45,000-tensor MoE sharded over ~85 ranks); a real "
                              "checkpoint this large: please report it; otherwise the file is corrupt or crafted")
    return loads(data, path=path, allowed=allowed)


def loads(data: bytes, *, path: str, allowed: Allowlist, where: Optional[str] = None,
          persistent_load: Optional[Callable[[Any], Any]] = None) -> Any:
    """Unpickle ``data`` (read from ``path``; ``where``: how messages name it, ``path`` by default)
    with the allowlist ``allowed`` (module -> name -> stand-in) and, for a pickle that refers to
    data outside it (torch's storages), ``persistent_load``; then walk the tree within the budgets.

    Raises :class:`UnsafeCheckpointError` for a global not on the list, :class:`CheckpointError`
    for a malformed pickle or one over a budget, each naming ``where``.
    """
    return load_stream(io.BytesIO(data), path=path, allowed=allowed, where=where, persistent_load=persistent_load,
                       size=len(data))


def load_stream(file: PickleInput, *, path: str, allowed: Allowlist, where: Optional[str] = None,
                persistent_load: Optional[Callable[[Any], Any]] = None, size: int = 0) -> Any:
    """:func:`loads` of the pickle that starts at ``file``'s position (``read(n)``/``readline()``;
    it bounds its own reads). Reads up to its STOP opcode and no further: a file of several pickles
    (torch.save's legacy format) is read one after another, without finding their ends first.
    ``size``: the pickle's bytes, when it is all in memory (:func:`loads`): its budgets grow with it."""
    where = path if where is None else where
    try:
        with gc_paused():
            unpickler = _Unpickler(file, path, allowed, persistent_load, size)
            obj = unpickler.load()
            _check_tree(obj, where, unpickler.max_nodes)
        return obj
    except CheckpointError as e:
        if str(e).startswith(path):
            raise
        raise type(e)(f"{where}: {e}; the file is corrupt or crafted: copy it again from the training "
                      "run") from None
    except Exception as e:  # malformed pickles raise a zoo of types
        raise CheckpointError(f"{where}: corrupt pickle ({type(e).__name__}: {_ERR_REPR.repr(e.args)}); "
                              "copy it again from the training run") from None


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector paused while metadata is read: a pickle makes millions of objects
    that all live on (no cycles among them), and Python's collector walked them again and again: over
    half the CPU time of unpickling a 45,395-DTensor rank file (1.9 s of it with the collector, 0.8 s
    without, in the C unpickler; 3.3 -> 1.9 s in ours). Nests; restores the collector as it was."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


_ERR_REPR = reprlib.Repr()
_ERR_REPR.maxlevel, _ERR_REPR.maxstring, _ERR_REPR.maxother = 2, 200, 60


def _children(node: Any) -> Iterable[Any]:
    t = type(node)
    if t in ATOMS or isinstance(node, Leaf):
        return ()
    if t in (dict, collections.OrderedDict):
        return [*node.keys(), *node.values()]
    if t in (list, tuple, set, frozenset):
        return node
    if isinstance(node, Record):
        return (node.state,)
    if isinstance(node, StandIn):
        return vars(node).values()
    if t is slice:
        return (node.start, node.stop, node.step)
    return ()  # (other stand-ins, str subclasses and StorageRef, hold nothing from the file)


def _small(node: Any) -> bool:
    """Whether ``node``'s tree, walked as :func:`_check_tree` walks it, has at most :data:`SHARED_SMALL` nodes."""
    todo, count = [node], 0
    while todo:
        count += 1
        if count > SHARED_SMALL:
            return False
        todo.extend(_children(todo.pop()))
    return True


_ATOM_TYPES = frozenset(ATOMS)


def _check_tree(obj: Any, path: str, max_nodes: int) -> None:
    """Walk the loaded tree once, level by level, within the budgets. A shared node is counted each time
    it is reached (so a DAG or a cycle that a later walk would expand runs out of budget here), except a
    stand-in of at most :data:`SHARED_SMALL` nodes reached again: its tree counts once and each further
    reference 1 (torch pickles one DeviceMesh, ~70 nodes, that every DTensor of a rank file refers to:
    a DeepSeek-V3 rank file counted 3.9M nodes the old way, 0.7M this way). Readers take fields of a
    stand-in by name, so a later walk does at most that much work per reference."""
    level, depth, count = [obj], 0, 0
    once: set[int] = set()  # stand-ins reached once
    small: set[int] = set()  # shared stand-ins whose tree is small: not walked again
    while level:
        if depth > MAX_DEPTH:
            raise CheckpointError(f"{path}: its pickle nests deeper than {MAX_DEPTH} levels; no checkpoint "
                                  "does that: the file is corrupt or crafted")
        count += len(level)
        below: list[Any] = []
        for node in level:
            t = type(node)
            if t in _ATOM_TYPES:  # (counted above; the common case, taken before any call)
                continue
            if t is tuple or t is list:
                below.extend(node)
            else:
                if isinstance(node, StandIn) and not isinstance(node, Leaf):
                    key = id(node)
                    if key in small:
                        continue
                    if key in once and _small(node):
                        small.add(key)
                        continue
                    once.add(key)
                below.extend(_children(node))
            if count + len(below) > max_nodes:
                raise CheckpointError(f"{path}: its pickle describes over {max_nodes} objects (counting shared "
                                      "ones each time they are used); no checkpoint's metadata is that large: "
                                      "the file is corrupt or crafted")
        level, depth = below, depth + 1
