"""Which batch sizes get a CUDA graph, and which graph a step of B decodes pads up to (pure logic:
the capture itself is tests/gpu/test_cuda_graphs.py)."""

from disagg.engine.cuda_graphs import captured_sizes, padded_size


def test_small_sizes_exact_then_every_eight_up_to_the_largest():
    assert captured_sizes(1) == [1]
    assert captured_sizes(4) == [1, 2, 4]
    assert captured_sizes(16) == [1, 2, 4, 8, 16]
    assert captured_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert captured_sizes(128)[-3:] == [112, 120, 128]


def test_a_step_pads_to_the_smallest_graph_that_holds_it():
    sizes = captured_sizes(20)
    assert [padded_size(sizes, b) for b in (1, 3, 5, 9, 16, 17, 20)] == [1, 4, 8, 16, 16, 20, 20]
    assert padded_size(sizes, 21) is None
