"""Which models this farm loads, for whom, and in exactly what form.

A model key is code. nnsight's ``Remotable.from_model_key`` imports the class
the key names and turns every JSON field of its suffix into a loader argument
(``cls(repo_id, revision=..., **rest)`` -> ``from_pretrained(**rest)``), so a
key the server accepted as sent could make a worker import a repo's own Python
(``trust_remote_code``) in the worker process, outside every jail, read a local
directory as a "repo", or pass any ``from_pretrained`` keyword; and every extra
field was a new deployment of the same repo (loads, evictions, downloads with
the operator's hub token). The per-request ``env`` is a loader too: ``peft``
names an adapter to fetch and attach, ``attn_implementation`` may name a hub
kernel repo to download and run.

So a key is *parsed* into the fields nnsight 0.8.1 really sends
(``HuggingFaceModel._remoteable_model_key`` + ``TransformersModel``'s task),
each checked for type and shape, and rebuilt as one canonical string; anything
else is refused naming the field. Who may load what is then the operator's
(``NDIF_MODELS``, ``NDIF_TRUST_REMOTE_CODE``). The web applies this at intake;
the controller and the worker apply it again before sizing and loading, so a
key that reaches the broker some other way is refused there too, and the
worker only ever loads the canonical key this module rebuilt.

Pure functions and no torch: the web imports it.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional

from ndif_celery.policy import client_versions, held_formats
from ndif_celery.wire import WireError, check_model_key, repo_fields

# The one class nnsight 0.8.1 keys its transformers models by: LanguageModel
# and VisionLanguageModel key themselves as TransformersModel (_remoteable_class).
TRANSFORMERS_MODEL = "nnsight.modeling.transformers.TransformersModel"
# nnsight's diffusers pipelines: keyed {repo_id, revision}, with no task.
DIFFUSION_MODEL = "nnsight.modeling.diffusion.DiffusionModel"
MODEL_CLASSES = (TRANSFORMERS_MODEL, DIFFUSION_MODEL)
# nnsight classes this farm has no workers for, each with what to use instead
# ({repo}: the repo the key names; a VLLM key's suffix is the bare repo id).
VLLM_MODEL = "nnsight.modeling.vllm.vllm.VLLM"
REFUSED_CLASSES = {
    VLLM_MODEL: ("This farm runs no vLLM workers, so nnsight's VLLM models are not served here. Load the same repo "
                 "as a LanguageModel (nnsight.LanguageModel({repo!r})): it traces the same weights through "
                 "transformers on this farm's workers."),
}
# The class the 0.6 and 0.7 clients key a language model by, with no task
# (``{"repo_id", "revision"}``): the farm's canonical key of the same model is
# a TransformersModel with the task LanguageModel loads.
LANGUAGE_MODEL = "nnsight.modeling.language.LanguageModel"
LANGUAGE_MODEL_TASK = "text-generation"

# The suffix fields the client sends, in the order it sends them.
KEY_FIELDS = ("repo_id", "revision", "trust_remote_code", "task")
# The field the farm adds (never a client): the nnsight runtime that serves
# the deployment, absent for the farm's own (``ModelKey.nnsight``).
RUNTIME_FIELD = "nnsight"
# The other field the farm adds: a quantized deployment's format (``ModelKey.held``).
# It is the loader's own keyword, so ``from_model_key`` loads the key as it reads.
HELD_FIELD = "dtype"
FARM_FIELDS = (RUNTIME_FIELD, HELD_FIELD)
ENV_FIELDS = ("attn_implementation", "peft")

# The hub's rules for a repo id: `name` or `owner/name`, each part of letters,
# digits, `-`, `_`, `.`, not starting or ending with `-`/`.`, no `--` or `..`,
# at most 96 characters in all (huggingface_hub.utils.validate_repo_id).
_HUB_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"^(?:{_HUB_PART}/)?{_HUB_PART}$")
MAX_REPO_ID_CHARS = 96
# A branch, tag, `refs/pr/N` or a commit sha, as git allows them (no `..`,
# `//`, `@{`, leading `-` or `/`, trailing `/`, `.` or `.lock`).
_REVISION = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._/-]*$")
MAX_REVISION_CHARS = 128
_RUNTIME = re.compile(r"\d+\.\d+\.\d+(?:[A-Za-z0-9.+-]{0,20})")

# transformers' pipeline tasks (transformers.pipelines.SUPPORTED_TASKS and
# TASK_ALIASES in 5.x; tests/unit/ndif_celery/policy/test_model_policy.py checks this list still covers
# the installed transformers), plus `translation_xx_to_yy`. A closed list keeps
# the task from multiplying one repo into unbounded deployments.
TASKS = frozenset({
    "any-to-any", "audio-classification", "automatic-speech-recognition", "decision", "depth-estimation",
    "document-question-answering", "feature-extraction", "fill-mask", "image-classification",
    "image-feature-extraction", "image-segmentation", "image-text-to-text", "keypoint-matching",
    "mask-generation", "object-detection", "table-question-answering", "text-classification",
    "text-generation", "text-to-audio", "token-classification", "video-classification",
    "zero-shot-audio-classification", "zero-shot-classification", "zero-shot-image-classification",
    "zero-shot-object-detection",
    # aliases and names older transformers knew
    "sentiment-analysis", "ner", "text-to-speech", "summarization", "translation", "text2text-generation",
    "question-answering", "image-to-text", "visual-question-answering", "image-to-image", "conversational",
})
_TRANSLATION = re.compile(r"^translation_[a-z]{2,3}_to_[a-z]{2,3}$")
# Tasks transformers 5 (the farm's) no longer loads, with what it says to use
# instead (its pipelines.REMOVED_TASKS; the policy's unit test keeps them equal).
# Refused at intake: nothing could load them.
REMOVED_TASKS = {
    "text2text-generation": "the text-generation pipeline with a chat model",
    "summarization": "the text-generation pipeline with a chat model",
    "translation": "the text-generation pipeline with a chat model",
    "question-answering": "the text-generation pipeline with a chat model",
    "visual-question-answering": "the image-text-to-text pipeline with a vision-language chat model",
    "vqa": "the image-text-to-text pipeline with a vision-language chat model",
    "image-to-image": "diffusers (nnsight's DiffusionModel) for image generation",
}
# What else serves an encoder-decoder the removed tasks loaded.
ENCODER_DECODER = ("An encoder-decoder such as T5 is served as 'feature-extraction': its encoder and decoder "
                   "trace, without generate.")
# Names transformers takes for one pipeline (its TASK_ALIASES): a key naming
# either is one model, kept under the canonical name.
TASK_ALIASES = {"sentiment-analysis": "text-classification", "ner": "token-classification",
                "text-to-speech": "text-to-audio"}
# What the hub loads for revision None; a key naming it is the key without it.
DEFAULT_BRANCH = "main"
COMMIT = re.compile(r"[0-9a-f]{40}")  # a commit sha, as the hub names one (fullmatch)

# Attention implementations transformers ships (ALL_ATTENTION_FUNCTIONS, plus
# eager, each also as `paged|<name>`). Never a hub kernel repo (`org/name`):
# transformers would download and run it.
ATTENTION = frozenset({"eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3",
                       "flash_attention_4"})


class PolicyError(WireError):
    """A key or env this farm will not load: 422 for a malformed field, 403 for
    one that is well formed but not allowed."""


@dataclass(frozen=True)
class ModelKey:
    """A model key reduced to what nnsight sends, every field checked."""

    cls: str
    repo_id: str
    revision: Optional[str]
    task: str
    trust_remote_code: bool = False
    nnsight: str = ""  # the runtime's nnsight version; "" for the farm's own
    held: str = ""  # a quantization's canonical name (nf4, int8, ...); "" for a float deployment

    @property
    def key(self) -> str:
        """The canonical key: byte for byte what nnsight 0.8.1's ``to_model_key``
        builds for this model (revision None for the default branch, a task
        by its canonical name), so the client's own key is usually canonical
        already. A runtime's deployment of the same model adds its version,
        a quantized one its format, last: another deployment, on another
        queue, loaded by its own workers."""
        suffix: dict = {"repo_id": self.repo_id, "revision": self.revision}
        if self.trust_remote_code:
            suffix["trust_remote_code"] = True
        if self.task:  # every class but DiffusionModel
            suffix["task"] = self.task
        if self.nnsight:
            suffix[RUNTIME_FIELD] = self.nnsight
        if self.held:
            suffix[HELD_FIELD] = self.held
        return f"{self.cls}:{json.dumps(suffix)}"

    @property
    def main_key(self) -> str:
        """The checkpoint as the farm's own nnsight keys it at full width (sizing, hub refs)."""
        return dataclasses.replace(self, nnsight="", held="").key


