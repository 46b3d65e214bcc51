"""Mutated checkpoint files (zip bytes, pickled metadata values, the tree's structure, pickle opcodes)
either export what ``verify`` accepts or are refused: never a traceback, a hang or a wrong tensor.
``HFCKPT_FUZZ_EXAMPLES=N`` runs N cases per strategy (``make fuzz``); tests/trust/test_fuzz_*.py hold more.
"""

import collections
import enum
import io
import os
import pickle
import pickletools
import shutil
import struct
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from helpers import leftovers, tree_digest
from fuzz_bounds import Hang, exported_tensors, time_limit  # noqa: E402

# ---------------------------------------------------------------- fuzzing

hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hf_ckpt_integrations.cli import main as cli_main  # noqa: E402
from hf_ckpt_integrations.formats.dtypes import SIZES as DTYPE_SIZES  # noqa: E402
from hf_ckpt_integrations.sources import build_plan  # noqa: E402


TAG = "global_step2"


FUZZ_EXAMPLES = int(os.environ.get("HFCKPT_FUZZ_EXAMPLES", "0")) or None


CASE_TIMEOUT_S = 30  # one fuzz case (export + verify of a 0.4 MB model); longer is a hang


_FILES = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
          "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
# ZeRO-3: per-rank model states (each tensor's pieces as one StridedPieces, issue 39) and optimizer partitions
_FILES_Z3 = [f"zero_pp_rank_{r}_mp_rank_00_{k}_states.pt" for r in (0, 1) for k in ("model", "optim")]


_SOURCE_DAMAGE = "fails its CRC-32 check"


_MODULE_MISMATCH = "differ from the module weights it also holds"


_Hang, _time_limit, _tensors = Hang, time_limit, exported_tensors


def _structure_offsets(path):
    """Byte offsets of the zip's own structure: local headers, data descriptors, central directory."""
    data = Path(path).read_bytes()
    out = set(range(max(0, len(data) - 22), len(data)))
    with zipfile.ZipFile(path) as zf:
        out.update(range(zf.start_dir, len(data)))
        for info in zf.infolist():
            h = info.header_offset
            name_len, extra_len = struct.unpack("<HH", data[h + 26:h + 30])
            out.update(range(h, h + 30 + name_len + extra_len))
            end = h + 30 + name_len + extra_len + info.compress_size
            out.update(range(end, min(end + 24, len(data))))
    return sorted(out)


class _Fuzz:
    """One working copy of an engine case (ZeRO-2 unless told), restored before each example, and the
    original export."""

    def __init__(self, case, root, files=tuple(_FILES)):
        self.files = list(files)
        self.orig, self.config = case / "ckpt", case / "config"
        self.src = root / "src"
        shutil.copytree(self.orig, self.src)
        self.root = root
        self.count = 0
        self.outcomes = collections.Counter()  # strategy/outcome -> cases (printed at the end)
        ref = root / "ref"
        assert cli_main(["export", str(self.orig), str(ref), "--config", str(self.config), "--quiet"]) == 0
        self.reference = _tensors(ref)
        plan = build_plan(str(self.orig), config=str(self.config))
        # name -> [(file basename, first byte, end byte)] of every source range the tensor is built from
        self.ranges = {}
        for t in plan.tensors:
            pieces = [p for part in t.parts for p in part] + [p for r in (t.replicas or []) for p in r]
            self.ranges[t.name] = [(os.path.basename(p.path), p.offset, p.offset + p.numel * DTYPE_SIZES[p.dtype])
                                   for p in pieces]
        self.pristine = {f: (self.orig / TAG / f).read_bytes() for f in self.files}
        self.structure = {f: _structure_offsets(self.orig / TAG / f) for f in self.files}

    def restore(self):
        for f, data in self.pristine.items():
            p = self.src / TAG / f
            if p.read_bytes() != data:
                p.write_bytes(data)

    def run(self, touched, capsys):
        """Export the mutated copy and check the outcome; ``touched``: {file: byte offsets} changed in
        tensor data (tensors built from those bytes may differ from the original, and only those)."""
        self.count += 1
        dst = self.root / f"out{self.count}"
        before = tree_digest(self.src)
        capsys.readouterr()
        with _time_limit(CASE_TIMEOUT_S):
            rc = cli_main(["export", str(self.src), str(dst), "--config", str(self.config), "--quiet"])
            err = capsys.readouterr().err
            assert tree_digest(self.src) == before, "the source changed"
            if rc == 2:
                lines = err.strip().splitlines()
                assert len(lines) == 1 and lines[0].startswith("error: "), err
                assert not dst.exists() and not leftovers(self.root)
                self.outcomes["refused"] += 1
                return "refused"
            assert rc == 0, err
            vrc = cli_main(["verify", str(dst), "--against", str(self.src)])
            out = capsys.readouterr().out
            flagged = vrc == 1 and all(_SOURCE_DAMAGE in line or _MODULE_MISMATCH in line
                                       for line in out.splitlines() if line.startswith("differs:"))
            # (verify also proves the source itself: a damaged or shifted byte the export's sampled
            # checks did not read is reported as such, while the export must still be right)
            assert vrc == 0 or flagged, out
            self.outcomes["verify flagged the source"] += flagged
        got = _tensors(dst)
        assert set(got) == set(self.reference), "exported other tensors than the original"
        for name, value in got.items():
            if value != self.reference[name]:
                hit = any(lo <= off < hi for f, lo, hi in self.ranges[name] for off in touched.get(f, ()))
                assert hit, f"{name} differs from the original but none of its source bytes was mutated"
        shutil.rmtree(dst)
        self.outcomes["exported"] += 1
        return "exported"


