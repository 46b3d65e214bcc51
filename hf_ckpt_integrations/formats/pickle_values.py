"""What a checkpoint's pickle may hold, as inert values: the stand-ins the restricted unpickler
(:mod:`.unpickler`) builds instead of the classes a pickle names, and the allowlists shared by every
reader (:data:`CONTAINERS`, :data:`CLIENT_STATE`). Nothing here imports or calls what a pickle names."""

import collections
from typing import Any, Iterable, Optional

from ..errors import CheckpointError, UnsafeCheckpointError, short_repr

_MAX_KEY_LEN = 16  # a tuple used as a dict key or set element: this many atoms at most


class StandIn:
    """Base of the inert stand-ins an allowlist may name for a class: only these may be created
    (NEWOBJ) and have their state set (BUILD); the loaded tree's walk counts what they hold."""

    __slots__ = ()  # (a subclass without __slots__ of its own keeps a __dict__)


class Leaf:
    """Base of values a reader builds that hold nothing from the pickle (a tensor reference):
    counted, never walked."""


class Opaque(StandIn):
    """Inert stand-in for an allowlisted object whose content is plain data (e.g. LossScaler)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"Opaque({self.__dict__!r})"


class Record(StandIn):
    """Inert stand-in for an allowlisted plain-data class of another library's pickle (torch DCP's
    ``Metadata``, ``ChunkStorageMetadata``...): NEWOBJ makes an empty one, BUILD stores the pickled
    state as ``state`` (a dict of fields, or the tuple a ``__getstate__`` returned). Nothing else
    runs. Hashed by identity, so a record may key a dict (DCP's ``MetadataIndex``) without the
    unpickler hashing anything it read. Make one type per class with :func:`record_type`."""

    kind = "Record"
    # No per-instance __dict__: DCP metadata holds 3-4 records per chunk (~25 MB of dicts per 100k chunks)
    __slots__ = ("state",)

    def __new__(cls, *args: Any) -> "Record":  # NEWOBJ calls only this; a record never BUILT has state None
        self = super().__new__(cls)
        self.state = None
        return self

    def __init__(self, *args: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def field(self, name: str, default: Any = None) -> Any:
        """Field ``name`` of a dict state (``default`` when absent or the state is not a dict)."""
        return self.state.get(name, default) if type(self.state) is dict else default

    def __repr__(self) -> str:
        return f"{self.kind}({short_repr(self.state)})"


def record_type(name: str) -> type:
    """A :class:`Record` subclass named ``name``, for one allowlisted class."""
    return type(name, (Record,), {"kind": name, "__slots__": ()})


def check_key(key: object) -> None:
    """Dict keys and set elements get hashed (and compared): only atoms, or short tuples of atoms —
    hashing a nested tuple DAG takes 2^depth steps."""
    if type(key) in ATOMS or isinstance(key, Record):
        return
    if type(key) is tuple and len(key) <= _MAX_KEY_LEN and all(type(k) in ATOMS for k in key):
        return
    raise CheckpointError(f"a dict key or set element of type {type(key).__name__} "
                          f"({short_repr(key)}); checkpoints key by names and numbers only")


ATOMS = (str, int, float, bool, bytes, type(None))


def check_keys(keys: Iterable[object]) -> None:
    for k in keys:
        check_key(k)


def _guarded_set(iterable: Iterable[Any] = ()) -> set[Any]:
    items = list(iterable)
    check_keys(items)
    return set(items)


def _guarded_frozenset(iterable: Iterable[Any] = ()) -> frozenset[Any]:
    items = list(iterable)
    check_keys(items)
    return frozenset(items)


def _guarded_ordered_dict(*args: Any) -> "collections.OrderedDict[Any, Any]":
    if len(args) > 1:
        raise CheckpointError("OrderedDict with more than one argument")
    out: collections.OrderedDict[Any, Any] = collections.OrderedDict()
    for pair in (list(args[0]) if args else ()):
        if type(pair) not in (tuple, list) or len(pair) != 2:
            raise CheckpointError("OrderedDict built from something other than pairs")
        check_key(pair[0])
        out[pair[0]] = pair[1]
    return out



# Plain containers: what every torch pickle may use (module -> name -> stand-in).
CONTAINERS = {
    "collections": {"OrderedDict": _guarded_ordered_dict},
    "builtins": {"set": _guarded_set, "frozenset": _guarded_frozenset, "slice": slice},
}


# Client state: what training loops save beside the weights (DeepSpeed's ``client_state``, Megatron's
# model_optim_rng.pt). GPT-NeoX's save_ds_checkpoint and Megatron-(DeepSpeed)'s save_checkpoint store
# ``random.getstate()`` (plain tuples), ``np.random.get_state()`` (a numpy uint32 array), torch RNG
# ByteTensors, ``args`` as an ``argparse.Namespace`` (holding torch dtypes, paths, Megatron enums) and
# floats; nothing here reads any of it, so each is rebuilt as an inert record of what the pickle says
# (no numpy import, no constructor called) and the weights beside it are read as usual.
class NumpyDtype(StandIn):
    """A numpy dtype as pickled: ``numpy.dtype(descr, align, copy)`` then its state (byte order, fields...)."""

    def __init__(self, descr: Any, align: Any = False, copy: Any = False) -> None:
        if type(descr) is not str or len(descr) > 32 or type(align) is not bool or type(copy) is not bool:
            raise CheckpointError(f"numpy.dtype{short_repr((descr, align, copy))} is not a dtype")
        self.descr, self.state = descr, None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"numpy.dtype({self.descr!r})"


class NumpyArray(StandIn):
    """A numpy array as pickled (``_reconstruct(ndarray, (0,), b'b')`` then its state ``(version,
    shape, dtype, fortran, raw bytes)``): the raw bytes are kept, never interpreted."""

    def __init__(self) -> None:
        self.shape: Optional[tuple[int, ...]] = None
        self.dtype: Optional[NumpyDtype] = None
        self.data: Any = None

    def __setstate__(self, state: Any) -> None:
        if not (type(state) is tuple and len(state) == 5 and isinstance(state[2], NumpyDtype)
                and type(state[1]) is tuple and len(state[1]) <= 64
                and all(type(d) is int and d >= 0 for d in state[1])):
            raise CheckpointError(f"a numpy array with the state {short_repr(state)}; the file is corrupt or crafted")
        _version, self.shape, self.dtype, _fortran, self.data = state

    def __repr__(self) -> str:
        return f"numpy.ndarray(shape={self.shape}, dtype={self.dtype!r})"


class NumpyScalar(StandIn):
    """A numpy scalar (``np.float32(1.5)``) as pickled: ``scalar(dtype, raw bytes)``."""

    def __init__(self, dtype: Any = None, data: Any = None) -> None:
        if not isinstance(dtype, NumpyDtype):
            raise CheckpointError(f"a numpy scalar of {short_repr(dtype)}, not of a dtype; the file is corrupt")
        self.dtype, self.data = dtype, data

    def __repr__(self) -> str:
        return f"numpy.{self.dtype.descr}({self.data!r})"


class EnumMember(StandIn):
    """A member of an allowlisted enum, as pickled (the class called with its value): the value only."""

    kind = "Enum"

    def __init__(self, value: Any = None) -> None:
        if type(value) not in ATOMS:
            raise CheckpointError(f"{self.kind}({short_repr(value)}): an enum member is a name or a number")
        self.value = value

    def __repr__(self) -> str:
        return f"{self.kind}({self.value!r})"


def _enum_type(name: str) -> type:
    return type(name, (EnumMember,), {"kind": name})


_NDARRAY = object()  # what ``numpy.ndarray`` stands for: only _reconstruct may take it


def _np_reconstruct(cls: Any, shape: Any, typecode: Any) -> NumpyArray:
    # numpy's own arguments are always (ndarray, (0,), b'b'); anything else (another class, a callable
    # the pickle hands over) is not a plain array
    if cls is not _NDARRAY or shape != (0,) or typecode != b"b":
        raise UnsafeCheckpointError(f"refused for safety: numpy's _reconstruct called with "
                                    f"{short_repr((cls, shape, typecode))}, not a plain array")
    return NumpyArray()


def _latin1(text: Any, encoding: Any) -> bytes:
    # protocol 2 spells bytes as _codecs.encode(str, "latin1"); nothing else is needed
    if type(text) is not str or encoding not in ("latin1", "latin-1"):
        raise UnsafeCheckpointError(f"refused for safety: _codecs.encode{short_repr((text, encoding))}")
    return text.encode("latin-1")


def _path(*parts: Any) -> str:
    if len(parts) > 4096 or not all(type(x) is str for x in parts):
        raise CheckpointError(f"a path of {short_repr(parts)}, not of names")
    return "/".join(x.rstrip("/") for x in parts) if parts else "."


_NUMPY_CORE = {"_reconstruct": _np_reconstruct, "scalar": NumpyScalar}
_PATHS = {n: _path for n in ("Path", "PosixPath", "PurePath", "PurePosixPath", "WindowsPath", "PureWindowsPath")}

# module -> name -> stand-in, for client state (see above). numpy 1 pickles ``numpy.core.multiarray``,
# numpy 2 ``numpy._core.multiarray``; Python 3.13 pickles paths as ``pathlib._local``.
CLIENT_STATE = {
    "numpy": {"ndarray": _NDARRAY, "dtype": NumpyDtype},
    "numpy.core.multiarray": _NUMPY_CORE,
    "numpy._core.multiarray": _NUMPY_CORE,
    "_codecs": {"encode": _latin1},
    "argparse": {"Namespace": Opaque},
    "types": {"SimpleNamespace": Opaque},
    "pathlib": _PATHS,
    "pathlib._local": _PATHS,
    # Megatron's args: args.model_type (ModelType), args.attention_backend (AttnBackend)
    "megatron.model.enums": {"ModelType": _enum_type("ModelType")},
    "megatron.core.enums": {"ModelType": _enum_type("ModelType")},
    "megatron.core.transformer.enums": {"AttnBackend": _enum_type("AttnBackend"),
                                        "ModelType": _enum_type("ModelType")},
}
