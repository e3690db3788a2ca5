"""examples/train_tiny_gpt.py runs end to end with tiny settings, on every backend of the device.

``--compare`` trains the same model twice (flashtile, eager attention) from one seed on the same
batches: over a few steps the two loss curves may differ only by fp32 rounding. The run must also
learn (the loss falls), generate the requested characters and leave a record in flashtile.stats().
"""
import importlib.util
import math
import pathlib

import pytest

import flashtile

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "train_tiny_gpt.py"
# Tiny enough for Triton's interpreter: head dim 16, 32 characters of context, 3 steps.
TINY = ["--steps", "3", "--layers", "1", "--width", "32", "--heads", "2", "--seqlen", "32", "--batch", "4",
        "--generate", "20", "--log-every", "1", "--compare"]
# fp32 rounding differences between the two attentions, carried through 3 optimizer steps.
LOSS_ATOL = 1e-4


def load_example():
    spec = importlib.util.spec_from_file_location("train_tiny_gpt", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def clean_stats():
    flashtile.reset_stats()
    yield
    flashtile.reset_stats()


def test_train_tiny_gpt(backend, device):
    result = load_example().main([*TINY, "--device", device])

    ours, eager = result["losses"]["flashtile"], result["losses"]["eager"]
    assert len(ours) == len(eager) == 3
    assert all(math.isfinite(loss) for loss in ours + eager), f"losses {ours} / {eager}"
    assert ours[-1] < ours[0], f"the loss did not fall over 3 steps: {ours}"
    assert result["max_diff"] <= LOSS_ATOL, f"flashtile {ours} vs eager {eager}: max |diff| {result['max_diff']:.2e}"
    assert abs(result["val_loss"]["flashtile"] - result["val_loss"]["eager"]) <= LOSS_ATOL, result["val_loss"]
    assert len(result["text"]) == 20
    # Training and generation ran through flashtile on the backend under test, with no fallback.
    assert result["stats"]["calls"].get(backend, 0) > 0, result["stats"]
    assert result["stats"]["fallbacks"] == {}, result["stats"]
