"""``ds_train.py`` with DeepSpeed's documented switch ``"checkpoint": {"checkpoint_serialization":
false}``: every checkpoint file is written in torch.save's legacy (non-zip) format
(``torch.save(..., _use_new_zipfile_serialization=False)`` in DeepSpeed's TorchCheckpointEngine).

Same arguments and outputs as ``ds_train.py`` (its references included); the switch is added to the
config ``deepspeed.initialize`` receives, so the training and the references are ds_train's own.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ds_train  # noqa: E402


def _legacy_serialization():
    import deepspeed

    initialize = deepspeed.initialize

    def with_switch(*args, config=None, **kwargs):
        config = {**config, "checkpoint": {**config.get("checkpoint", {}), "checkpoint_serialization": False}}
        return initialize(*args, config=config, **kwargs)

    deepspeed.initialize = with_switch


if __name__ == "__main__":
    _legacy_serialization()
    ds_train.main()
