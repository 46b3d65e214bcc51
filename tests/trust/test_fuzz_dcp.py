"""Fuzz of torch DCP ``.metadata``: one value of the pickled ``Metadata`` tree replaced, deleted,
nudged or made structurally hostile (nesting, sharing, cycles, sizes), the file re-pickled, then
``export``: it must exit 0 with an export equal to the original one, or exit 2 with exactly one
``error:`` line and nothing written; never exit 3, a traceback, a hang or a wrong export.

The source is a tiny Llama saved as FileSystemWriter lays a sharded save (tests/support/dcp_build.py):
rows for some tensors, 2-D blocks for others, chunks spread over two ``.distcp`` files, the tied
``lm_head`` held beside the embedding. ``planner_data`` (which names the model's tensors) is left
alone: renaming a tensor there is an export of other names, a question for the config check, not a
wrong byte. ``HFCKPT_FUZZ_EXAMPLES=N`` runs N cases per strategy (``make fuzz``); by default a few
dozen derandomized ones.
"""

import collections
import dataclasses
import os
import pickle
import shutil
import sys

import pytest
import torch

from dcp_build import grid, tiny_llama, write_dcp  # noqa: E402

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hf_ckpt_integrations.cli import main as cli_main  # noqa: E402
from helpers import tree_digest  # noqa: E402
from fuzz_bounds import Hang, exported_tensors, time_limit  # noqa: E402

FUZZ_EXAMPLES = int(os.environ.get("HFCKPT_FUZZ_EXAMPLES", "0")) or None
CASE_TIMEOUT_S = 30  # one case: export of a 10 KB model; longer is a hang


_Hang, _time_limit, _tensors = Hang, time_limit, exported_tensors


_TIED = {"lm_head.weight": "model.embed_tokens.weight"}


def _dropped(md, target):
    """The model tensor whose whole ``state_dict_metadata`` entry ``target`` names, if any."""
    if len(target) == 2 and target[0] == ("attr", "state_dict_metadata"):
        return (target[1][1].split(".", 1)[1],)
    return ()


class _DcpFuzz:
    """The pristine DCP source, its reference export, and one working copy restored per case."""

    def __init__(self, root):
        self.root = root
        self.config = root / "config"
        sd = tiny_llama(self.config)
        layouts = {}
        for i, (name, t) in enumerate(sd.items()):
            splits = (2, 2) if t.dim() == 2 and i % 2 else (3,)  # 2-D blocks and uneven rows, mixed
            layouts[name] = (t, grid(t.shape, splits))
        self.src = write_dcp(root / "src", layouts)
        self.pristine = (self.src / ".metadata").read_bytes()
        self.data_digest = tree_digest(self.src)
        ref = root / "ref"
        assert cli_main(["export", str(self.src), str(ref), "--config", str(self.config), "--quiet"]) == 0
        self.reference = _tensors(ref)
        self.count = 0
        self.outcomes = collections.Counter()

    def metadata(self):
        return pickle.loads(self.pristine)

    def run(self, md, capsys, label, dropped=()):
        """Export ``md``; ``dropped``: model tensors whose whole entry the case removed (their absence
        from the export is then what the metadata says, not a wrong export)."""
        try:
            raw = pickle.dumps(md)
        except Exception:  # torch's own classes refuse to pickle some values (TensorProperties' memory_format)
            hypothesis.reject()
        self.count += 1
        (self.src / ".metadata").write_bytes(raw)
        before = tree_digest(self.src)
        dst = self.root / f"out{self.count}"
        capsys.readouterr()
        try:
            with _time_limit(CASE_TIMEOUT_S):
                rc = cli_main(["export", str(self.src), str(dst), "--config", str(self.config), "--quiet"])
                err = capsys.readouterr().err
            assert tree_digest(self.src) == before, "the source changed"
            if rc == 2:
                lines = err.strip().splitlines()
                assert len(lines) == 1 and lines[0].startswith("error: "), err
                assert not dst.exists(), "a refused export left its destination"
                self.outcomes[f"{label}: refused"] += 1
                return
            assert rc == 0, f"exit {rc}: {err}"
            got = _tensors(dst)
            # the tied head is written under its own name when the embedding's entry is gone
            want = {n: self.reference[_TIED.get(n, n)] for n in got if _TIED.get(n, n) in self.reference}
            missing = set(self.reference) - set(got) - set(dropped)
            assert set(got) == set(want) and not missing, ("exported other tensors than the original",
                                                          sorted(set(got) - set(want))[:5], sorted(missing)[:5])
            wrong = [n for n in got if got[n] != want[n]]
            assert not wrong, f"wrong export: {wrong[:5]} differ from the original"
            self.outcomes[f"{label}: exported"] += 1
        finally:
            shutil.rmtree(dst, ignore_errors=True)
            (self.src / ".metadata").write_bytes(self.pristine)
            if self.count % int(os.environ.get("HFCKPT_FUZZ_PROGRESS", "250")) == 0:  # progress of a long `make fuzz` run
                print(f"DCP fuzz: {self.count} cases, {dict(self.outcomes)}", file=sys.__stderr__, flush=True)


