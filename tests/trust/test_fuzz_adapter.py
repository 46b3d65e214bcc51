"""adapter_config.json fuzzed: mutated field values (types, NaN/inf/huge numbers, bools), pattern
dicts and regexes (invalid, catastrophic, long), and raw bytes, merged with ``--merge-adapters``
into a tiny base. Every case either exits 0 with the merge peft's rule gives for that config (every
LoRA module selected as peft's ``check_target_module_exists`` selects, scaled as its
``get_pattern_key`` / ``lora_alpha / r`` scale, finite), or exits 2 with one ``error:`` line and
nothing written; never exit 3, a traceback, a hang or a non-finite weight.

No engine: the adapter is a peft LoRA model's parameters (tests/support/tiny_adapters.py).
``HFCKPT_FUZZ_EXAMPLES=N`` runs N cases per strategy (``make fuzz``, with this file on its line).
The oracle is peft's own functions, with their ``re`` swapped for the ``regex`` package under a
timeout so that a catastrophic pattern cannot hang the oracle itself (a case it cannot decide is
counted, not judged)."""

import collections
import contextlib
import json
import math
import os
import re
import shutil
import sys
import types

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
peft = pytest.importorskip("peft")
regex = pytest.importorskip("regex")
tiny_adapters = pytest.importorskip("tiny_adapters")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from hf_ckpt_integrations.cli import main as cli_main  # noqa: E402
from fuzz_bounds import time_limit  # noqa: E402

FUZZ_EXAMPLES = int(os.environ.get("HFCKPT_FUZZ_EXAMPLES", "0")) or None
CASE_TIMEOUT_S = 30  # one merge of a 30 KB model, plus at most a few bounded pattern matches
ORACLE_TIMEOUT_S = 10.0

_SETTINGS = dict(deadline=None, database=None, derandomize=FUZZ_EXAMPLES is None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                        HealthCheck.data_too_large])

# ---------------------------------------------------------------- values


_NUMBERS = [0, 1, 2, 4, 8, -1, -4, 2**31, 2**63, 10**30, math.nan, math.inf, -math.inf, 1e300, -1e300, 3.5e38,
            3.3e38, 1e38, 1e7, 1e-300, 0.5, 4.0, 8.0, -8.0, 0.0, True, False]
_PATTERNS = ["q_proj", "v_proj", "k_proj", "self_attn.q_proj", "model.layers.0.self_attn.q_proj", r"layers\.0\..*",
             r".*\.q_proj", "(q|v)_proj", r".*\.(q_proj|v_proj)", "q_proj(", "[", "*", "a{2,1}", r"((\w|\.)*)*X",
             r"(a|aa)+c", r"(.*)*(.*)*(.*)*X", r"(\w+\.)*q_proj", "all-linear", "ALL-LINEAR", "", ".*", "lm_head",
             "self_attn", "(?i)Q_PROJ", "Q_PROJ", r"\p{L}+", "x" * 5000, "layers", "h", "\x00", "é", "q_proj$",
             "^model", "(?P<idx>1)", "(?P<idx>", r"\d+"]
_FRAGMENTS = [".", "*", "+", "?", "(", ")", "|", r"\w", r"\.", "q", "_proj", "v", "layers", "0", "1", "{2}", "[a-z]",
              ".*", "(.*)*", "model"]


def _pattern():
    composed = st.lists(st.sampled_from(_FRAGMENTS), min_size=1, max_size=6).map("".join)
    return st.one_of(st.sampled_from(_PATTERNS), composed)


def _scalar():
    return st.one_of(st.sampled_from(_NUMBERS), st.none(), _pattern(),
                     st.floats(allow_nan=True, allow_infinity=True), st.integers(-2**70, 2**70))


def _value():
    return st.one_of(_scalar(), st.lists(st.one_of(_pattern(), st.sampled_from(_NUMBERS)), max_size=4),
                     st.dictionaries(_pattern(), _scalar(), max_size=3))


_FIELDS = ["r", "lora_alpha", "use_rslora", "fan_in_fan_out", "rank_pattern", "alpha_pattern", "target_modules",
           "exclude_modules", "modules_to_save", "layers_to_transform", "layers_pattern", "peft_type", "use_dora",
           "bias", "lora_bias"]


