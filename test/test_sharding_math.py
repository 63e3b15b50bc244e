"""The sharding math alone: flatten, pad, shard, unshard and dim-0 splits, with no process group."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from xla_fsdp.sharding import (Dim0Layout, FlatLayout, flatten_and_pad, pad_dim0, round_up, shard_of, split_entry,
                               stitch_entry, unflatten)

shapes = st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple), min_size=1, max_size=5)


@pytest.mark.fast
@settings(max_examples=200, deadline=None)
@given(shapes=shapes, world_size=st.integers(1, 8), multiple=st.sampled_from([1, 2, 128]))
def test_flat_round_trip(shapes, world_size, multiple):
    tensors = [torch.randn(s) for s in shapes]
    layout = FlatLayout(tuple(shapes), world_size, multiple)
    flat = flatten_and_pad(tensors, layout)
    assert flat.numel() == layout.padded_numel
    assert layout.padded_numel % (world_size * multiple) == 0
    assert layout.padded_numel - layout.numel < world_size * multiple or layout.numel == 0
    shards = [shard_of(flat, r, world_size) for r in range(world_size)]
    assert all(s.numel() == layout.shard_numel for s in shards)
    assert torch.equal(flat[layout.numel:], torch.zeros(layout.padding))
    entry = {"mode": "flat", "shapes": [list(s) for s in shapes], "padded_numel": layout.padded_numel}
    for got, want in zip(stitch_entry(entry, shards), tensors):
        assert torch.equal(got, want)
    resplit, again = split_entry(entry, tensors, world_size, multiple)  # the checkpoint tools' split: the same shards
    assert resplit["padded_numel"] == layout.padded_numel and all(torch.equal(a, b) for a, b in zip(again, shards))
    for view, want in zip(unflatten(flat, layout), tensors):
        assert view.shape == want.shape


@pytest.mark.fast
@settings(max_examples=200, deadline=None)
@given(shape=st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple), world_size=st.integers(1, 8))
def test_dim0_round_trip(shape, world_size):
    t = torch.randn(shape)
    layout = Dim0Layout(tuple(shape), world_size)
    padded = pad_dim0(t, layout)
    assert padded.shape[0] == layout.padded_rows and layout.padded_rows % world_size == 0
    shards = [shard_of(padded, r, world_size) for r in range(world_size)]
    assert all(tuple(s.shape) == layout.shard_shape for s in shards)
    entry = {"mode": "dim0", "shapes": [list(shape)]}
    assert torch.equal(stitch_entry(entry, shards)[0], t)
    resplit, again = split_entry(entry, [t], world_size, 1)
    assert resplit["shard_shape"] == list(layout.shard_shape) and all(torch.equal(a, b) for a, b in zip(again, shards))


def test_fewer_elements_than_ranks_get_a_padded_shard_each():
    layout = FlatLayout(((),), 4, 1)  # a scalar parameter on 4 ranks
    assert (layout.numel, layout.padded_numel, layout.shard_numel) == (1, 4, 1)
    layout = Dim0Layout((3, 2), 4)
    assert layout.shard_shape == (1, 2) and layout.padding == 2


def test_round_up_and_errors():
    assert round_up(0, 4) == 0 and round_up(5, 4) == 8 and round_up(8, 4) == 8
    with pytest.raises(ValueError):
        round_up(3, 0)
    with pytest.raises(ValueError, match="does not divide"):
        shard_of(torch.zeros(5), 0, 2)
    with pytest.raises(ValueError, match="shards hold 2 elements, metadata says 4"):
        stitch_entry({"mode": "param", "shapes": [[3]], "padded_numel": 4}, [torch.zeros(2)])
    with pytest.raises(ValueError, match="do not match"):
        flatten_and_pad([torch.zeros(2)], FlatLayout(((3,),), 2, 1))
    assert math.prod(()) == 1


@pytest.mark.fast
@settings(max_examples=100, deadline=None)
@given(world_size=st.integers(2, 16), n=st.integers(1, 64), seed=st.integers(0, 2 ** 16))
def test_a_division_moved_into_the_collective_gives_the_same_bits(world_size, n, seed):
    """The reduce-scatter's scale (XLA) takes the pre- and post-division only where the result is
    bit for bit the same: a power-of-two factor, not float16 (the pre-division keeps its sums in range)."""
    from types import SimpleNamespace

    from xla_fsdp.sharding import default_predivide_factor
    from xla_fsdp.unit.group_comms import divisions_in_collective
    pre = default_predivide_factor(world_size)
    post = world_size / pre
    xla = SimpleNamespace(scales_in_collective=True, world_size=world_size)
    scale, pre_left, post_left = divisions_in_collective(xla, {torch.float32}, pre, post)
    assert pre_left == 1.0 and (post_left == 1.0) == (post == 2 ** round(math.log2(post)))
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(seed + r)) * 1e3 for r in range(world_size)]
    as_before = sum(g / pre for g in grads) / post  # the pre-division, the sum, the post-division
    moved = sum(g / pre_left for g in grads) * scale / post_left
    assert torch.equal(as_before, moved)
    assert divisions_in_collective(xla, {torch.float16}, pre, post) == (1.0, pre, post)
    eager = SimpleNamespace(scales_in_collective=False, world_size=world_size)
    assert divisions_in_collective(eager, {torch.float32}, pre, post) == (1.0, pre, post)
