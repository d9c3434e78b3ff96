"""Token routing (TREAD): the routed forward, its draws, its cost counts, the train CLI with it, its refusals, resume."""
import json

import pytest
import torch

from shared.network.models import DiT_models, ModelConfig
from shared.network.routing import draw_kept, kept_tokens
from tests.helpers import (cli, expect_user_error, final_tensors, finish, make_latents, metrics, killed_and_resumed,
                           randomize, run_inprocess, train_args)
from tests.test_repa import make_feature_latents

ROUTE = ["--route-ratio", "0.5", "--route-start", "1", "--route-end", "3"]


def routed_dit(rope=False, every=0):
    """DiT-T/2 on 8x8 latents (16 tokens) with random weights, routing blocks 1..3."""
    model = randomize(DiT_models["DiT-T/2"](input_size=8, num_classes=5, rope=rope), scale=0.05)
    model.set_grad_checkpointing(every)
    model.set_routing(1, 3)
    return model


def batch(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 4, 8, 8, generator=g), torch.randint(0, 1000, (n,), generator=g),
            torch.randint(0, 5, (n,), generator=g), torch.zeros(n, dtype=torch.bool))


# ---------------------------------------------------------------------------------------------------------
# The routed forward
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rope", [False, True])
def test_a_route_that_keeps_every_token_in_any_order_is_the_plain_forward(rope):
    # Attention is permutation-equivariant and RoPE must follow each token to its own grid position, so
    # routing every token, shuffled, changes nothing; tables left in grid order would break this with RoPE.
    model = routed_dit(rope).train()
    x, t, y, drop = batch()
    shuffled = torch.stack([torch.randperm(16, generator=torch.Generator().manual_seed(i)) for i in range(3)])
    plain = model(x, t, y, force_drop_ids=drop)
    routed = model(x, t, y, force_drop_ids=drop, route_keep=shuffled)
    torch.testing.assert_close(routed, plain, atol=1e-5, rtol=1e-5)


def test_skipped_tokens_bypass_the_route_and_kept_ones_see_only_each_other():
    model = routed_dit().train()
    x, t, y, drop = batch()
    keep = torch.stack([draw_kept(torch.Generator().manual_seed(i), 16, 8) for i in range(3)])  # (3, 8)
    seen = {}
    hooks = [model.blocks[i].register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, (a[0], out)))
             for i in range(6)]
    model(x, t, y, force_drop_ids=drop, route_keep=keep)
    for h in hooks:
        h.remove()
    assert seen[0][0].shape[1] == 16 and [seen[i][0].shape[1] for i in (1, 2, 3)] == [8, 8, 8]
    after = seen[4][0]  # block 4's input: (3, 16, D)
    for n in range(3):
        skipped = sorted(set(range(16)) - set(keep[n].tolist()))
        assert torch.equal(after[n, skipped], seen[0][1][n, skipped])  # block 0's output, untouched by blocks 1..3
        assert torch.equal(after[n, keep[n]], seen[3][1][n])  # the route's output, each at its own position
        # Block 1 sees the kept tokens alone: the same as running it on that sample's kept tokens by hand.
        c = model.t_embedder(t[n:n + 1]) + model.y_embedder(y[n:n + 1], True, drop[n:n + 1])
        torch.testing.assert_close(model.blocks[1](seen[0][1][n:n + 1, keep[n]], c), seen[1][1][n:n + 1])


def test_eval_sends_every_token_through_every_block():
    model = routed_dit().train()
    x, t, y, drop = batch()
    keep = torch.stack([draw_kept(torch.Generator().manual_seed(i), 16, 8) for i in range(3)])
    trained = model(x, t, y, force_drop_ids=drop, route_keep=keep)
    model.eval()
    with torch.no_grad():
        evaluated = model(x, t, y, force_drop_ids=drop, route_keep=keep)
        plain = model(x, t, y, force_drop_ids=drop)
    assert torch.equal(evaluated, plain)  # sampling's view: the route is ignored
    assert not torch.allclose(trained, plain, atol=1e-4)  # while training it really routes


def test_gradient_checkpointing_gives_the_same_routed_step():
    x, t, y, drop = batch()
    keep = torch.stack([draw_kept(torch.Generator().manual_seed(i), 16, 8) for i in range(3)])
    grads = []
    for every in (0, 1, 2):
        model = routed_dit(rope=True, every=every).train()
        model(x, t, y, force_drop_ids=drop, route_keep=keep).square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[1], grads[0])
    torch.testing.assert_close(grads[2], grads[0])