def parse(model_key: str) -> ModelKey:
    """Check ``model_key`` field by field; raise PolicyError (422) naming what is wrong.

    The strict reading of a key, at intake and before any load; ``wire.repo_fields``
    and ``wire.repo_id`` are the lenient one, for display of keys already queued."""
    try:
        check_model_key(model_key)  # shape, length, nnsight.modeling.* class
    except PolicyError:
        raise
    except WireError as error:
        raise PolicyError(error.detail, error.status) from None
    cls, _, suffix = model_key.partition(":")
    if cls in REFUSED_CLASSES:
        raise PolicyError(REFUSED_CLASSES[cls].format(repo=str(repo_fields(model_key)["repo_id"])[:100]), 403)
    if cls not in MODEL_CLASSES:
        raise PolicyError(f"Model class {cls!r} is not served here: this server builds {', '.join(MODEL_CLASSES)} "
                          "models (nnsight's TransformersModel, LanguageModel, VisionLanguageModel, DiffusionModel).")
    try:
        data = json.loads(suffix)
    except json.JSONDecodeError:
        raise PolicyError("The model_key's checkpoint part must be the JSON object nnsight builds "
                          '({"repo_id": ..., "revision": ..., "task": ...}).') from None
    if not isinstance(data, dict):
        raise PolicyError("The model_key's checkpoint part must be a JSON object, not "
                          f"{type(data).__name__}.")
    extra = sorted(set(data) - set(KEY_FIELDS) - set(FARM_FIELDS))
    if extra:
        raise PolicyError(f"Field {extra[0]!r} is not allowed in a model_key: it would reach the model loader. "
                          f"A model_key holds only {', '.join(KEY_FIELDS)} (as nnsight builds it).")
    if "repo_id" not in data:
        raise PolicyError("The model_key has no 'repo_id'.")
    repo_id = check_repo_id(data["repo_id"], "repo_id")
    revision = data.get("revision")
    if revision is not None:
        revision = check_revision(revision)
        if revision == DEFAULT_BRANCH:
            revision = None
    trust = data.get("trust_remote_code", False)
    if not isinstance(trust, bool):
        raise PolicyError("'trust_remote_code' in the model_key must be true or false.")
    if cls == DIFFUSION_MODEL:
        if "task" in data:
            raise PolicyError("A DiffusionModel's model_key has no 'task': its pipeline is the one the repo declares.")
        task = ""
    elif "task" not in data:
        raise PolicyError("The model_key has no 'task' (nnsight's TransformersModel always sends one).")
    else:
        task = TASK_ALIASES.get(check_task(data["task"]), data["task"])
    runtime = data.get(RUNTIME_FIELD, "")
    if runtime and not (isinstance(runtime, str) and _RUNTIME.fullmatch(runtime)):
        raise PolicyError(f"The model_key's {RUNTIME_FIELD!r} must be an nnsight version such as 0.7.0.")
    held = data.get(HELD_FIELD, "")
    if held and not (isinstance(held, str) and held_formats.canonical_quantization(held) == held):
        raise PolicyError(f"The model_key's {HELD_FIELD!r} must be a quantization by its canonical name "
                          f"({', '.join(held_formats.quantizations())}).")
    return ModelKey(cls=cls, repo_id=repo_id, revision=revision, task=task, trust_remote_code=trust,
                    nnsight=runtime, held=held)