def _field_value(data, field):
    """A value for ``field``: mostly of the kind peft writes there, often not."""
    if data.draw(st.integers(0, 3), label="wild") == 0:
        return data.draw(_value(), label=f"{field} (any)")
    if field in ("rank_pattern", "alpha_pattern"):
        return data.draw(st.dictionaries(_pattern(), st.sampled_from(_NUMBERS), max_size=3), label=field)
    if field in ("target_modules", "exclude_modules", "modules_to_save", "layers_pattern"):
        return data.draw(st.one_of(_pattern(), st.lists(_pattern(), max_size=3), st.none()), label=field)
    if field == "layers_to_transform":
        return data.draw(st.one_of(st.integers(-1, 3), st.lists(st.integers(-1, 3), max_size=3), st.none()),
                         label=field)
    if field in ("use_rslora", "fan_in_fan_out", "use_dora", "lora_bias"):
        return data.draw(st.one_of(st.booleans(), st.none(), st.sampled_from([0, 1, "true", "no"])), label=field)
    if field == "peft_type":
        return data.draw(st.sampled_from(["LORA", "IA3", "lora", "", None, 1]), label=field)
    if field == "bias":
        return data.draw(st.sampled_from(["none", "all", "lora_only", None, False]), label=field)
    return data.draw(st.sampled_from(_NUMBERS), label=field)


# ---------------------------------------------------------------- the oracle: peft's own rules


class _Undecided(Exception):
    pass


class _BoundedRe(types.ModuleType):
    """``re`` for peft's functions: the same calls through the ``regex`` package, with a timeout."""

    error = re.error

    def __init__(self):
        super().__init__("re")

    @staticmethod
    def _call(how, pattern, string, *args):
        try:
            return getattr(regex, how)(pattern, string, *args, timeout=ORACLE_TIMEOUT_S)
        except TimeoutError:
            raise _Undecided(pattern) from None

    def match(self, pattern, string, *args):
        return self._call("match", pattern, string, *args)

    def fullmatch(self, pattern, string, *args):
        return self._call("fullmatch", pattern, string, *args)

    def search(self, pattern, string, *args):
        return self._call("search", pattern, string, *args)


@contextlib.contextmanager
def _peft_with_bounded_re():
    import peft.tuners.tuners_utils as tuners_utils
    import peft.utils.other as other

    saved = (tuners_utils.re, other.re)
    tuners_utils.re = other.re = _BoundedRe()
    try:
        yield tuners_utils.check_target_module_exists, other.get_pattern_key
    finally:
        tuners_utils.re, other.re = saved


def _expected_scales(cfg, modules):
    """``{module: scale}`` peft gives each LoRA module under ``cfg``, or None when peft would not
    apply one of them (not selected)."""
    with _peft_with_bounded_re() as (selected, pattern_key):
        conf = types.SimpleNamespace(**{k: cfg.get(k) for k in (
            "exclude_modules", "modules_to_save", "target_modules", "target_parameters", "layers_to_transform",
            "layers_pattern")})
        if conf.target_modules is None:  # peft fills it from the model type at load
            from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults

            conf.target_modules = defaults["llama"]
        if isinstance(conf.target_modules, str) and conf.target_modules.lower() == "all-linear":
            # peft's _maybe_include_all_linear_layers: every Linear/Conv1D but the output layer
            conf.target_modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        out = {}
        for m in modules:
            hit = selected(conf, m)
            if not hit or type(hit).__name__ == "_ExcludedModule":
                return None
            ranks, alphas = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
            r = ranks.get(pattern_key(ranks.keys(), m), cfg["r"])
            alpha = alphas.get(pattern_key(alphas.keys(), m), cfg["lora_alpha"])
            out[m] = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
            assert r == 4, (m, r)  # the adapter's A has 4 rows: any other rank must have been refused
        return out


# ---------------------------------------------------------------- running one case


