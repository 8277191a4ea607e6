"""What a request can change on a shared model, and what a later request reads back.

``change_everything`` is a user's block that changes what it can reach: the
generation config, the config, the tokenizer and its native backend, a
module's attribute and hooks, an envoy's slot. ``read_back`` is a later
user's block that reads all of it (``what_a_user_reads``) and walks the rest.

``readable_state(model)`` walks the nnsight model (of 0.6/0.7 or 0.8): every
module's attributes, the configs they hold, the generation config, the
tokenizer (its backend in full: padding, truncation, added tokens, vocabulary),
the processor and pipeline where there are some, every envoy's slots. Tensors
are shown by shape and dtype (their values are the weight checks'), nnsight's
runtime objects and functions by their type, hook tables by their size.

They run inside remote blocks, so each is written self-contained (imports
inside it): the 0.8.1 client ships them by value (``nnsight.register``), and
an older client's script carries their source (``SOURCE``, the same code:
0.6/0.7 write a block alike).
"""

from __future__ import annotations

import inspect

import nnsight

from tests.support.cases.tiny_model import PROMPT

# What change_everything sets, each unlike the tiny model as loaded.
CHANGED = {"max_new_tokens": 3, "do_sample": True, "temperature": 0.25, "use_cache": False,
           "padding_side": "right", "truncation_side": "left", "pad_token": "[PAD]", "model_max_length": 7,
           "chat_template": "{{ messages }}", "truncation": 5, "padding": 9, "scale_attn_weights": False}


def change_everything(model):
    """A user's block that changes what it can reach on the model; what it then read, and which model it ran on."""
    with model.trace(PROMPT, remote=True):
        module, tokenizer = model._module, model.tokenizer
        module.generation_config.max_new_tokens = 3
        module.generation_config.do_sample = True
        module.generation_config.temperature = 0.25
        module.config.use_cache = False
        module.config.id2label[5] = "five"
        tokenizer.padding_side = "right"
        tokenizer.truncation_side = "left"
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
        tokenizer.add_tokens(["<residue>"])
        tokenizer.model_max_length = 7
        tokenizer.chat_template = "{{ messages }}"
        tokenizer.init_kwargs["model_max_length"] = 7
        tokenizer._tokenizer.enable_truncation(5)
        tokenizer._tokenizer.enable_padding(length=9)
        module.transformer.h[0].attn.scale_attn_weights = False
        module.transformer.h[1].register_forward_hook(lambda *args: None)
        vars(model.transformer)["note"] = "left by the first user"
        seen = nnsight.save(what_a_user_reads(model))
        where = nnsight.save(id(model._module))
    return {"seen": seen, "model": where}


def read_back(model):
    """A later user's block: what it reads, everything readable, and which model it ran on."""
    with model.trace(PROMPT, remote=True):
        seen = nnsight.save(what_a_user_reads(model))
        state = nnsight.save(readable_state(model))
        where = nnsight.save(id(model._module))
    return {"seen": seen, "state": state, "model": where}


def what_a_user_reads(model):
    """The values change_everything sets, as a later user reads them."""
    module, tokenizer = model._module, model.tokenizer
    generation, backend = module.generation_config, tokenizer._tokenizer
    return {
        "max_new_tokens": generation.max_new_tokens, "do_sample": generation.do_sample,
        "temperature": generation.temperature, "use_cache": module.config.use_cache,
        "id2label": {str(k): v for k, v in module.config.id2label.items()}, "padding_side": tokenizer.padding_side,
        "truncation_side": tokenizer.truncation_side, "pad_token": tokenizer.pad_token,
        "model_max_length": tokenizer.model_max_length, "chat_template": tokenizer.chat_template,
        "init_model_max_length": tokenizer.init_kwargs.get("model_max_length"), "vocab": len(tokenizer),
        "truncation": (backend.truncation or {}).get("max_length"), "padding": (backend.padding or {}).get("length"),
        "scale_attn_weights": module.transformer.h[0].attn.scale_attn_weights,
        "hooks": len(module.transformer.h[1]._forward_hooks), "note": vars(model.transformer).get("note"),
    }