def test_repa_hidden_inside_the_route_is_refused_by_the_model():
    model = routed_dit().train()
    x, t, y, drop = batch()
    keep = torch.arange(8).expand(3, 8)
    _, hidden = model(x, t, y, force_drop_ids=drop, route_keep=keep, return_hidden_at=1)  # block 0: before
    assert hidden.shape == (3, 16, 192)
    with pytest.raises(Exception, match="inside the token route"):
        model(x, t, y, force_drop_ids=drop, route_keep=keep, return_hidden_at=2)


# ---------------------------------------------------------------------------------------------------------
# Draws and costs
# ---------------------------------------------------------------------------------------------------------

def test_route_draws_come_last_from_the_samples_generator(tmp_path):
    from shared.datasets.shards import LatentDataset
    from shared.generative.diffusion import DDPMObjective
    from train.loop import TrainingDraws

    dataset = LatentDataset(make_latents(tmp_path / "lat"), progress=False)
    pairs = [(5, 3), (6, 9), (40, 3)]
    plain = TrainingDraws(dataset, 3, 0.1, DDPMObjective()).__getitems__(pairs)
    routed = TrainingDraws(dataset, 3, 0.1, DDPMObjective(), route=(16, 8)).__getitems__(pairs)
    assert all(torch.equal(plain[k], routed[k]) for k in plain)  # every other draw unchanged
    keep = routed["route_keep"]
    assert keep.shape == (3, 8) and keep.dtype == torch.int64
    assert all(len(set(row.tolist())) == 8 and row.tolist() == sorted(row.tolist()) for row in keep)
    again = TrainingDraws(dataset, 3, 0.1, DDPMObjective(), route=(16, 8)).__getitems__(pairs[::-1])["route_keep"]
    assert torch.equal(again.flip(0), keep)  # keyed by stream position, not by batch order
    assert not torch.equal(keep[0], keep[2])  # same image at another position: another route


def test_kept_count_and_flops_follow_the_route():
    from train.memory import forward_macs

    assert kept_tokens(256, 0.5) == 128 and kept_tokens(16, 0.3) == 12  # TREAD: T - int(T * ratio) kept
    model = ModelConfig("DiT-XL/2", 32).build(device="meta")
    plain = forward_macs(model)["total"]
    model.set_routing(2, 24)
    routed = forward_macs(model, kept=128)["total"]
    # Written out: each of the 23 routed blocks loses 12 D^2 MACs per skipped token (qkv 3, proj 1, MLP 8) and
    # 2 D (T^2 - K^2) of attention matmuls; adaLN and the final layer are per sample or see every token.
    d, t, k = 1152, 256, 128
    assert plain - routed == 23 * (12 * d * d * (t - k) + 2 * d * (t * t - k * k))
    assert forward_macs(model)["total"] == plain  # sampling (eval) still counts every token


def test_planner_counts_routed_blocks_for_the_tokens_they_see(capsys):
    from train.plan import main

    main(["--model", "DiT-T/2", "--image-size", "64", "--measure-device", "cpu", "--precision", "fp32"])
    plain = capsys.readouterr().out
    main(["--model", "DiT-T/2", "--image-size", "64", "--measure-device", "cpu", "--precision", "fp32",
          *ROUTE])
    routed = capsys.readouterr().out
    assert "token routing (TREAD): 8 of 16 tokens skip blocks 1..3" in " ".join(routed.split())

    def saved_off(text):
        row = next(line for line in text.splitlines() if line.startswith("* off"))
        number, unit = row.split()[2:4]
        return float(number) * {"KiB": 1, "MiB": 1024}[unit]

    assert saved_off(routed) < 0.9 * saved_off(plain)


# ---------------------------------------------------------------------------------------------------------
# python -m train with routing
# ---------------------------------------------------------------------------------------------------------