def runtime_of(model_key: str) -> str:
    """The nnsight version that serves ``model_key``: its runtime's, or the farm's own
    (also for a key this module cannot read: one from before the policy, or none)."""
    try:
        return parse(model_key).nnsight or client_versions.MAIN
    except PolicyError:
        return client_versions.MAIN


def family_key(model_key: str) -> str:
    """A canonical key as its runtime's clients write it: a 0.6/0.7 runtime's as
    their ``LanguageModel:{repo_id, revision}`` (their ``nnsight.status()``
    reads it), any other as it is."""
    key = parse(model_key)
    if not key.nnsight or client_versions.protocol_of(key.nnsight) == "":
        return model_key
    return f"{LANGUAGE_MODEL}:{json.dumps({'repo_id': key.repo_id, 'revision': key.revision})}"


def parse_client_key(model_key: str, runtime: str = "") -> ModelKey:
    """A key as a client sent it, for the runtime that serves its nnsight
    (``runtime``; "" for the farm's own). The 0.6/0.7 clients key a language
    model as ``LanguageModel:{"repo_id", "revision"}``: read as the
    TransformersModel of its task. A client never names a runtime itself."""
    cls, _, suffix = model_key.partition(":")
    if runtime and cls == LANGUAGE_MODEL:
        try:
            data = json.loads(suffix)
        except json.JSONDecodeError:
            data = None
        if isinstance(data, dict) and "task" not in data:
            data["task"] = LANGUAGE_MODEL_TASK
            model_key = f"{TRANSFORMERS_MODEL}:{json.dumps(data)}"
    key = parse(model_key)
    if key.nnsight:
        raise PolicyError(f"Field {RUNTIME_FIELD!r} is not allowed in a model_key: the farm sets it from the "
                          "client's nnsight-version header.")
    if key.held:
        raise PolicyError(f"Field {HELD_FIELD!r} is not allowed in a model_key: a quantized deployment is asked "
                          "for by URL (remote=\"http://<this server>/dtype/nf4\").")
    return dataclasses.replace(key, nnsight=runtime)