@pytest.fixture(scope="module")
def dcp_fuzz(tmp_path_factory):
    f = _DcpFuzz(tmp_path_factory.mktemp("fuzz-dcp"))
    yield f
    # (a crash, hang, traceback or wrong export fails its test: these are the cases that passed)
    print(f"\nDCP fuzz outcomes: {dict(f.outcomes)} in {f.count} cases", file=sys.__stderr__)
    assert tree_digest(f.src) == f.data_digest


# ---------------------------------------------------------------- the Metadata tree

def _leaves(obj, path=(), depth=0):
    """Paths to every value of the tree: dict values (and keys, as ("key", k)), list items, Size dims,
    dataclass fields. ``planner_data`` is left out (see the module docstring)."""
    yield path
    if depth > 8:
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if dataclasses.is_dataclass(k):
                yield from _leaves(k, path + (("key", k),), depth + 1)
            yield from _leaves(v, path + (("item", k),), depth + 1)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _leaves(v, path + (("item", i),), depth + 1)
    elif isinstance(obj, torch.Size):
        for i in range(len(obj)):
            yield path + (("dim", i),)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            if f.name == "planner_data":
                continue
            yield from _leaves(getattr(obj, f.name), path + (("attr", f.name),), depth + 1)


def _get(obj, step):
    kind, key = step
    if kind == "attr":
        return getattr(obj, key)
    if kind == "key":
        return key
    return obj[key]


def _replace(root, path, make):
    """Set the value at ``path`` to ``make(old)`` (None from ``make``: delete it where it can be)."""
    if not path:
        return make(root)
    parent = root
    for step in path[:-1]:
        parent = _get(parent, step)
    kind, key = path[-1]
    old = _get(parent, path[-1])
    new = make(old)
    if kind == "dim":  # Size is immutable: rebuild it one level up
        dims = list(parent)
        dims[key] = new
        return _replace(root, path[:-1], lambda _: torch.Size(dims) if all(
            type(d) is int and d >= 0 for d in dims) else tuple(dims))
    if kind == "attr":
        object.__setattr__(parent, key, new)
    elif kind == "key":  # a storage key (MetadataIndex): the entry moves to the new key
        try:  # (only flat values reach a key here: the structure fuzz never targets keys)
            hash(new)
        except TypeError:
            hypothesis.reject()  # not a dict key: no pickle could have held it
        value = parent.pop(key)
        if new is not None:
            parent[new] = value
    elif new is None and isinstance(parent, dict):
        del parent[key]
    elif new is None and isinstance(parent, list):
        del parent[key]
    else:
        parent[key] = new
    return root


_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.integers(-2**40, 2**40), st.integers(0, 20000),
    st.floats(allow_nan=True), st.text(max_size=4), st.sampled_from(["__0_0.distcp", "__1_0.distcp", ".metadata",
                                                                    "..", "/etc/passwd", "a/b"]),
    st.just([]), st.just({}), st.just(()), st.lists(st.integers(-2, 70000), max_size=3),
    st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.complex64]),
    st.builds(lambda n: torch.Size([n]), st.integers(0, 40)),
)