def test_training_records_the_route_and_exports_a_plain_model(latents, tmp_path):
    run = run_inprocess(latents, tmp_path / "run", "--max-steps", "2", "--ckpt-every", "2", "--route-ratio", "0.5",
                        "--rope", "--grad-checkpoint", "1", "--report-to", "none")
    cfg = json.loads((run / "config.json").read_text())
    assert (cfg["route_ratio"], cfg["route_start"], cfg["route_end"]) == (0.5, 2, 2)  # TREAD's 2..depth-4
    assert "token routing (TREAD): 2 of 4 tokens per sample skip blocks 2..2" in (run / "log.txt").read_text()
    from shared.weights.export import load_weights

    sd, model_config, _, _ = load_weights(run / "exports" / "ema-step-0000002.safetensors")
    assert "route" not in json.dumps(model_config.to_dict())  # the export is an ordinary DiT
    model = model_config.build()
    model.load_state_dict(sd)


def test_routing_with_repa_before_the_route_trains(tmp_path):
    latents = make_feature_latents(tmp_path / "flat")
    run = run_inprocess(latents, tmp_path / "run", "--max-steps", "2", "--objective", "flow", "--repa-weight", "0.5",
                        "--repa-depth", "2", "--repa-projector-dim", "32", "--route-ratio", "0.5", "--route-end", "4",
                        "--report-to", "none")
    assert all("repa_loss" in m for m in metrics(run)) and len(metrics(run)) == 2


def test_routing_mistakes_are_one_paragraph_each_and_write_nothing(latents, tmp_path, capsys):
    run = tmp_path / "run"

    def refused(*extra, where=latents):
        message = expect_user_error(capsys, train_args(where, run, "--max-steps", "2", *extra))
        assert not run.exists()
        return message

    assert "--route-ratio 1.5 must lie strictly between 0 and 1" in refused("--route-ratio", "1.5")
    assert "--route-ratio -0.5 must lie strictly between 0 and 1" in refused("--route-ratio", "-0.5")
    assert "--route-ratio 1.0 must lie strictly between 0 and 1" in refused("--route-ratio", "1")
    assert "from block 4 to block 2 does not fit" in refused("--route-ratio", "0.5", "--route-start", "4")
    assert "from block 2 to block 6 does not fit DiT-T/2's 6 blocks" in refused("--route-ratio", "0.5",
                                                                               "--route-end", "6")
    assert "routes int(4 x 0.1) = 0 tokens" in refused("--route-ratio", "0.1")
    assert "routing is off" in refused("--route-start", "1")
    features = make_feature_latents(tmp_path / "flat")
    message = refused("--objective", "flow", "--repa-weight", "0.5", "--repa-depth", "3", "--repa-projector-dim", "32",
                      "--route-ratio", "0.5", where=features)
    assert "--repa-depth 3" in message and "inside or after the token route 2..2" in message
    assert "--repa-depth 2 or less" in message


def test_resume_with_other_routing_is_refused(latents, tmp_path, capsys):
    run = run_inprocess(latents, tmp_path / "run", "--max-steps", "1", *ROUTE[:2])
    before = sorted(p.name for p in run.rglob("*"))
    for other in ([], ["--route-ratio", "0.25"], [*ROUTE[:2], "--route-start", "1", "--route-end", "2"]):
        message = expect_user_error(capsys, train_args(latents, run, "--max-steps", "2", *other))
        assert "route_" in message and "new --results-dir" in message
    assert sorted(p.name for p in run.rglob("*")) == before
    plain = run_inprocess(latents, tmp_path / "plain", "--max-steps", "1")
    message = expect_user_error(capsys, train_args(latents, plain, "--max-steps", "2", *ROUTE[:2]))
    assert "route_ratio: 0.0 -> 0.5" in message


@pytest.mark.slow
def test_killed_routed_run_resumes_bitwise(latents, tmp_path):
    flags = ["--max-steps", "4", "--ckpt-every", "2", "--keep-last", "1", "--num-workers", "1", "--rope",
             "--route-ratio", "0.5", "--route-start", "1", "--route-end", "4", "--class-dropout-prob", "0.5"]
    ref, resumed = killed_and_resumed(latents, tmp_path, flags)
    assert ref.keys() == resumed.keys()
    for key in ref:
        assert torch.equal(ref[key], resumed[key]), key
    plain = tmp_path / "plain"
    finish(cli(train_args(latents, plain, *flags[:-8], "--class-dropout-prob", "0.5")))
    assert any(not torch.equal(ref[k], final_tensors(plain)[k]) for k in ref)  # routing really changed the run