def check_held(name: str) -> str:
    """The quantization a ``/dtype/<name>`` URL asks for, by its canonical name."""
    found = held_formats.canonical_quantization(name)
    if found is None:
        raise PolicyError(f"The URL asks for dtype {name[:40]!r}, which is not a quantization nnsight loads: use "
                          f"/dtype/ with one of {', '.join(held_formats.quantizations())}, or the server's own "
                          "URL for the model as deployed.", 404)
    return found


def check_repo_id(value: object, field: str) -> str:
    """A hub id, never a path: ``name`` or ``owner/name`` in the hub's characters,
    and nothing that exists as a local path (transformers would load that)."""
    if not isinstance(value, str):
        raise PolicyError(f"'{field}' must be a string (a Hugging Face hub id), not {type(value).__name__}.")
    shown = value[:120]
    if len(value) > MAX_REPO_ID_CHARS:
        raise PolicyError(f"'{field}' {shown!r} is too long for a hub id (at most {MAX_REPO_ID_CHARS} characters).")
    if value.startswith(("/", "~", ".")) or ".." in value or "\\" in value:
        raise PolicyError(f"'{field}' {shown!r} is a path; this server loads hub ids ('owner/name') only.")
    if not _HUB_ID.match(value) or "--" in value or value.endswith(".git"):
        raise PolicyError(f"'{field}' {shown!r} is not a Hugging Face hub id ('name' or 'owner/name': letters, "
                          "digits, '-', '_', '.'; no '--' or '..').")
    if os.path.lexists(value):
        raise PolicyError(f"'{field}' {value!r} names a local path on this server; hub ids only.")
    return value


def check_revision(value: object) -> str:
    if not isinstance(value, str):
        raise PolicyError(f"'revision' must be a string or null, not {type(value).__name__}.")
    bad = (
        not value or len(value) > MAX_REVISION_CHARS or not _REVISION.match(value)
        or ".." in value or "//" in value or "@{" in value or value.endswith(("/", ".", ".lock"))
    )
    if bad:
        raise PolicyError(f"'revision' {value[:140]!r} is not a git branch, tag or commit "
                          f"(at most {MAX_REVISION_CHARS} characters).")
    return value


