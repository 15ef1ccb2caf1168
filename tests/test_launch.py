"""The train rule's launcher (dflash.train.launch); tests/test_distributed.py runs it for real,
as one node and as two."""

import pytest

from dflash.errors import UserError
from dflash.train.launch import command


def test_one_node_is_a_standalone_torchrun_without_srun():
    train = {"nnodes": 1, "rdzv_endpoint": None}
    assert command(train, 3, python="python") == [
        *("python", "-m", "torch.distributed.run", "--standalone"),
        *("--nnodes", "1", "--nproc-per-node", "3"),
    ]


@pytest.mark.parametrize(
    ("endpoint", "world"), [(None, 4), ("node1:29500", 3)], ids=["no endpoint", "uneven split"]
)
def test_several_nodes_need_an_endpoint_and_an_even_split_of_the_ranks(endpoint, world):
    with pytest.raises(UserError, match="train.nnodes 2 needs train.rdzv_endpoint"):
        command({"nnodes": 2, "rdzv_endpoint": endpoint}, world)
