"""The Hub-layout cache is a speed-up, never an authority (docs/hub-layout.md): an entry is used only
from a directory of ours writable by no one else, only when it is a regular owner-only file carrying
the digest of its inputs and answer; anything else is a cache miss (derived afresh, never an error,
never a hang); and ``verify`` always derives the layout itself, so a wrong entry that misled an
export cannot make verify agree. Synthetic DCP sources of a tiny Llama (tests/support/dcp_build.py).
"""

import json
import os

import pytest

from dcp_build import write_dcp  # noqa: E402
from fuzz_bounds import time_limit  # noqa: E402

from hf_ckpt_integrations.cli import main as cli_main  # noqa: E402
from helpers import export, in_process, read_export  # noqa: E402

Q, K = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"


@pytest.fixture(scope="module")
def source(tiny_llama_sd, tmp_path_factory):
    config, sd = tiny_llama_sd
    return write_dcp(tmp_path_factory.mktemp("layout-cache") / "src", sd), config, sd


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    monkeypatch.setenv("HF_CKPT_CACHE", str(d))
    return d


def _within(seconds, run):
    """``run`` (a CLI runner) with each call bounded in time: a hang fails instead of stalling the suite."""
    def bounded(*args):
        with time_limit(seconds, memory=None):
            return run(*args)
    return bounded


@pytest.fixture
def run(capsys):
    """The CLI in this process, its output captured, each call bounded in time."""
    return _within(120, in_process(capsys))


def _entry(cache):
    (entry,) = (cache / "hub-layout").glob("*.json")
    return entry


def _poison(entry, sd, *, digest=True):
    """Rewrite the entry's answer into a layout that tiles exactly but swaps q_proj and k_proj, keeping
    (``digest``) or breaking the entry's own digest."""
    e = json.loads(entry.read_text())
    answer = e.get("answer", e)  # (an older cache format held the answer at the top level)
    swap = {Q: K, K: Q}
    answer["layout"] = [[swap.get(n, n), n, list(t.shape), 0] for n, t in sd.items() if n != "lm_head.weight"]
    if "digest" in e:
        from hf_ckpt_integrations.convert.answer_cache import _digest as _entry_digest

        e["digest"] = _entry_digest(e["key"], answer) if digest else "0" * 64
    elif not digest:
        pytest.fail("no digest in this cache format")
    entry.write_text(json.dumps(e))
    os.chmod(entry, 0o600)


def _swapped(dst, sd):
    got = read_export(dst)
    return got[Q].equal(sd[K]) and got[K].equal(sd[Q])


def test_verify_derives_the_layout_itself(source, cache, tmp_path, run, capsys):
    """An entry with a valid digest (as if written by us) but a wrong name mapping misleads export;
    verify, which derives the layout afresh, reports the difference."""
    src, config, sd = source
    export(src, tmp_path / "first", "--quiet", config=config, run=run)
    _poison(_entry(cache), sd, digest=True)
    export(src, tmp_path / "out", "--quiet", config=config, run=run)
    assert _swapped(tmp_path / "out", sd), "the cache entry was not used: this test proves nothing"
    capsys.readouterr()
    rc = cli_main(["verify", str(tmp_path / "out"), "--against", str(src), "--config", str(config)])
    out = capsys.readouterr().out
    assert rc == 1 and f"{Q}: values differ from the source" in out, out


def test_an_entry_whose_digest_does_not_match_is_a_miss(source, cache, tmp_path, run):
    src, config, sd = source
    export(src, tmp_path / "first", "--quiet", config=config, run=run)
    _poison(_entry(cache), sd, digest=False)
    export(src, tmp_path / "out", "--quiet", config=config, run=run)
    assert not _swapped(tmp_path / "out", sd) and read_export(tmp_path / "out")[Q].equal(sd[Q])


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777])
def test_a_cache_directory_others_can_write_is_not_used(source, cache, tmp_path, run, mode):
    src, config, sd = source
    export(src, tmp_path / "first", "--quiet", config=config, run=run)
    _poison(_entry(cache), sd, digest=True)
    os.chmod(cache / "hub-layout", mode)
    export(src, tmp_path / "out", "--quiet", config=config, run=run)
    assert read_export(tmp_path / "out")[Q].equal(sd[Q]), "an entry from a directory others can write was used"


def test_a_symlinked_entry_is_not_followed(source, cache, tmp_path, run):
    src, config, sd = source
    export(src, tmp_path / "first", "--quiet", config=config, run=run)
    entry = _entry(cache)
    _poison(entry, sd, digest=True)
    planted = tmp_path / "planted.json"
    os.replace(entry, planted)
    os.symlink(planted, entry)
    export(src, tmp_path / "out", "--quiet", config=config, run=run)
    assert read_export(tmp_path / "out")[Q].equal(sd[Q]), "an entry reached through a symlink was used"


def test_a_fifo_at_the_entry_path_is_a_miss_not_a_hang(source, cache, tmp_path, run, capsys):
    src, config, sd = source
    export(src, tmp_path / "first", "--quiet", config=config, run=run)
    entry = _entry(cache)
    entry.unlink()
    os.mkfifo(entry, 0o600)
    export(src, tmp_path / "out", "--quiet", config=config, run=_within(60, in_process(capsys)))
    assert read_export(tmp_path / "out")[Q].equal(sd[Q])


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"answer": ' * 50_000 + "1" + "}" * 50_000,
                                  "not json", "", '{"key": 1}', "null"])
def test_a_malformed_entry_is_a_miss_not_an_error(source, cache, tmp_path, run, text):
    src, config, sd = source
    export(src, tmp_path / "first", "--quiet", config=config, run=run)
    entry = _entry(cache)
    entry.write_text(text)
    os.chmod(entry, 0o600)
    export(src, tmp_path / "out", "--quiet", config=config, run=run)
    assert read_export(tmp_path / "out")[Q].equal(sd[Q])
    e = json.loads(entry.read_text())  # rebuilt
    assert isinstance(e, dict) and e != {}


def test_entries_are_owner_only_files(source, cache, tmp_path, run):
    src, config, _ = source
    export(src, tmp_path / "first", "--quiet", config=config, run=run)
    entry = _entry(cache)
    assert entry.stat().st_mode & 0o077 == 0 and not entry.is_symlink()
    assert sorted(p.name for p in (cache / "hub-layout").iterdir()) == [entry.name]  # no temp file left