def check_task(value: object) -> str:
    removed = "translation" if isinstance(value, str) and _TRANSLATION.match(value) else value
    if isinstance(removed, str) and removed in REMOVED_TASKS:
        extra = f" {ENCODER_DECODER}" if removed in ("text2text-generation", "summarization", "translation") else ""
        raise PolicyError(f"'task' {value!r} was removed in transformers 5, which this farm runs, so nothing here "
                          f"can load it: use {REMOVED_TASKS[removed]}.{extra}", 422)
    if not isinstance(value, str) or not (value in TASKS or _TRANSLATION.match(value)):
        shown = value[:80] if isinstance(value, str) else value
        raise PolicyError(f"'task' {shown!r} is not a transformers pipeline task this server knows "
                          "(e.g. 'text-generation').")
    return value


def check_env(env: dict) -> dict:
    """The request's ``env`` reduced to what nnsight's TransformersModel sends:
    ``attn_implementation`` (a name transformers ships, never a hub kernel repo)
    and ``peft`` (an adapter's hub id, never a path)."""
    extra = sorted(set(env) - set(ENV_FIELDS))
    if extra:
        raise PolicyError(f"Field {str(extra[0])[:80]!r} is not allowed in the request's env: "
                          f"only {', '.join(ENV_FIELDS)}.")
    clean: dict = {}
    if "attn_implementation" in env:  # null: an older client, the model keeps its own
        attn = env["attn_implementation"]
        base = attn.removeprefix("paged|") if isinstance(attn, str) else None
        if attn is not None and base not in ATTENTION:
            shown = attn[:80] if isinstance(attn, str) else type(attn).__name__
            raise PolicyError(f"'attn_implementation' {shown!r} is not one this server runs "
                              f"({', '.join(sorted(ATTENTION))}, or 'paged|' one of them).")
        clean["attn_implementation"] = attn
    peft = env.get("peft")
    if peft is not None:
        clean["peft"] = check_repo_id(peft, "peft")
    return clean


#: The libraries a diffusers pipeline's components may come from. Any other
#: "library" in its model_index.json is a Python module of the repo's own.
PIPELINE_LIBRARIES = ("diffusers", "transformers")
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,99}$")


def check_pipeline_index(index: object, repo_id: str) -> None:
    """A diffusers repo's ``model_index.json``, before the pipeline loads: every
    component from diffusers or transformers, never the repo's own code (refused
    as trust_remote_code is)."""
    if not isinstance(index, dict) or not isinstance(index.get("_class_name"), str) \
            or not _IDENTIFIER.match(index["_class_name"]):
        raise PolicyError(f"{repo_id!r} has no diffusers pipeline index (model_index.json with a _class_name).", 422)
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, list) or spec == [None, None]:
            continue  # metadata, a setting of the pipeline's (requires_safety_checker), or a component left out
        if not (len(spec) == 2 and all(isinstance(part, str) for part in spec) and _IDENTIFIER.match(spec[1])):
            raise PolicyError(f"{repo_id!r}: pipeline component {name[:60]!r} is not [library, class] as diffusers "
                              "writes it.", 422)
        if spec[0] not in PIPELINE_LIBRARIES:
            raise PolicyError(
                f"{repo_id!r}: pipeline component {name[:60]!r} comes from {spec[0][:60]!r}, code of the repo's own, "
                f"not {' or '.join(PIPELINE_LIBRARIES)}; this server does not run a repo's code (as trust_remote_code "
                "is refused).", 403)


def _patterns(raw: str) -> tuple:
    return tuple(p.strip() for p in raw.split(",") if p.strip())


def matches(repo_id: str, patterns: Iterable[str]) -> bool:
    """Whether a repo id matches one of the operator's fnmatch patterns (case-sensitive)."""
    return any(fnmatch.fnmatchcase(repo_id, pattern) for pattern in patterns)


# --- the same weights under other names -----------------------------------------------
#
# One repo's weights can be named by several keys: its default branch as None or
# "main" (one key after parse), a branch or tag, or the commit it points at. The
# commit a branch or tag points at is what the workers found in their model cache
# when they loaded the repo (``registry.refs``); the web has no cache to read.