_SETTINGS = dict(deadline=None, database=None, derandomize=FUZZ_EXAMPLES is None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                        HealthCheck.data_too_large])


@settings(max_examples=FUZZ_EXAMPLES or 60, **_SETTINGS)
@given(data=st.data())
def test_fuzz_dcp_metadata_values(dcp_fuzz, capsys, data):
    """One value of .metadata replaced, deleted, or (an int) nudged: storage paths, offsets and
    lengths, chunk offsets and sizes, tensor sizes and dtypes, storage keys, whole entries."""
    md = dcp_fuzz.metadata()
    paths = [p for p in _leaves(md) if p]
    target = data.draw(st.sampled_from(paths), label="path")
    op = data.draw(st.sampled_from(["replace", "delete", "nudge", "copy"]), label="op")
    if op == "nudge":
        delta = data.draw(st.sampled_from([-64, -2, -1, 1, 2, 64, 2**31]), label="delta")
        make = lambda old: old + delta if type(old) is int else old  # noqa: E731
    elif op == "delete":
        make = lambda old: None  # noqa: E731
    elif op == "copy":  # another value of the same tree (a path, an offset, a chunk of another entry)
        other = data.draw(st.sampled_from(paths), label="from")
        source = md
        for step in other:
            source = _get(source, step)
        make = lambda old, v=pickle.loads(pickle.dumps(source)): v  # noqa: E731
    else:
        value = data.draw(_VALUES, label="value")
        make = lambda old: value  # noqa: E731
    md = _replace(md, target, make)
    dcp_fuzz.run(md, capsys, f"values/{op}", _dropped(md, target))


def _nest(value, depth, kind):
    for _ in range(depth):
        value = {"k": value} if kind is dict else kind([value])
    return value


def _dag(levels, kind):
    x = kind()
    for _ in range(levels):
        x = kind([x, x])
    return x


@settings(max_examples=FUZZ_EXAMPLES or 30, **_SETTINGS)
@given(data=st.data())
def test_fuzz_dcp_metadata_structure(dcp_fuzz, capsys, data):
    """A value of .metadata made hostile in shape: nested hundreds deep, a DAG exponential when
    walked, a cycle, a huge list or chunk list, chunks duplicated or dropped."""
    md = dcp_fuzz.metadata()
    # (never a dict key: a DAG of tuples as a key would hang this test's own hashing, in C)
    # (nor inside TensorProperties: torch's own __getstate__ walks a hostile value there while this
    # test pickles it, taking minutes and gigabytes before the code under test sees a byte)
    paths = [p for p in _leaves(md) if p and p[-1][0] != "key" and ("attr", "properties") not in p[:-1]]
    target = data.draw(st.sampled_from(paths), label="path")
    op = data.draw(st.sampled_from(["nest", "dag", "cycle", "grow", "dup chunks"]), label="structure")
    if op == "nest":
        depth = data.draw(st.integers(1, 400), label="depth")
        kind = data.draw(st.sampled_from([list, tuple, dict]), label="kind")
        make = lambda old: _nest(old, depth, kind)  # noqa: E731
    elif op == "dag":
        levels = data.draw(st.integers(1, 70), label="levels")
        make = lambda old: _dag(levels, data.draw(st.sampled_from([list, tuple])))  # noqa: E731
    elif op == "cycle":
        def make(old):
            x = [old]
            x.append(x)
            return x
    elif op == "grow":
        n = data.draw(st.sampled_from([2, 100, 20_000]), label="size")
        make = lambda old: [old] * n  # noqa: E731
    else:  # a tensor's chunk list repeated (the same chunk twice: overlap) or cut short (a gap)
        fqn = data.draw(st.sampled_from(sorted(md.state_dict_metadata)), label="tensor")
        entry = md.state_dict_metadata[fqn]
        cut = data.draw(st.booleans(), label="cut")
        chunks = entry.chunks[:-1] if cut else entry.chunks + entry.chunks[:1]
        object.__setattr__(entry, "chunks", chunks)
        dcp_fuzz.run(md, capsys, f"structure/{op}")
        return
    md = _replace(md, target, make)
    dcp_fuzz.run(md, capsys, f"structure/{op}", _dropped(md, target))
