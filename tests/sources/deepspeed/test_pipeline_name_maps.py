"""The row-parallel bias sum a pipeline's rules ask for (``tp: row_bias``), on synthetic slices
(milliseconds, no engine). The pipeline's names and TP merges as conversion rules:
tests/convert/test_pipeline_rules.py."""

import pytest
import torch

from hf_ckpt_integrations.assemble import torch_tensor
from hf_ckpt_integrations.errors import LayoutError
from hf_ckpt_integrations.mapped_files import MappedFiles
from hf_ckpt_integrations.plan import ExportPlan, Piece, TensorPlan, check_plan


def _bias_file(tmp_path, values):
    path = tmp_path / "b.bin"
    path.write_bytes(b"".join(torch.tensor(v, dtype=torch.float32).numpy().tobytes() for v in values))
    return str(path)


def test_a_summed_bias_is_the_sum_of_its_parts(tmp_path):
    path = _bias_file(tmp_path, [[1.0, 2.0, 3.0], [0.5, -2.0, 4.0]])
    t = TensorPlan("b", (3,), "F32", [[Piece(path, 0, 3, "F32")], [Piece(path, 12, 3, "F32")]],
                   part_shapes=[(3,), (3,)], reduce="sum")
    check_plan(ExportPlan("x", "src", None, [t]))
    assert not t.is_byte_copy
    with MappedFiles() as files:
        assert torch_tensor(t, files).tolist() == [1.5, 0.0, 7.0]


def test_a_sum_of_parts_of_another_shape_is_refused(tmp_path):
    path = _bias_file(tmp_path, [[1.0, 2.0, 3.0, 4.0]])
    t = TensorPlan("b", (2,), "F32", [[Piece(path, 0, 2, "F32")], [Piece(path, 8, 2, "F32")]],
                   part_shapes=[(2,), (1, 2)], reduce="sum")
    with pytest.raises(LayoutError, match="a reduce 'sum' of parts not all of its shape"):
        check_plan(ExportPlan("x", "src", None, [t]))
