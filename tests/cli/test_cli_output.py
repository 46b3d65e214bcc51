"""What the CLI prints on stdout is its own report: `inspect --json` parses even when a library
imported while reading prints there (DeepSpeed's accelerator banner under transformers 4)."""

import json

from hf_ckpt_integrations import api, cli


def test_inspect_json_stdout_is_only_the_report(monkeypatch, capsys, tmp_path):
    def noisy_inspect(*args, **kwargs):
        print("[WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.")
        return {"engine": "toy", "tensors": []}

    monkeypatch.setattr(api, "inspect_checkpoint", noisy_inspect)
    assert cli.main(["inspect", str(tmp_path), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {"engine": "toy", "tensors": []}
    assert "Setting accelerator to CPU" in err
