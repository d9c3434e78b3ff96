"""The latent space a DiT lives in: one frozen record, one writer, one reader, and the check that a tokenizer fits it.

A latent folder stores it once: latent_space.json (tokenizer identity, latent shape, image size, class names, the
kind and scale of each normalisation, and the record's sha256) beside latent_space.safetensors (the statistics
as fp32 tensors); index.json carries the sha256. A run's space is the folder's with the normalisation the DiT
sees ("dit"): config.json and state.json carry its sha256, weight files and previews carry the record itself
(metadata "latent_space" + tensors "latent_space.*"), so each stands alone. Normalisations by name:
"dit" (what the run trained on), "native" (the tokenizer's own), "channel" and "element" (the folder's statistics).

Another tokenizer decodes the latents without any error into wrong pictures, so every difference is refused:
channels and downsample factor always, the class, scaling factor, own normalisation and config hash unless
--allow-other-vae; decoding always inverts the "dit" normalisation, so an allowed swap never changes the scaling.
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import safetensors.torch

from shared.runtime.errors import UserError
from shared.weights.export import SPACE_KEY
from shared.runtime.fsio import atomic_write_bytes, atomic_write_text
from shared.tokenizers.tokenizer import LatentNorm

SPACE_JSON, SPACE_TENSORS = "latent_space.json", "latent_space.safetensors"
REBUILD_RUN_FILE = ("copy the file again from where it was made, or rerun the training command that wrote it "
                    "(`python -m train --latents FOLDER --results-dir RUN` with its flags): its next checkpoint and "
                    "export carry the record again, rebuilt from the latent folder")
SPACE_VERSION = 1
DEFAULT_TOKENIZER = "ema"  # the DiT release samples with sd-vae-ft-ema
# (identity key, words); the first two make decoding impossible or wrong-sized, so no flag overrides them.
_HARD = (("latent_channels", "latent channels"), ("downsample_factor", "downsample factor"))
_SOFT = (("class", "class"), ("scaling_factor", "scaling factor"), ("norm", "own normalisation"),
         ("config_sha256", "config hash"))
FAMILY_WORDS = {"vae": "a VAE's latents", "rae": "RAE tokens (a frozen representation encoder's patch tokens)"}


def _canonical(obj) -> bytes:
    """The one JSON text of obj that is hashed (sorted keys, no spaces, ASCII)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("ascii")


