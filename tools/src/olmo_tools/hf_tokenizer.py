"""The tokenizer and generation config of an ``hf:`` export, so that transformers'
``AutoTokenizer.from_pretrained(DIR)`` and ``pipeline("text-generation", DIR)`` work on it.

The tokenizer comes from the first of these that applies:

1. ``--tokenizer FILE_OR_DIR``: a tokenizers ``tokenizer.json``, or a folder holding one (an HF
   tokenizer folder: its tokenizer_config.json, special_tokens_map.json and chat template are
   carried over, with the special tokens below written over theirs);
2. a trainer checkpoint or run dir (``torch:``/``jax:``): the ``tokenizer`` field of the mixture its
   recipe trained on (a path relative to the mixture file, as in the embedded sample);
3. an ``hf:`` source folder that holds a tokenizer.json.

A folder's own generation_config.json (sampling defaults) comes along too, with the ids below.

Otherwise the export has weights and config only, and olmo-convert says so on stderr.

One set of special-token ids goes into config.json, generation_config.json and the tokenizer:
eos is the mixture's ``eos_token_id`` when the tokenizer comes from the mixture (the id its
documents end with, which is what the model learnt), else the spec's; pad is the spec's
``pad_token_id``, or eos when the spec has none (batched generation needs one); bos is the spec's
(none for Olmo 3). The tokenizer must fit the model: no more tokens than the spec's
``vocab_size``, and a token at each of those ids. Everything is checked before anything is written.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from olmo_model import ModelSpec
from olmo_model.presets import spec_from_dict

from .checkpoint import Checkpoint, CheckpointError
from .formats import TOKENIZER_FILE

TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
GENERATION_CONFIG = "generation_config.json"
# Carried over verbatim from an HF tokenizer folder (its JSON configs are carried over edited).
CHAT_TEMPLATE = "chat_template.jinja"
_ROLES = {"eos_token": "eos_token_id", "pad_token": "pad_token_id", "bos_token": "bos_token_id"}


@dataclass(frozen=True)
class ExportTokenizer:
    """A tokenizer checked to fit the model, and the ids the export uses (in ``spec``)."""

    file: Path  # the tokenizer.json
    folder: Path | None  # the HF tokenizer folder it sits in, whose configs are carried over
    spec: ModelSpec  # the source's spec with the export's eos/pad/bos ids
    tokens: dict[str, str | None]  # eos_token/pad_token/bos_token -> the token's text

    def write(self, dst: Path) -> None:
        """tokenizer.json, tokenizer_config.json (+ special_tokens_map.json and the chat template
        when the source folder has them) and generation_config.json (the source folder's, if any,
        with the export's ids) into the export ``dst``."""
        shutil.copyfile(self.file, dst / TOKENIZER_FILE)
        config: dict[str, Any] = {
            # transformers' name for a tokenizer that is only a tokenizer.json; versions 4 and 5 read it.
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": self.spec.max_position_embeddings,
            "clean_up_tokenization_spaces": False,
        }
        if self.folder is not None:
            config = {**config, **_read_json(self.folder / TOKENIZER_CONFIG)}
            special = self.folder / SPECIAL_TOKENS_MAP
            if special.is_file():
                _write_json(dst / SPECIAL_TOKENS_MAP, {**_read_json(special), **self.tokens})
            if (self.folder / CHAT_TEMPLATE).is_file():
                shutil.copyfile(self.folder / CHAT_TEMPLATE, dst / CHAT_TEMPLATE)
        _write_json(dst / TOKENIZER_CONFIG, {**config, **self.tokens})
        # A source folder's generation settings (sampling defaults, ...) stay; the ids are the export's.
        generation = _read_json(self.folder / GENERATION_CONFIG) if self.folder is not None else {}
        ids = {field: getattr(self.spec, field) for field in _ROLES.values()}
        _write_json(dst / GENERATION_CONFIG, {**generation, **ids})


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file; {} when there is none."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err}); fix or remove it") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: holds a {type(data).__name__}, expected a JSON object; fix or remove it")
    return data


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _from_mixture(mixture: str, origin: str) -> tuple[Path | None, int, str]:
    """(the tokenizer the mixture names or None, its eos_token_id, the mixture file)."""
    from olmo_data import DataError, load_mixture

    try:
        loaded = load_mixture(mixture)
    except DataError as err:
        raise CheckpointError(
            f"{err}; olmo-convert reads the mixture {origin} trained on for its tokenizer: "
            "pass --tokenizer FILE_OR_DIR instead"
        ) from None
    named, eos = loaded.config.tokenizer, loaded.config.eos_token_id
    if named is None:
        return None, eos, str(loaded.path)
    if "://" in named:
        raise CheckpointError(
            f"{loaded.path}: field tokenizer is {named}, not a local path; copy it here and pass --tokenizer FILE"
        )
    path = Path(named)
    return (path if path.is_absolute() else loaded.root / path), eos, str(loaded.path)


def export_tokenizer(ckpt: Checkpoint, given: str | None) -> tuple[ExportTokenizer | None, str]:
    """The tokenizer to export with ``ckpt`` (``given``: --tokenizer), checked against its spec,
    or None and why there is none."""
    eos: int | None = None
    ids_from = ckpt.origin  # where the special-token ids come from, for a spec that rejects them
    if given is not None:
        path, named_by = Path(given), "--tokenizer"
    elif ckpt.mixture is not None:
        found, eos, mixture_file = _from_mixture(ckpt.mixture, ckpt.origin)
        if found is None:
            return None, f"the mixture {mixture_file} that {ckpt.origin} trained on names no tokenizer"
        path, named_by, ids_from = found, f"field tokenizer of {mixture_file}", mixture_file
    elif ckpt.tokenizer_dir is not None:
        path, named_by = ckpt.tokenizer_dir, ckpt.origin
    else:
        return None, f"{ckpt.origin} names no tokenizer"

    folder = path if path.is_dir() else None
    file = path / TOKENIZER_FILE if folder is not None else path
    if not file.is_file():
        what = f"{path} has no {TOKENIZER_FILE}" if folder is not None else f"{path} not found"
        raise CheckpointError(
            f"{what} (named by {named_by}); pass --tokenizer with a tokenizer.json or an HF tokenizer folder "
            "(a slow-only tokenizer: save it with transformers' AutoTokenizer.save_pretrained first)"
        )
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as err:  # tokenizers raises its Rust errors as plain Exception
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{file}: not a tokenizers tokenizer.json ({first}); pass another --tokenizer") from None

    size = tokenizer.get_vocab_size(with_added_tokens=True)
    spec = ckpt.spec
    if size > spec.vocab_size:
        raise CheckpointError(
            f"{file}: {size} tokens, more than the model's vocabulary (spec vocab_size {spec.vocab_size}); "
            "export with the tokenizer the model was trained with (--tokenizer FILE_OR_DIR)"
        )
    eos = spec.eos_token_id if eos is None else eos
    pad = spec.pad_token_id if spec.pad_token_id is not None else eos
    spec = spec_from_dict({**spec.model_dump(), "eos_token_id": eos, "pad_token_id": pad}, source=ids_from)
    tokens: dict[str, str | None] = {}
    for role, field in _ROLES.items():
        token_id = getattr(spec, field)
        token = None if token_id is None else tokenizer.id_to_token(token_id)
        if token_id is not None and token is None:
            raise CheckpointError(
                f"{file}: has no token with id {token_id}, the model's {field} ({size} tokens); "
                f"set {field} in the spec, or export with the tokenizer the model was trained with"
            )
        tokens[role] = token
    return ExportTokenizer(file, folder, spec, tokens), ""