@pytest.fixture(scope="module")
def fuzz(engine_ckpt, tmp_path_factory):
    f = _Fuzz(engine_ckpt("z2-fp32"), tmp_path_factory.mktemp("fuzz"))
    yield f
    # (a crash, hang, traceback or wrong export fails its test: these are the cases that passed)
    print(f"\nfuzz outcomes: {dict(f.outcomes)} in {f.count} cases", file=sys.__stderr__)


_SETTINGS = dict(deadline=None, database=None, derandomize=FUZZ_EXAMPLES is None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                        HealthCheck.data_too_large])


@settings(max_examples=FUZZ_EXAMPLES or 250, **_SETTINGS)
@given(data=st.data())
def test_fuzz_zip_bytes(fuzz, capsys, data):
    """1-3 bytes changed, anywhere in a file or in its zip structure (headers, central directory)."""
    fuzz.restore()
    name = data.draw(st.sampled_from(_FILES), label="file")
    path = fuzz.src / TAG / name
    raw = bytearray(fuzz.pristine[name])
    structure = fuzz.structure[name]
    where = st.one_of(st.integers(0, len(raw) - 1), st.sampled_from(structure))
    edits = data.draw(st.lists(st.tuples(where, st.integers(0, 255)), min_size=1, max_size=3), label="edits")
    for off, value in edits:
        raw[off] = value
    path.write_bytes(bytes(raw))
    # Bytes inside a tensor's data are copied faithfully (see docs/reliability.md); structure bytes never
    # may change a tensor.
    touched = {name: {off for off, _ in edits if off not in set(structure)}}
    fuzz.run(touched, capsys)


def _leaves(obj, path=(), depth=0):
    """Paths to every value in the pickled tree (dict keys, list items, object attributes)."""
    yield path
    if depth > 6:
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, path + (k,), depth + 1)
    elif isinstance(obj, list):  # (tuples are replaced whole)
        for i, v in enumerate(obj):
            yield from _leaves(v, path + (i,), depth + 1)
    elif isinstance(obj, torch.Size):
        for i in range(len(obj)):
            yield path + (i,)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.Tensor, enum.Enum, type)):
        # (an Enum member is a process-wide singleton: never mutate one)
        for k, v in vars(obj).items():
            yield from _leaves(v, path + (("attr", k),), depth + 1)


def _get(obj, key):
    if isinstance(key, tuple) and key[:1] == ("attr",):
        return getattr(obj, key[1])
    return obj[key]