def commit(key: ModelKey, refs: Mapping[str, str]) -> Optional[str]:
    """The commit ``key`` names: its revision when that is a commit sha, else
    the commit ``refs`` (the repo's branches and tags) give it; None when unknown."""
    revision = key.revision or DEFAULT_BRANCH
    return revision if COMMIT.fullmatch(revision) else refs.get(revision)


def same_weights(a: ModelKey, b: ModelKey, refs: Mapping[str, str]) -> bool:
    """Whether ``a`` and ``b`` are known to name one repo's same weights."""
    if a.repo_id != b.repo_id:
        return False
    if a.revision == b.revision:
        return True
    found = commit(a, refs)
    return found is not None and found == commit(b, refs)


def may_be_same_weights(a: ModelKey, b: ModelKey, refs: Mapping[str, str]) -> bool:
    """Whether ``a`` and ``b`` could name the same weights: one repo, and not
    two commits known to differ. What an access check must assume."""
    if a.repo_id != b.repo_id:
        return False
    if a.revision == b.revision:
        return True
    ours, theirs = commit(a, refs), commit(b, refs)
    return ours is None or theirs is None or ours == theirs


def same_model(a: ModelKey, b: ModelKey, refs: Mapping[str, str]) -> bool:
    """One deployment serves both: the same weights, loaded the same way."""
    return ((a.cls, a.task, a.trust_remote_code, a.nnsight, a.held) == (b.cls, b.task, b.trust_remote_code, b.nnsight,
                                                                         b.held)
            and same_weights(a, b, refs))


def quantized_only(key: ModelKey, same_repo: list[ModelKey], refs: Mapping[str, str]) -> Optional[ModelKey]:
    """The one quantized deployment of ``key``'s model, when the farm has no other
    (as NDIF, where the deployment decides how a model is held). PolicyError
    when there are several: the client must choose one by URL."""
    found = [other for other in same_repo
             if other.held and same_model(dataclasses.replace(key, held=other.held), other, refs)]
    if len(found) > 1:
        names = ", ".join(other.held for other in found)
        raise PolicyError(f"Model {key.repo_id!r} is deployed on this farm only quantized, as {names}. Choose one by "
                          f"the URL you send to: remote=\"http://<this server>/dtype/{found[0].held}\" "
                          "(or CONFIG.API.HOST).", 409)
    return found[0] if found else None


def keys_of_repo(keys: Iterable[str], repo_id: str) -> list[ModelKey]:
    """Those of ``keys`` (canonical: deployed, or wished by the operator) that
    name ``repo_id``, parsed; any that no longer parses is left out. Only the
    keys that name it by their text are parsed: intake asks on every request."""
    named = '{"repo_id": %s,' % json.dumps(repo_id)
    out = []
    for raw in sorted(keys):
        if named not in raw:
            continue
        try:
            key = parse(raw)
        except PolicyError:
            continue
        if key.repo_id == repo_id:
            out.append(key)
    return out


