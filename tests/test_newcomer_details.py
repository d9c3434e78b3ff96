"""Smaller things a new user met (issue 38.8): defaults stated in help, counts in the right number, a near miss
of a preset named, the tokenizer named by its kind, and a resume that survives `python -m extract --stats`."""
import json

from evaluate.reference import reference_parser
from extract.__main__ import build_parser as extract_parser, main as extract_main
from shared.datasets.images import MAX_IMAGE_PIXELS
from tests import tiny_tokenizers
from tests.conftest import make_image_folder
from tests.helpers import expect_user_error, make_latents, run_inprocess, run_main, train_args


def _flag_help(parser, flag: str) -> str:
    """The formatted help of one flag, on one line."""
    text = " ".join(parser.format_help().split())
    return text[text.rindex(flag + " N|none"):][:400]  # the last mention: the options list, not the usage


def test_max_image_pixels_help_states_its_default():
    for parser in (extract_parser(), reference_parser()):
        assert f"(default: {MAX_IMAGE_PIXELS:,})" in _flag_help(parser, "--max-image-pixels")


def test_extract_counts_agree_in_number(tmp_path, tiny_vae_dir, capsys):
    data = make_image_folder(tmp_path / "data", classes=("one",), per_class=1, size=(16, 16))
    code, out, err = run_main(extract_main, ["--data-path", data, "--check", "--num-workers", 0], capsys)
    assert code == 0, err
    assert "1 class, 1 image;" in out and " 1 image\n" in out
    argv = ["--data-path", data, "--out", tmp_path / "lat", "--vae", tiny_vae_dir, "--image-size", 16,
            "--num-workers", 0]
    code, out, err = run_main(extract_main, [*argv, "--dry-run"], capsys)
    assert code == 0 and "1 image in 1 class" in out and "1 shard of 4096 images" in out, err
    code, out, err = run_main(extract_main, argv, capsys)
    assert code == 0, err
    assert "extract: 1 image in 1 shard, 0 bad files skipped" in out and "encoded 1 image in" in out
    assert "; 1 shard)" in out
    code, out, err = run_main(extract_main, ["--verify", "--out", tmp_path / "lat"], capsys)
    assert code == 0 and "1 shard (" in out and "1 sample) matches the sha256" in out, err


def test_a_preset_differing_in_case_is_named(tmp_path, capsys):
    message = expect_user_error(capsys, ["--model", "DiT-t/2", *train_args(make_latents(tmp_path / "lat"),
                                                                           tmp_path / "run")[2:]])
    assert "--model 'DiT-t/2' is not a valid model preset (did you mean 'DiT-T/2'?)" in message


def test_an_rae_size_refusal_names_its_encoder_not_a_vae(tmp_path, capsys):
    rae = tiny_tokenizers.rae(tmp_path / "rae")  # 32 px -> 4x4 tokens: factor 8
    data = make_image_folder(tmp_path / "data", per_class=1)
    code, _, err = run_main(extract_main, ["--data-path", data, "--out", tmp_path / "lat", "--vae", rae,
                                           "--image-size", 36, "--dry-run"], capsys)
    assert code == 2 and "not a multiple of the RAE encoder's downsample factor 8" in err
    assert "VAE" not in err


def test_stats_on_a_trained_folder_keeps_the_run_resumable(tmp_path, capsys):
    latents, run = make_latents(tmp_path / "lat", n=16), tmp_path / "run"
    run_inprocess(latents, run, "--max-steps", "1")
    before = (latents / "index.json").read_bytes()
    code, out, err = run_main(extract_main, ["--stats", "--out", latents], capsys)
    assert code == 0 and "statistics of 16 samples" in out, err
    assert (latents / "index.json").read_bytes() != before  # the statistics were added
    run_inprocess(latents, run, "--max-steps", "2")  # resumes: training reads no statistics
    # A real change of the data is still refused.
    index = json.loads((latents / "index.json").read_text())
    index["class_names"] = list(reversed(index["class_names"]))
    (latents / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    message = expect_user_error(capsys, train_args(latents, run, "--max-steps", "3"))
    assert "the latent folder differs from the checkpoint's (index_sha256:" in message
