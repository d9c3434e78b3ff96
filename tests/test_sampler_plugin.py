"""A sampler from outside the package: a module written into a temporary folder registers it, and the real
`python -m sample --plugin MODULE --sampler NAME` draws with it; no file of the package is edited for it."""
import importlib
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from PIL import Image

from shared.generative.samplers import (SAMPLERS, TIME_SHIFT, SamplerOption, SamplerSpec, check_recorded,
                                        register_sampler, sampler_names)
from shared.network.models import ModelConfig
from shared.runtime.errors import UserError
from shared.weights.export import save_weights
from shared.tokenizers.locate import load_tokenizer
from tests.conftest import ROOT
from tests.helpers import NUM_CLASSES, pngs, random_dit, space_of

MODULE = "outside_samplers"  # the user's module, importable only from the temporary folder put on PYTHONPATH
NAME = "ddim-counted"
SOURCE = textwrap.dedent('''
    """A user's sampler: DDIM (eta 0) on DiT's respacing that appends its network-call count to $SAMPLER_CALLS."""
    import os

    from shared.generative.diffusion import ddim_sample
    from shared.generative.samplers import SamplerSpec, register_sampler


    def ddim_counted(process, model_fn, noise, model_kwargs=None, generator=None, progress=False):
        calls = []

        def counted(x, t, **kwargs):
            calls.append(t.shape[0])
            return model_fn(x, t, **kwargs)

        x = ddim_sample(process, counted, noise, model_kwargs, generator, progress, eta=0.0)
        with open(os.environ["SAMPLER_CALLS"], "a") as f:
            f.write(f"{len(calls)}\\n")
        return x


    register_sampler(SamplerSpec("ddim-counted", ddim_counted, "ddpm", "DDIM that counts its calls (a test plugin)"))
''')


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The user's module on disk and imported here (to write weights recording its sampler); unregistered after."""
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / f"{MODULE}.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(folder))
    try:
        importlib.import_module(MODULE)
        yield folder
    finally:
        SAMPLERS.unregister(NAME)
        sys.modules.pop(MODULE, None)


def _sample(args, folder, calls, expect) -> subprocess.CompletedProcess:
    """`python -m sample ARGS` from the repository root with the user's folder on PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(folder)]), "OMP_NUM_THREADS": "1",
           "SAMPLER_CALLS": str(calls)}
    done = subprocess.run([sys.executable, "-m", "sample", *map(str, args)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == expect, done.stderr[-3000:]
    return done


def test_the_registry_takes_a_sampler_and_refuses_a_clash(plugin):
    assert sampler_names()[-1] == NAME and SAMPLERS[NAME].fn.__module__ == MODULE
    with pytest.raises(TypeError, match="is taken by"):
        register_sampler(SamplerSpec(NAME, print, "ddpm", "another"))
    with pytest.raises(TypeError, match="not those of the sampling flags"):
        register_sampler(SamplerSpec("odd", print, "flow", "odd", options=(SamplerOption("tilt", 0.0, "t", "t"),)))
    register_sampler(SamplerSpec("shifted", print, "flow", "reuses a flag's option", options=(TIME_SHIFT,)))
    SAMPLERS.unregister("shifted")


def test_a_recorded_plugin_sampler_not_imported_names_the_plugin():
    with pytest.raises(UserError, match=f"pass --plugin {MODULE} so it is imported"):
        check_recorded({"sampler": NAME, "sampler_plugin": MODULE}, "ddpm", "the model config")
    with pytest.raises(UserError, match="pass --plugin MODULE so it is imported"):
        check_recorded({"sampler": NAME}, "ddpm", "the model config")


@pytest.mark.slow
def test_python_m_sample_draws_with_a_plugin_sampler(plugin, tmp_path, tiny_vae_dir):
    config = ModelConfig("DiT-T/2", input_size=8, in_channels=4, num_classes=NUM_CLASSES,
                         sampling={"sampler": NAME, "sampler_plugin": MODULE})
    vae = load_tokenizer(tiny_vae_dir)
    meta = {"image_size": 16, "scaling_factor": vae.scaling_factor, "latent_shape": [4, 8, 8],
            "vae": vae.identity, "class_names": [str(c) for c in range(NUM_CLASSES)]}
    weights = save_weights(tmp_path / "ema-step-0000001.safetensors", random_dit(config).state_dict(), config, space_of(meta), 1)
    calls = tmp_path / "calls.txt"
    common = ["--ckpt", weights, "--vae", tiny_vae_dir, "--num-samples", 2, "--num-sampling-steps", 3, "--cpu",
              "--cfg-scale", 1, "--class-labels", 1]

    refused = _sample([*common, "--out", tmp_path / "refused"], plugin, calls, expect=2)
    said = " ".join(refused.stderr.split())
    assert f"records the sampler '{NAME}'" in said and f"pass --plugin {MODULE}" in said and "Traceback" not in said
    assert not (tmp_path / "refused").exists() and not calls.exists()

    out = tmp_path / "out"
    _sample([*common, "--out", out, "--plugin", MODULE, "--sampler", NAME], plugin, calls, expect=0)
    assert calls.read_text().split() == ["3"]  # the plugin's function ran: 3 steps, one unguided call each
    assert json.loads((out / "settings.json").read_text())["identity"]["sampler"] == NAME
    reference = tmp_path / "ddim"  # the plugin is DDIM with eta 0: the same pixels as the built-in
    _sample([*common, "--out", reference, "--plugin", MODULE, "--sampler", "ddim"], plugin, calls, expect=0)
    assert sorted(pngs(out)) == sorted(pngs(reference)) and len(pngs(out)) == 2
    for name in pngs(out):
        assert np.array_equal(np.asarray(Image.open(out / name)), np.asarray(Image.open(reference / name)))


def test_a_plugin_imported_first_still_comes_after_the_built_ins_and_meets_their_names(tmp_path):
    """A user's module imported before anything reads the registry: its sampler is listed after the package's, and a
    name the package holds is refused when the module registers it (not later, from inside a built-in module)."""
    (tmp_path / "early_mine.py").write_text(textwrap.dedent('''
        from shared.generative.flow import euler_sample
        from shared.generative.samplers import SamplerSpec, register_sampler

        def mine(process, model_fn, noise, model_kwargs=None, generator=None, progress=False):
            return euler_sample(process, model_fn, noise, model_kwargs, generator, progress)

        register_sampler(SamplerSpec("mine", mine, "flow", "Euler under another name"))
    '''))
    (tmp_path / "early_clash.py").write_text(textwrap.dedent('''
        from shared.generative.samplers import SamplerSpec, register_sampler

        def euler(process, model_fn, noise, model_kwargs=None, generator=None, progress=False):
            return noise

        register_sampler(SamplerSpec("ddim", euler, "ddpm", "a name the package holds"))
    '''))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    listed = subprocess.run([sys.executable, "-c", "import early_mine\nfrom shared.generative.samplers import "
                             "sampler_names\nprint(' '.join(sampler_names()))"], env=env, capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.split() == ["ddpm", "ddim", "dpmpp-2m", "unipc", "euler", "heun", "sde", "dopri5", "meanflow",
                                     "mine"]
    clash = subprocess.run([sys.executable, "-c", "import early_clash"], env=env, capture_output=True, text=True)
    assert clash.returncode == 1
    assert "TypeError: sampler 'ddim' is taken by shared.generative.diffusion.ddim_sample" in clash.stderr
    assert 'early_clash.py", line 7' in clash.stderr  # raised where the user's module registers it