@dataclass(frozen=True, eq=False)
class LatentSpace:
    """Tokenizer identity, latent (C, h, w), image size, class names and named normalisations (module doc)."""

    tokenizer: dict = field(default_factory=dict)  # source, class, family, channels, factor, config_sha256, ...
    latent_shape: tuple = ()
    image_size: int = 0
    class_names: tuple = ()
    norms: dict = field(default_factory=dict)  # name -> LatentNorm
    statistics: dict = field(default_factory=dict)  # what the folder's statistics were computed from

    def __post_init__(self):
        object.__setattr__(self, "latent_shape", tuple(int(n) for n in self.latent_shape))
        object.__setattr__(self, "class_names", tuple(str(n) for n in self.class_names))
        object.__setattr__(self, "image_size", int(self.image_size or 0))

    def __eq__(self, other) -> bool:
        return isinstance(other, LatentSpace) and self.sha256 == other.sha256

    __hash__ = None

    def __repr__(self) -> str:
        return f"LatentSpace({self.tokenizer.get('source')}, {self.latent_shape}, {self.sha256[:12]})"

    norm = property(lambda self: self.norms.get("dit"), doc="What the DiT sees (None in a folder: train picks it).")
    native = property(lambda self: self.norms.get("native"), doc="The tokenizer's own normalisation, if it has one.")
    source = property(lambda self: self.tokenizer.get("source"), doc="The tokenizer's name or path.")

    # -- constructors -------------------------------------------------------------------------------------
    @classmethod
    def of_tokenizer(cls, tokenizer, image_size: int, latent_shape, class_names) -> "LatentSpace":
        """The space a loaded tokenizer (shared/tokenizers/tokenizer.py Tokenizer) gives images of image_size."""
        norms = {"native": tokenizer.norm} if tokenizer.norm is not None else {}
        return cls(dict(tokenizer.identity), latent_shape, image_size, class_names, norms)

    @classmethod
    def or_unknown(cls, space: "LatentSpace | None", channels: int) -> "LatentSpace":
        """space, or one known only by its channels (official weights and bare previews record none)."""
        return space if space is not None else cls({"latent_channels": int(channels)})

    def with_norms(self, statistics: dict | None = None, **norms) -> "LatentSpace":
        """This space with normalisations added or replaced (and the statistics' provenance)."""
        return replace(self, norms={**self.norms, **norms}, statistics={**self.statistics, **(statistics or {})})

    def tokenizer_only(self) -> "LatentSpace":
        """This space without its folder statistics or run normalisation: only the tokenizer's own."""
        return replace(self, norms={"native": self.native} if self.native is not None else {}, statistics={})

    def for_run(self, norm: LatentNorm) -> "LatentSpace":
        """A run's space: this folder's tokenizer and shape, with `norm` as what the DiT sees (no folder statistics)."""
        return self.tokenizer_only().with_norms(dit=norm)

    # -- the record -----------------------------------------------------------------------------------------
    def to_json(self, hashed: bool = False) -> dict:
        """The JSON record (sources of the normalisations, words for messages only, left out when hashed)."""
        norms = {name: {"kind": n.kind, "scale": n.scale, **({} if hashed else {"source": n.source})}
                 for name, n in sorted(self.norms.items())}
        return {"version": SPACE_VERSION, "tokenizer": self.tokenizer, "latent_shape": list(self.latent_shape),
                "image_size": self.image_size, "class_names": list(self.class_names), "norms": norms,
                "statistics": self.statistics}

    def tensors(self, prefix: str = "") -> dict:
        """{prefix + "NAME.mean"/"NAME.std": fp32 tensor} of every normalisation (own copies: "dit" may be "native")."""
        return {f"{prefix}{name}.{part}": getattr(n, part).clone()
                for name, n in sorted(self.norms.items()) for part in ("mean", "std")}

    @functools.cached_property  # the record is frozen: hashed once (3 MiB of statistics at RAE's size)
    def sha256(self) -> str:
        """sha256 of the canonical JSON and every statistic's name, shape and little-endian fp32 bytes."""
        digest = hashlib.sha256(_canonical(self.to_json(hashed=True)))
        for key, tensor in self.tensors().items():
            digest.update(_canonical([key, list(tensor.shape)]))
            digest.update(tensor.numpy().astype("<f4").tobytes())
        return digest.hexdigest()

    def text(self) -> str:
        """The JSON written to latent_space.json and to a weight file's metadata: the record and its sha256."""
        return json.dumps({**self.to_json(), "sha256": self.sha256}, indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_parts(cls, text: str, tensors: dict, where, rebuild: str, expected: str | None = None) -> "LatentSpace":
        """The record back from its JSON and tensors; UserError (`refuse`) when truncated or edited by hand."""
        try:
            record = json.loads(text)
            norms = {name: LatentNorm(d["kind"], tensors[f"{name}.mean"], tensors[f"{name}.std"], d["scale"],
                                      d.get("source", ""))
                     for name, d in record["norms"].items()}
            space = cls(record["tokenizer"], record["latent_shape"], record["image_size"], record["class_names"],
                        norms, record["statistics"])
            recorded = record["sha256"]
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise refuse(where, f"is truncated or unreadable ({type(err).__name__}: {err})", rebuild) from err
        for claimed, what in ((recorded, "its own"), (expected, "the one recorded beside it")):
            if claimed is not None and claimed != space.sha256:
                raise refuse(where, f"was edited by hand: its content hashes to {space.sha256[:12]}, not to "
                                    f"{claimed[:12]}, {what}", rebuild)
        return space

    # -- a latent folder ------------------------------------------------------------------------------------
    def write(self, folder) -> str:
        """Write latent_space.safetensors then latent_space.json into folder (each atomically); the sha256."""
        folder = Path(folder)
        atomic_write_bytes(folder / SPACE_TENSORS, safetensors.torch.save(self.tensors()))
        atomic_write_text(folder / SPACE_JSON, self.text())
        return self.sha256

    @classmethod
    def read(cls, folder, expected: str | None, rebuild: str) -> "LatentSpace":
        """The space stored in folder, checked against `expected` (index.json's sha256); UserError when damaged."""
        json_path, tensor_path = Path(folder) / SPACE_JSON, Path(folder) / SPACE_TENSORS
        if missing := [p for p in (json_path, tensor_path) if not p.is_file()]:
            raise refuse(missing[0], "is missing", rebuild)
        try:
            tensors = safetensors.torch.load(tensor_path.read_bytes())
        except Exception as err:  # safetensors raises its own error types for a cut or foreign file
            raise refuse(tensor_path, f"is truncated or unreadable ({err})", rebuild) from err
        return cls.from_parts(json_path.read_text(), tensors, json_path, rebuild, expected)

    # -- weight files and previews ----------------------------------------------------------------------------
    def file_parts(self) -> tuple[dict, dict]:
        """(metadata, tensors) to store beside a weight file's or preview's own."""
        return {SPACE_KEY: self.text()}, self.tensors(f"{SPACE_KEY}.")

    @classmethod
    def read_file(cls, path, rebuild: str = REBUILD_RUN_FILE) -> "LatentSpace | None":
        """The space a weight file carries (its header and "latent_space.*" tensors only); None when it has none."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys() if k.startswith(f"{SPACE_KEY}.")}
            return cls.from_file(f.metadata() or {}, tensors, path, rebuild)

    @classmethod
    def from_file(cls, metadata: dict, tensors: dict, where, rebuild: str) -> "LatentSpace | None":
        """The space a weight or preview file carries; None when it has none."""
        prefix = f"{SPACE_KEY}."
        own = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        if SPACE_KEY in metadata:
            return cls.from_parts(metadata[SPACE_KEY], own, where, rebuild)
        if own:
            raise refuse(where, f"is missing (its {prefix}* tensors are there, its metadata {SPACE_KEY!r} is not)",
                         rebuild)
        if "latents" in metadata:  # the metadata key of files an earlier version wrote, before this record
            raise refuse(where, "is absent: the file was written by an earlier version, whose record this one does "
                                "not read", rebuild)
        return None

    @classmethod
    def of_release(cls, meta: dict) -> "LatentSpace":
        """A release's space: "latent_shape", and "vae", "image_size", "scaling_factor", "class_names" if known."""
        shape, size = [int(n) for n in meta["latent_shape"]], int(meta.get("image_size") or 0)
        identity = {"latent_channels": shape[0], **({"source": meta["vae"]} if meta.get("vae") else {})}
        if size:
            identity["downsample_factor"] = size // shape[-1]
        norms = {}
        if meta.get("scaling_factor") is not None:  # both the tokenizer's own normalisation and what the DiT saw
            identity["scaling_factor"] = float(meta["scaling_factor"])
            norms["native"] = LatentNorm.scale_only(identity["scaling_factor"], "the VAE's scaling_factor")
            norms["dit"] = LatentNorm.scale_only(identity["scaling_factor"], "the release's scaling_factor")
        return cls(identity, shape, size, meta.get("class_names") or (), norms)

    # -- does a tokenizer fit? --------------------------------------------------------------------------------
    def recorded(self) -> dict:
        """What the space says of the tokenizer that made its latents (fields it records; its own norm object)."""
        recorded = dict(self.tokenizer)
        if self.native is not None or "class" in self.tokenizer:
            recorded["norm"] = self.native
        return recorded

    def check_tokenizer_config(self, spec: str, config_path, allow_other: bool = False,
                               measure: bool = True) -> tuple[str, int | None]:
        """Check a tokenizer from its config.json only -> (name, downsample factor); UserError when it cannot decode."""
        from shared.tokenizers.tokenizer import downsample_factor, latent_channels, tokenizer_class
        from shared.tokenizers.locate import read_vae_config, resolve_vae_spec

        name = resolve_vae_spec(spec, config_path)
        config = read_vae_config(spec, config_path)
        kind = tokenizer_class(config, name)
        # measure: the encoder run on the meta device; else declared channels (--watch-vae must not import diffusers)
        cheap = {"source": name, "class": kind.name, **({"family": kind.family} if kind.family != "vae" else {}),
                 "latent_channels": latent_channels(config) if measure else kind.declared_channels(config)}
        if measure:
            cheap["downsample_factor"] = downsample_factor(config)
        if "scaling_factor" in config:  # else diffusers' default fills it in at load time: compared then
            cheap["scaling_factor"] = float(config["scaling_factor"])
        compare_tokenizers(self.recorded(), cheap, allow_other)
        return name, cheap.get("downsample_factor")

    def check_loaded(self, tokenizer, allow_other: bool) -> tuple[LatentNorm, str | None]:
        """The full check once loaded (the hash needs diffusers' filled-in config) -> (norm to invert, note)."""
        note = compare_tokenizers(self.recorded(), {**tokenizer.identity, "norm": tokenizer.norm}, allow_other)
        norm, norm_note = self.decode_norm(tokenizer)
        return norm, "; ".join(n for n in (note, norm_note) if n) or None

    def decode_norm(self, tokenizer) -> tuple[LatentNorm, str | None]:
        """The normalisation to invert before decoding: the one the latents were trained with, else the tokenizer's."""
        trained = self.norm
        if trained is None:
            return tokenizer.norm, None
        trained.check_channels(tokenizer.latent_channels, f"the tokenizer {tokenizer.identity['source']}")
        if tokenizer.norm is None or trained == tokenizer.norm:  # no numbers of its own (an RAE without statistics)
            return trained, None
        return trained, (f"latents were normalised as {trained.describe()} in training, the tokenizer's own "
                         f"convention is {tokenizer.norm.describe()}; decoding inverts the training one")


def refuse(path, problem: str, rebuild: str) -> UserError:
    """The one paragraph for a damaged space record: the file, what is wrong, the command that rebuilds it."""
    return UserError(f"the latent-space record {path} {problem}. It says how the stored latents map to the "
                     f"tokenizer's (its identity and normalisation statistics), so nothing is trained, sampled or "
                     f"decoded from it, and nothing was changed. Rebuild it: {rebuild}.")


def rebuild_folder_command(folder) -> str:
    """How a latent folder's record is rebuilt: from its stored latents and the tokenizer that made them."""
    return (f"`python -m extract --stats --out {folder}` writes it again from the stored latents and the tokenizer "
            f"its index.json records (add --vae SPEC if that tokenizer is no longer where it was)")


# ---- Choosing, comparing and loading the tokenizer that decodes ----

def choose_tokenizer(spec: str | None, space: LatentSpace | None) -> tuple[str, str]:
    """(--vae or the recorded tokenizer or 'ema', how it was chosen)."""
    if spec:
        return spec, "from --vae"
    if space is not None and space.source:
        return space.source, "recorded in the latent metadata"
    return DEFAULT_TOKENIZER, "default (no --vae, none recorded)"


def compare_tokenizers(recorded: dict, actual: dict, allow_other: bool) -> str | None:
    """Refuse a tokenizer that differs from the recorded one (see the module doc); a note when a difference is allowed."""
    # RAE tokens decoded by a VAE, a VAE's latents by an RAE decoder: refused, no flag overrides it. The family is
    # "rae" or "vae" for an identity that names its class; None for one that names only its source.
    made, decoder = (identity.get("family", "vae") if "class" in identity else None for identity in (recorded, actual))
    if made is not None and decoder is not None and made != decoder:
        raise UserError(f"these latents are {FAMILY_WORDS[made]}, made by {recorded.get('source')} "
                        f"({recorded.get('class')}), but {actual.get('source')} is a {actual.get('class')}, whose "
                        f"decoder expects {FAMILY_WORDS[decoder]}: it would draw noise from them, so --allow-other-vae "
                        f"does not apply. Pass the --vae the latents were made with (drop --vae to use the recorded "
                        f"one).")
    named = f" ({recorded['source']})" if recorded.get("source") else ""  # when the metadata names the tokenizer
    if hard := _differences(recorded, actual, _HARD):
        raise UserError(f"the VAE {actual.get('source')} cannot decode these latents: {hard}. Decoding would fail "
                        f"or give images of the wrong size, so --allow-other-vae does not apply. Pass the --vae the "
                        f"latents were made with{named}.")
    if (soft := _differences(recorded, actual, _SOFT)) and not allow_other:
        raise UserError(f"the VAE {actual.get('source')} is not the one these latents were made with"
                        f"{named}: {soft}. Another VAE decodes them without any error into wrong "
                        f"colours or noise. Pass the --vae the latents were made with (drop --vae to use the "
                        f"recorded one), or add --allow-other-vae if the swap is deliberate.")
    if soft:
        return f"decoding with another VAE than the latents were made with, as --allow-other-vae asks ({soft})"
    if recorded.get("source") and actual.get("source") and recorded["source"] != actual["source"]:
        return (f"decoding with {actual['source']}, not {recorded['source']} recorded with the latents (same "
                f"channels, downsample factor{', scaling factor and config' if 'config_sha256' in actual else ''})")
    return None


def _differences(recorded: dict, actual: dict, fields) -> str:
    """'scaling factor 0.5 in this VAE, 0.18 for the latents; ...' for the fields both sides know and that differ."""
    return "; ".join(f"{words} {_short(actual[key])} in this VAE, {_short(recorded[key])} for the latents"
                     for key, words in fields
                     if key in recorded and key in actual and recorded[key] != actual[key])


def _short(value) -> str:
    """A normalisation as its phrase, a hash cut to 12 characters; other values as they are."""
    if isinstance(value, LatentNorm):
        return value.describe()
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return text[:12] if len(text) == 64 else text