def _set(parent, key, value):
    if isinstance(key, tuple) and key[:1] == ("attr",):
        setattr(parent, key[1], value)
    elif isinstance(parent, torch.Size):
        raise TypeError
    else:
        parent[key] = value


_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.integers(-2**40, 2**40), st.floats(allow_nan=True),
    st.text(max_size=4), st.just([]), st.just({}), st.lists(st.integers(-2, 70000), max_size=3),
    st.builds(lambda n, dt: torch.zeros(n, dtype=dt), st.integers(0, 5), st.sampled_from([torch.float32, torch.bfloat16,
                                                                                       torch.int64])),
)


@pytest.fixture(scope="module")
def fuzz_z3(engine_ckpt, tmp_path_factory):
    f = _Fuzz(engine_ckpt("z3-fp32"), tmp_path_factory.mktemp("fuzz-z3"), _FILES_Z3)
    yield f
    print(f"\nfuzz (ZeRO-3) outcomes: {dict(f.outcomes)} in {f.count} cases", file=sys.__stderr__)


@settings(max_examples=FUZZ_EXAMPLES or 150, **_SETTINGS)
@given(data=st.data())
def test_fuzz_pickled_metadata(fuzz, capsys, data):
    """One value of the pickled tree replaced (or its key deleted, or an int nudged), file re-saved."""
    _mutate_pickled_metadata(fuzz, capsys, data)


@settings(max_examples=FUZZ_EXAMPLES or 80, **_SETTINGS)
@given(data=st.data())
def test_fuzz_pickled_metadata_zero3(fuzz_z3, capsys, data):
    """The same on a ZeRO-3 save: shapes, partition counts and offsets that the lazily made pieces
    (``boxes.StridedPieces``) are computed from."""
    _mutate_pickled_metadata(fuzz_z3, capsys, data)


def _mutate_pickled_metadata(fuzz, capsys, data):
    fuzz.restore()
    name = data.draw(st.sampled_from(fuzz.files), label="file")
    path = fuzz.src / TAG / name
    obj = torch.load(path, map_location="cpu", weights_only=False)
    paths = [p for p in _leaves(obj) if p]
    target = data.draw(st.sampled_from(paths), label="path")
    parent = obj
    for key in target[:-1]:
        parent = _get(parent, key)
    if isinstance(parent, torch.Size):  # shapes are immutable: rebuild the Size one level up
        grand = obj
        for key in target[:-2]:
            grand = _get(grand, key)
        dims = list(parent)
        dims[target[-1]] = data.draw(st.integers(-1, 5000), label="dim")
        _set(grand, target[-2], torch.Size(dims) if all(d >= 0 for d in dims) else dims)
    else:
        old = _get(parent, target[-1])
        op = data.draw(st.sampled_from(["replace", "delete", "nudge"]), label="op")
        if op == "delete" and isinstance(parent, dict):
            del parent[target[-1]]
        elif op == "nudge" and isinstance(old, int) and not isinstance(old, bool):
            _set(parent, target[-1], old + data.draw(st.sampled_from([-2, -1, 1, 2, 64]), label="delta"))
        else:
            _set(parent, target[-1], data.draw(_VALUES, label="value"))
    torch.save(obj, path)
    # Metadata never carries tensor bytes: every exported tensor must equal the original one.
    fuzz.run({}, capsys)


# ---------------------------------------------------------------- structure-aware fuzzing (issue 13)
#
# The tree of a pickle (types, depth, sizes, sharing) and the pickle's own opcodes, mutated: what a
# few hundred hostile bytes can describe. Every case stays under the per-case time and memory caps.

def _dag(levels, kind):
    x = [] if kind is list else ()
    for _ in range(levels):
        x = kind([x, x])
    return x


def _nest(value, depth, kind):
    for _ in range(depth):
        value = {"k": value} if kind is dict else kind([value])
    return value


def _cycle():
    x = []
    x.append(x)
    return x


