"""shared/runtime/rerun.py: the one way every stage names what a rerun changed."""
from shared.runtime.rerun import differences, listed


def test_differences_name_the_values():
    recorded = {"num_classes": 22, "vae": {"source": "ema", "scale": 0.18215}, "betas": [0.9, 0.999], "same": 1,
                "index_sha256": "ab" * 32}
    now = {"num_classes": 7, "vae": {"source": "mse", "scale": 0.18215}, "betas": (0.9, 0.999), "same": 1,
           "index_sha256": "cd" * 32, "new": True}
    assert differences(recorded, now) == ["index_sha256: 'abababababab' -> 'cdcdcdcdcdcd'", "new: None -> True",
                                          "num_classes: 22 -> 7", "vae.source: 'ema' -> 'mse'"]
    assert differences(recorded, now, keys=("vae", "num_classes"), nested=False) == [
        "vae: {'source': 'ema', 'scale': 0.18215} -> {'source': 'mse', 'scale': 0.18215}", "num_classes: 22 -> 7"]
    assert differences(recorded, dict(recorded)) == []


def test_listed_says_how_many_more():
    diffs = [f"k{i}: {i} -> {i + 1}" for i in range(6)]
    assert listed(diffs[:2]) == "k0: 0 -> 1; k1: 1 -> 2"
    assert listed(diffs) == "k0: 0 -> 1; k1: 1 -> 2; k2: 2 -> 3; k3: 3 -> 4; and 2 more"
