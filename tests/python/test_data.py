"""The bundled text splits into training (first 90%) and held-out validation
(last 10%) text, and batches of a split come only from it."""

import pytest
import torch

from sharc.data import CharDataset


def test_validation_is_the_last_tenth_and_disjoint_from_training():
    data = CharDataset("abcdefghij" * 10)
    train, val = data.split("train"), data.split("val")
    assert len(train) == 90 and len(val) == 10
    assert torch.equal(torch.cat([train, val]), data.tokens)
    assert data.decode(val) == "abcdefghij"


def test_batches_of_a_split_come_from_it():
    text = "a" * 900 + "b" * 100  # training text is all 'a', validation all 'b'
    data = CharDataset(text)
    for step in range(5):
        x, y = data.global_batch(step, 4, 8, split="train")
        assert data.decode(x.flatten()) == "a" * 32 and data.decode(y.flatten()) == "a" * 32
        x, _ = data.global_batch(step, 4, 8, split="val")
        assert set(data.decode(x.flatten())) == {"b"}
    with pytest.raises(ValueError, match="unknown split 'test'"):
        data.global_batch(0, 1, 8, split="test")


def test_batches_are_a_function_of_the_step_and_ranks_take_disjoint_slices():
    data = CharDataset()
    x0, _ = data.rank_batch(3, 2, 16, 0, 2, split="train")
    x1, _ = data.rank_batch(3, 2, 16, 1, 2, split="train")
    whole, _ = data.global_batch(3, 4, 16, split="train")
    assert torch.equal(torch.cat([x0, x1]), whole)
    assert not torch.equal(whole, data.global_batch(4, 4, 16, split="train")[0])