def _structural(data, old):
    """A structural replacement for ``old``: nesting, sharing, cycles, sizes, types, tensor views."""
    op = data.draw(st.sampled_from(["nest", "dag", "cycle", "grow", "retype", "tensor", "key"]), label="structure")
    if op == "nest":
        return _nest(old, data.draw(st.integers(1, 300), label="depth"),
                     data.draw(st.sampled_from([list, tuple, dict]), label="kind"))
    if op == "dag":
        return _dag(data.draw(st.integers(1, 70), label="levels"), data.draw(st.sampled_from([list, tuple])))
    if op == "cycle":
        return _cycle()
    if op == "grow":
        n = data.draw(st.sampled_from([2, 100, 10_000, 200_000]), label="size")
        return [old] * n if data.draw(st.booleans()) else {f"k{i}": old for i in range(min(n, 10_000))}
    if op == "retype":
        conv = data.draw(st.sampled_from(["list", "tuple", "set", "str", "float", "bool", "dict"]), label="to")
        try:
            if conv == "dict" and isinstance(old, (list, tuple)):
                return dict(enumerate(old))
            if conv == "set":
                return set(old) if isinstance(old, (list, tuple, dict)) else {old}
            return {"list": list, "tuple": tuple, "str": str, "float": float, "bool": bool,
                    "dict": lambda v: {"v": v}}[conv](old)
        except (TypeError, ValueError, RuntimeError):  # (no such conversion: wrap it instead)
            return [old]
    if op == "key":  # a dict keyed by a shared tuple (hashing it is 2^levels): small levels only here
        return {_dag(data.draw(st.integers(1, 16), label="key levels"), tuple): old}
    if isinstance(old, torch.Tensor) and old.numel() > 1:
        view = data.draw(st.sampled_from(["tail", "flat", "t", "extra dim", "bf16", "strided"]), label="view")
        flat = old.reshape(-1)
        return {"tail": lambda: flat[1:], "flat": lambda: flat, "t": lambda: old.reshape(-1, 1).t(),
                "extra dim": lambda: old[None], "bf16": lambda: old.to(torch.bfloat16),
                "strided": lambda: flat[::2]}[view]()
    return torch.zeros(data.draw(st.integers(0, 3)), dtype=torch.float32)


@settings(max_examples=FUZZ_EXAMPLES or 120, **_SETTINGS)
@given(data=st.data())
def test_fuzz_tree_structure(fuzz, capsys, data):
    """One node of the unpickled tree replaced by a structural mutation of it (deep nesting, a DAG, a
    cycle, a huge container, another type, a view of a tensor), then torch.save again."""
    _mutate_tree(fuzz, capsys, data)


@settings(max_examples=FUZZ_EXAMPLES or 40, **_SETTINGS)
@given(data=st.data())
def test_fuzz_tree_structure_zero3(fuzz_z3, capsys, data):
    _mutate_tree(fuzz_z3, capsys, data)


def _mutate_tree(fuzz, capsys, data):
    fuzz.restore()
    name = data.draw(st.sampled_from(fuzz.files), label="file")
    path = fuzz.src / TAG / name
    obj = torch.load(path, map_location="cpu", weights_only=False)
    target = data.draw(st.sampled_from([p for p in _leaves(obj) if p]), label="path")
    parent = obj
    for key in target[:-1]:
        parent = _get(parent, key)
    if isinstance(parent, torch.Size):
        return
    _set(parent, target[-1], _structural(data, _get(parent, target[-1])))
    torch.save(obj, path)
    fuzz.outcomes["tree"] += 1
    fuzz.run({}, capsys)


_INT_OPS = {"BININT1": (0, 255), "BININT2": (0, 65535), "BININT": (-2**31, 2**31 - 1)}


def _encode_int(value):
    return pickle.dumps(value, protocol=2)[2:-1]