class _Fuzz:
    def __init__(self, root):
        self.root = root
        self.base, src, model = tiny_adapters.build(root / "case", family="llama")
        self.src = root / "src"
        shutil.copytree(src, self.src)
        self.text = (self.src / "adapter_config.json").read_text()
        self.cfg = json.loads(self.text)
        from safetensors.torch import load_file

        self.base_state = load_file(str(self.base / "model.safetensors"))
        lora = {n[len("base_model.model."):]: t for n, t in load_file(str(src / "model.safetensors")).items()}
        self.modules = sorted({n.split(".lora_")[0] for n in lora})
        self.delta = {m: lora[f"{m}.lora_B.default.weight"] @ lora[f"{m}.lora_A.default.weight"] for m in self.modules}
        self.count = 0
        self.outcomes = collections.Counter()

    def run(self, text, capsys, strategy):
        self.count += 1
        (self.src / "adapter_config.json").write_text(text, encoding="utf-8", errors="surrogatepass")
        dst = self.root / f"out{self.count}"
        capsys.readouterr()
        with time_limit(CASE_TIMEOUT_S, memory=None):
            rc = cli_main(["export", str(self.src), str(dst), "--merge-adapters", "--base", str(self.base),
                           "--quiet"])
        err = capsys.readouterr().err
        if rc == 2:
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: "), err
            assert "Traceback" not in err
            assert not dst.exists() and not [p for p in self.root.iterdir() if ".hfckpt-" in p.name]
            self.outcomes[f"{strategy}: refused"] += 1
            return
        assert rc == 0, err  # never 3 (an internal error) or anything else
        self._check_merge(json.loads(text), dst, strategy)
        shutil.rmtree(dst)

    def _check_merge(self, cfg, dst, strategy):
        from safetensors.torch import load_file

        got = load_file(str(dst / "model.safetensors"))
        assert set(got) == set(self.base_state)
        for name, t in got.items():
            assert bool(torch.isfinite(t).all()), f"{name}: non-finite values written"
        try:
            scales = _expected_scales(cfg, self.modules)
        except _Undecided:
            self.outcomes[f"{strategy}: merged (oracle undecided)"] += 1
            return
        assert scales is not None, "merged although peft would not apply every LoRA module of the adapter"
        for m, scale in scales.items():
            want = self.base_state[f"{m}.weight"] + self.delta[m] * scale
            assert torch.allclose(got[f"{m}.weight"], want, rtol=1e-5, atol=1e-6), (m, scale)
        for name, t in got.items():
            if name[:-len(".weight")] not in scales:
                assert torch.equal(t, self.base_state[name]), f"{name}: changed though no LoRA module targets it"
        self.outcomes[f"{strategy}: merged"] += 1


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory):
    f = _Fuzz(tmp_path_factory.mktemp("fuzz-adapter"))
    yield f
    # (a crash, hang, traceback or wrong merge fails its test: these are the cases that passed)
    print(f"\nadapter fuzz outcomes: {dict(f.outcomes)} in {f.count} cases", file=sys.__stderr__)


# ---------------------------------------------------------------- strategies


@settings(max_examples=FUZZ_EXAMPLES or 40, **_SETTINGS)
@given(data=st.data())
def test_fuzz_adapter_config_fields(fuzz, capsys, data):
    """1-3 fields of the config peft wrote set to other values (or removed)."""
    cfg = dict(fuzz.cfg)
    for field in data.draw(st.lists(st.sampled_from(_FIELDS), min_size=1, max_size=3, unique=True), label="fields"):
        if data.draw(st.integers(0, 7), label="remove") == 0:
            cfg.pop(field, None)
        else:
            cfg[field] = _field_value(data, field)
    fuzz.run(json.dumps(cfg), capsys, "fields")


@settings(max_examples=FUZZ_EXAMPLES or 30, **_SETTINGS)
@given(data=st.data())
def test_fuzz_adapter_config_patterns(fuzz, capsys, data):
    """rank_pattern / alpha_pattern / target_modules as regexes: module names, invalid, catastrophic,
    long, matching some modules and not others."""
    cfg = dict(fuzz.cfg)
    cfg["rank_pattern"] = data.draw(st.dictionaries(_pattern(), st.sampled_from([4, 2, 4, 8]), max_size=3), label="r")
    cfg["alpha_pattern"] = data.draw(st.dictionaries(_pattern(), st.sampled_from([1, 16, 0.5, 1e6, 3.3e38]),
                                                     max_size=3), label="alpha")
    if data.draw(st.booleans(), label="regex targets"):
        cfg["target_modules"] = data.draw(_pattern(), label="target_modules")
    fuzz.run(json.dumps(cfg), capsys, "patterns")


_TOKENS = [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"1e300", b"true", b"null", b'"', b"{", b"[", b"]", b",",
           b"\\u0000", b"\\ud800", b"\xff", b"0", b"-", b"9" * 40]


@settings(max_examples=FUZZ_EXAMPLES or 30, **_SETTINGS)
@given(data=st.data())
def test_fuzz_adapter_config_bytes(fuzz, capsys, data):
    """1-3 byte-level edits of the JSON text: flips, cuts, inserted JSON tokens (NaN, 1e999, quotes)."""
    raw = bytearray(fuzz.text.encode())
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        at = data.draw(st.integers(0, len(raw)), label="at")
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]), label="op")
        if op == "flip" and at < len(raw):
            raw[at] ^= 1 << data.draw(st.integers(0, 7), label="bit")
        elif op == "cut":
            del raw[at:at + data.draw(st.integers(1, 8), label="span")]
        else:
            raw[at:at] = data.draw(st.sampled_from(_TOKENS), label="token")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="surrogateescape")
    fuzz.run(text, capsys, "bytes")