@dataclass(frozen=True)
class ModelPolicy:
    """The operator's rules (``NDIF_MODELS``, ``NDIF_TRUST_REMOTE_CODE``)."""

    models: tuple = ()  # empty: any hub id for trusted keys, deployed ones only for untrusted
    trust_remote_code: tuple = ()  # empty: no repo may run its own code

    @classmethod
    def from_settings(cls, settings) -> "ModelPolicy":
        return cls(models=_patterns(settings.models), trust_remote_code=_patterns(settings.trust_remote_code))

    def check_model(self, key: ModelKey) -> None:
        """What no key may do, trusted, untrusted or the operator's own: a repo
        outside a non-empty NDIF_MODELS, remote code outside NDIF_TRUST_REMOTE_CODE."""
        if self.models and not matches(key.repo_id, self.models):
            raise PolicyError(f"Model {key.repo_id!r} is not served here (this farm's NDIF_MODELS does not list it).",
                              403)
        if key.trust_remote_code and not matches(key.repo_id, self.trust_remote_code):
            raise PolicyError(
                f"trust_remote_code is refused for {key.repo_id!r}: this server runs a repo's own Python code only "
                "for repos its operator lists in NDIF_TRUST_REMOTE_CODE. Load the model without "
                "trust_remote_code=True, or ask the operator.", 403)

    def untrusted_may_deploy(self, key: ModelKey) -> bool:
        """An untrusted key may trigger a first deploy only of a repo NDIF_MODELS lists."""
        return bool(self.models) and matches(key.repo_id, self.models)

    def check_peft(self, env: dict) -> None:
        peft = env.get("peft")
        if peft and self.models and not matches(peft, self.models):
            raise PolicyError(f"PEFT adapter {peft!r} is not served here (this farm's NDIF_MODELS does not list it).",
                              403)

    def admit(self, model_key: str, env: dict, trusted: bool, offered: Iterable[str] = (),
              refs_of: Callable[[str], Mapping[str, str]] = lambda repo_id: {},
              runtime: str = "", held: str = "") -> tuple[str, dict]:
        """Intake: ``(canonical key, clean env)`` or PolicyError. ``offered`` is
        the keys deployed now or wished by the operator; a key naming the same
        weights as one of them, loaded the same way, is that one (one deployment,
        not a copy). ``refs_of(repo_id)`` gives a repo's branches and tags as
        the workers found them (``registry.refs``). An untrusted key uses what
        is offered; it deploys only a repo NDIF_MODELS lists and nothing offers yet.
        ``runtime``: the nnsight version of the runtime that serves the client
        ("" for the farm's own); its deployments are its own. ``held``: the
        quantization the request's URL asked for ("" for none): those
        deployments are their own too. A request that asks for none goes to
        the model's only quantized deployment when it has no other."""
        key = parse_client_key(model_key, runtime)
        if held and runtime:
            raise PolicyError(f"Quantized deployments serve nnsight {client_versions.MAIN} clients: nnsight {runtime} "
                              "loads no quantization by name. Send to the server's own URL.", 400)
        if held:
            key = dataclasses.replace(key, held=check_held(held))
        self.check_model(key)
        clean_env = check_env(env)
        self.check_peft(clean_env)
        same_repo = keys_of_repo(offered, key.repo_id)
        if same_repo:
            refs = refs_of(key.repo_id)
            for other in same_repo:
                if same_model(key, other, refs):
                    return other.key, clean_env
            if not held:
                only = quantized_only(key, same_repo, refs)
                if only is not None:
                    return only.key, clean_env
        runtime_said = f" for nnsight {key.nnsight}" if key.nnsight else ""
        if not trusted and not self.untrusted_may_deploy(key):
            raise PolicyError(
                f"Model {key.repo_id!r} (revision {key.revision!r}, task {key.task!r}) is not deployed on this farm"
                f"{runtime_said}, and untrusted keys cannot deploy new models. Use a model listed as deployed in "
                "/status, or ask the operator to deploy it (ndif-celery deploy) or list it in NDIF_MODELS.", 403)
        same_repo = [other for other in same_repo if other.nnsight == key.nnsight]  # each runtime's own
        if not trusted and same_repo:
            served = ", ".join(f"revision {other.revision!r} task {other.task!r}" for other in same_repo)
            raise PolicyError(
                f"Model {key.repo_id!r} is deployed on this farm as {served}; untrusted keys use a deployment as it "
                f"is and cannot deploy another revision or task of it (asked: revision {key.revision!r}, task "
                f"{key.task!r}). Ask the operator to deploy it (ndif-celery deploy).", 403)
        return key.key, clean_env

    def loadable(self, model_key: str) -> str:
        """Before sizing or loading (controller, worker): the canonical key to
        load, or PolicyError. A key that is not already canonical did not come
        through the web's intake: refused rather than re-interpreted."""
        key = parse(model_key)
        if key.key != model_key:
            raise PolicyError(f"Model key {model_key[:300]!r} is not in canonical form ({key.key!r}); not loaded.")
        self.check_model(key)
        return key.key


def is_model_snapshot(snapshot: "os.PathLike[str] | str") -> bool:
    """A cached snapshot that is a loadable model: a ``config.json`` naming a
    model type or architecture (a PEFT adapter has only ``adapter_config.json``)."""
    path = os.path.join(os.fspath(snapshot), "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("model_type") or config.get("architectures"))