def _opcode_mutation(data, pkl: bytes) -> bytes:
    """One mutation of the opcode stream: an integer argument (storage offsets, sizes, strides, numels,
    ranks), a memo reference redirected (sharing, cycles), an opcode deleted, duplicated or replaced,
    or a value replaced by a shared-tuple DAG / deep nesting written as raw opcodes."""
    ops = list(pickletools.genops(pkl))
    bounds = [pos for _, _, pos in ops] + [len(pkl)]
    i = data.draw(st.integers(0, len(ops) - 2), label="op index")  # (never the final STOP)
    op, arg, pos = ops[i]
    end = bounds[i + 1]
    how = data.draw(st.sampled_from(["int", "memo", "delete", "duplicate", "opcode", "dag", "nest"]), label="how")
    if how == "int" or (how == "memo" and op.name not in ("BINGET", "LONG_BINGET")):
        ints = [(j, o) for j, (o, _, _) in enumerate(ops[:-1]) if o.name in _INT_OPS]
        if not ints:
            return pkl
        j, o = data.draw(st.sampled_from(ints), label="int op")
        value = data.draw(st.one_of(st.integers(-3, 3), st.sampled_from([2**31 - 1, -2**31, 2**40, 4064, 4063, 4065]),
                                    st.integers(-2**20, 2**20)), label="int")
        pos, end = ops[j][2], bounds[j + 1]
        return pkl[:pos] + _encode_int(value) + pkl[end:]
    if how == "memo":
        target = data.draw(st.integers(0, max(1, i)), label="memo")
        return pkl[:pos] + b"j" + target.to_bytes(4, "little") + pkl[end:]
    if how == "delete":
        return pkl[:pos] + pkl[end:]
    if how == "duplicate":
        return pkl[:end] + pkl[pos:end] + pkl[end:]
    if how == "opcode":
        return pkl[:pos] + bytes([data.draw(st.sampled_from(sorted(pickle._Unpickler.dispatch)))]) + pkl[pos + 1:]
    if op.name not in ("NONE", "NEWTRUE", "NEWFALSE", "BININT1", "BININT2", "BININT", "BINFLOAT", "EMPTY_TUPLE",
                       "EMPTY_LIST", "EMPTY_DICT"):
        return pkl
    if how == "dag":  # x_{k+1} = (x_k, x_k) through memo slots clear of the pickler's own
        body = b")"
        for k in range(data.draw(st.integers(1, 100), label="levels")):
            slot = (100_000 + k).to_bytes(4, "little")
            body += b"r" + slot + b"j" + slot + b"\x86"  # LONG_BINPUT, LONG_BINGET, TUPLE2
        return pkl[:pos] + body + pkl[end:]
    depth = data.draw(st.sampled_from([10, 99, 101, 1000, 100_000]), label="depth")
    return pkl[:pos] + b")" + b"\x85" * depth + pkl[end:]


def _replace_pickle(path, pkl: bytes):
    """Rewrite a torch zip with another data.pkl, every other entry as it was (stored, same names)."""
    with zipfile.ZipFile(path) as zf:
        entries = [(i, zf.read(i)) for i in zf.infolist()]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as out:
        for info, payload in entries:
            out.writestr(info.filename, pkl if info.filename.endswith("data.pkl") else payload)
    Path(path).write_bytes(buf.getvalue())


@settings(max_examples=FUZZ_EXAMPLES or 150, **_SETTINGS)
@given(data=st.data())
def test_fuzz_pickle_opcodes(fuzz, capsys, data):
    """The data.pkl opcode stream itself mutated (see ``_opcode_mutation``), the zip rebuilt around it."""
    _mutate_opcodes(fuzz, capsys, data)


@settings(max_examples=FUZZ_EXAMPLES or 40, **_SETTINGS)
@given(data=st.data())
def test_fuzz_pickle_opcodes_zero3(fuzz_z3, capsys, data):
    _mutate_opcodes(fuzz_z3, capsys, data)


def _mutate_opcodes(fuzz, capsys, data):
    fuzz.restore()
    name = data.draw(st.sampled_from(fuzz.files), label="file")
    path = fuzz.src / TAG / name
    with zipfile.ZipFile(path) as zf:
        pkl = zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))
    _replace_pickle(path, _opcode_mutation(data, pkl))
    fuzz.outcomes["opcodes"] += 1
    fuzz.run({}, capsys)
