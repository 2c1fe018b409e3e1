"""Starting distributed (comm.dist): two ranks on one GPU are found before NCCL refuses them."""

from comm.dist import sharing_a_gpu


def test_two_ranks_on_one_gpu_are_found():
    assert sharing_a_gpu([("a", 0), ("a", 1), ("b", 0)], 0) == []
    assert sharing_a_gpu([("a", 0), ("a", 1), ("a", 0)], 2) == [0, 2]