def readable_state(model):
    """Everything but tensor values a later user can read off ``model``, as JSON-able data."""
    import json

    import torch

    seen: dict = {}  # id of a library object already shown -> where
    per_process = ("_original_object_hash",)  # a hash of an object's identity: never the same in two loads

    def native(value, where):
        if hasattr(value, "to_str"):  # a tokenizers.Tokenizer: its whole state
            return json.loads(value.to_str())
        names = [n for n in dir(type(value)) if not n.startswith("_")
                 and type(getattr(type(value), n, None)).__name__ == "getset_descriptor"]
        if not names:
            return str(value)
        return {"<type>": type(value).__name__, **{n: plain(getattr(value, n), f"{where}.{n}") for n in names}}

    def plain(value, where, depth=0):
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, (torch.dtype, torch.device)):
            return str(value)
        if isinstance(value, torch.Tensor):
            return f"<tensor {tuple(value.shape)} {value.dtype}>"
        if isinstance(value, torch.nn.Module):
            return f"<module {type(value).__name__}>"  # each module is walked on its own
        if isinstance(value, dict):
            return {repr(key): plain(item, f"{where}[{key!r}]", depth + 1) for key, item in value.items()}
        if isinstance(value, (set, frozenset)):
            return sorted(repr(plain(item, where, depth + 1)) for item in value)
        if isinstance(value, (list, tuple)):
            return [plain(item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value)]
        library = type(value).__module__.split(".")[0]
        if library not in ("transformers", "tokenizers") or depth > 8:
            return f"<{type(value).__name__}>"
        if id(value) in seen:  # one object held in two places is shown once
            return f"<{type(value).__name__} as at {seen[id(value)]}>"
        seen[id(value)] = where
        if library == "tokenizers":
            return native(value, where)
        if not isinstance(getattr(value, "__dict__", None), dict):
            return f"<{type(value).__name__}>"
        return {"<type>": type(value).__name__,
                **{key: plain(item, f"{where}.{key}", depth + 1) for key, item in vars(value).items()
                   if key not in per_process}}

    def module_slots(name, module):
        slots = {}
        for key, value in vars(module).items():
            if key in ("_parameters", "_buffers", "_modules"):
                slots[key] = sorted(value)
            elif "hooks" in key and isinstance(value, dict):  # by count: their keys are handle ids
                slots[key] = len(value)
            else:
                slots[key] = plain(value, f"{name}.{key}")
        return slots

    state = {"modules": {name or "<root>": module_slots(name or "model", module)  # first: they own the configs
                         for name, module in model._module.named_modules()}}
    state["generation_config"] = plain(getattr(model._module, "generation_config", None), "generation_config")
    for name in ("config", "tokenizer", "processor", "image_processor", "feature_extractor", "pipeline"):
        value = vars(model).get(name)
        if value is not None:
            state[name] = plain(value, name)
    state["envoys"] = {getattr(envoy, "path", "") or "<root>": {key: plain(value, f"envoy.{key}")
                                                               for key, value in vars(envoy).items()
                                                               if not key.startswith("_ndif")}  # the farm's own
                       for envoy in model.modules()}
    return json.loads(json.dumps(state, default=repr))


def differences(expected, found, path="", limit=20) -> list:
    """Where two readable states differ (the first ``limit``), each as a sentence."""
    out: list = []

    def walk(a, b, where):
        if len(out) >= limit:
            return
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                if key not in b:
                    out.append(f"{where}.{key}: gone (was {a[key]!r:.80})")
                elif key not in a:
                    out.append(f"{where}.{key}: new ({b[key]!r:.80})")
                else:
                    walk(a[key], b[key], f"{where}.{key}")
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for index, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{where}[{index}]")
        elif a != b:
            out.append(f"{where}: {a!r:.80} became {b!r:.80}")

    walk(expected, found, path)
    return out


#: The blocks' and the walk's source, for a script of an older client to define them (PROMPT its own).
SOURCE = "\n\n".join(inspect.getsource(f) for f in (change_everything, read_back, what_a_user_reads, readable_state))
