"""Hugging Face causal LMs taken apart by structure, meta-device skeletons, safetensors import.

``decompose`` finds the pieces the streaming engine runs one after another: the body that holds
the decoder layers (its forward up to the first layer is the "prelude": token embedding, GPT-2's
position embedding, rotary tables, masks), the ModuleList of layers, the final norm and the
output head. It looks at the module tree, not at class names, so any model built the way Llama,
Qwen2, Mistral and GPT-2 are works.

``load_model`` builds the skeleton with every parameter on the meta device and streams the
weights into the store one tensor at a time: the whole model is never in RAM.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import tierstore.safetensors


class UnsupportedModelError(ValueError):
    """The model does not have the structure the streaming trainer needs."""


@dataclass(slots=True)
class ModelParts:
    """Where each piece of a causal LM sits, by qualified module and parameter name."""

    model: nn.Module
    body_name: str
    """The module whose forward runs embeddings then the layers (LlamaModel, GPT2Model)."""
    layers_name: str
    """The ModuleList of decoder layers, e.g. ``model.layers`` or ``transformer.h``."""
    norm_name: str
    """The final norm, e.g. ``model.norm`` or ``transformer.ln_f``."""
    head_name: str
    """The output projection, e.g. ``lm_head``."""
    tied: bool
    """True when the head's weight is the input embedding's weight (one store key, grads summed)."""
    prelude_params: list[str] = field(default_factory=list)
    """Full names of the body's parameters outside the layers and the norm (embeddings)."""
    layer_params: list[list[str]] = field(default_factory=list)
    """Full parameter names of each layer, in layer order."""
    norm_params: list[str] = field(default_factory=list)
    head_params: dict[str, str] = field(default_factory=dict)
    """The head's local parameter name -> full (store) name; the tied weight maps to the embedding."""

    @property
    def body(self) -> nn.Module:
        """The module that holds the layers."""
        return self.model.get_submodule(self.body_name)

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers."""
        return self.model.get_submodule(self.layers_name)  # type: ignore[return-value]

    @property
    def norm(self) -> nn.Module:
        """The final norm."""
        return self.model.get_submodule(self.norm_name)

    @property
    def head(self) -> nn.Module:
        """The output projection."""
        return self.model.get_submodule(self.head_name)

    def groups(self) -> list[tuple[str, list[str]]]:
        """Parameter groups in forward order: prelude, each layer, then norm + head."""
        out = [("prelude", list(self.prelude_params))]
        out += [(f"layer{i}", list(p)) for i, p in enumerate(self.layer_params)]
        tail = list(self.norm_params) + [v for v in self.head_params.values() if v not in self.prelude_params]
        out.append(("head", tail))
        return out

    def all_params(self) -> list[str]:
        """Every store key of the model's weights, each once, in forward order."""
        return [n for _, names in self.groups() for n in names]


def _n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _find_layers(model: nn.Module) -> str:
    best, best_n = None, -1
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        kinds = {type(c) for c in mod}
        n = _n_params(mod)
        if len(kinds) == 1 and n > best_n:
            best, best_n = name, n
    if best is None or best_n <= 0:
        raise UnsupportedModelError(
            f"{type(model).__name__}: no ModuleList of identical decoder layers with parameters was found"
        )
    return best


def _is_norm(mod: nn.Module) -> bool:
    return isinstance(mod, nn.LayerNorm) or "norm" in type(mod).__name__.lower()


def check_causal_lm(model: nn.Module) -> None:
    """Refuse a transformers model that is not a decoder-only causal LM (BERT, T5, ...), saying so."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        return  # not a transformers model: decompose judges its structure
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    causal = {n for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for n in ((v,) if isinstance(v, str) else v)}
    encoder = model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False)
    if getattr(config, "is_encoder_decoder", False) or encoder or type(model).__name__ not in causal:
        raise UnsupportedModelError(
            f"{type(model).__name__} ({model_type}) is not supported: only decoder-only causal LMs "
            "(AutoModelForCausalLM of the Llama, Qwen2, Mistral, GPT-2 families and alike) are supported")


def decompose(model: nn.Module) -> ModelParts:
    """Find body, layers, final norm, head and tied embeddings of a causal LM by its structure."""
    check_causal_lm(model)
    missing = []
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(emb, nn.Embedding):
        missing.append("an nn.Embedding returned by get_input_embeddings()")
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        missing.append("an output head with a weight returned by get_output_embeddings()")
    if missing:
        raise UnsupportedModelError(f"{type(model).__name__} is not a supported causal LM: missing {'; '.join(missing)}")
    layers_name = _find_layers(model)
    body_name = layers_name.rpartition(".")[0]
    body = model.get_submodule(body_name)
    names = {id(m): n for n, m in model.named_modules()}
    head_name = names[id(head)]
    emb_name = names[id(emb)]
    prefix = f"{body_name}." if body_name else ""
    if not emb_name.startswith(prefix):
        raise UnsupportedModelError(f"the input embedding {emb_name!r} is not inside the layers' parent {body_name!r}")
    # The final norm: the body's direct child with parameters that is neither an embedding nor the layers.
    norms = [
        (n, c) for n, c in body.named_children()
        if _n_params(c) > 0 and not isinstance(c, nn.Embedding) and c is not model.get_submodule(layers_name)
    ]
    if len(norms) != 1 or not _is_norm(norms[0][1]):
        found = ", ".join(f"{n} ({type(c).__name__})" for n, c in norms) or "none"
        raise UnsupportedModelError(
            f"{type(model).__name__}: expected exactly one final norm beside the embeddings and layers "
            f"in {body_name!r}; found {found}"
        )
    norm_name = prefix + norms[0][0]
    tied = head.weight is emb.weight
    full = {id(p): n for n, p in model.named_parameters()}
    parts = ModelParts(model, body_name, layers_name, norm_name, head_name, tied)
    for n, _p in model.named_parameters():
        if n.startswith(layers_name + ".") or n.startswith(norm_name + ".") or n.startswith(head_name + "."):
            continue
        if not n.startswith(prefix):
            raise UnsupportedModelError(f"parameter {n!r} is outside the body {body_name!r} and the head {head_name!r}")
        parts.prelude_params.append(n)
    for i, layer in enumerate(parts.layers):
        parts.layer_params.append([f"{layers_name}.{i}.{ln}" for ln, _ in layer.named_parameters()])
    parts.norm_params = [f"{norm_name}.{ln}" for ln, _ in parts.norm.named_parameters()]
    for ln, p in head.named_parameters(remove_duplicate=False):
        parts.head_params[ln] = full[id(p)]
    if tied and parts.head_params.get("weight") not in parts.prelude_params:
        raise UnsupportedModelError("the tied head weight is not one of the body's embedding parameters")
    return parts


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Create modules with parameters on the meta device and buffers (rotary tables) on the CPU."""
    orig = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        orig(self, name, param)
        if param is not None and param.device.type != "meta":
            p = self._parameters[name]
            self._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = orig  # type: ignore[method-assign]


def to_meta_(model: nn.Module) -> None:
    """Replace every parameter by a meta tensor of the same shape (ties kept); buffers stay."""
    seen: dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in seen:
                seen[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            mod._parameters[name] = seen[id(p)]


def bind_weights_(model: nn.Module, get: Any) -> None:
    """Give every meta parameter real weights ``get(name)`` (ties kept): the inverse of ``to_meta_``."""
    names = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    made: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for mod in model.modules():
            for local, p in list(mod._parameters.items()):
                if p is None:
                    continue
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(get(names[id(p)]).to(torch.float32).contiguous(),
                                               requires_grad=p.requires_grad)
                mod._parameters[local] = made[id(p)]


def guard_meta(model: nn.Module, where: str) -> Any:
    """A forward pre-hook that makes calling a meta skeleton say where its weights are; returns its handle."""

    def refuse(_mod: nn.Module, _args: Any) -> None:
        raise RuntimeError(f"this model is a meta-device skeleton: its weights live in the store at {where}. "
                           "Use trainer.save_model(DIR) and AutoModelForCausalLM.from_pretrained(DIR), "
                           "trainer.evaluate(), or `tierstore export STORE DIR --format hf`")

    return model.register_forward_pre_hook(refuse)


def read_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from a safetensors file one tensor at a time, in file order.

    The header is validated by tierstore's parser (the one ``tierstore import`` uses) and the
    bytes are read with plain preads, not mmap: touched mmap pages count in the RSS.
    """
    header = tierstore.safetensors.read_header(path)
    with open(path, "rb") as f:
        for entry in sorted(header.tensors, key=lambda e: e.start):
            yield entry.name, tierstore.safetensors.read_tensor(f.fileno(), entry)


def safetensors_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint: a file, a folder with one, or a sharded folder."""
    if os.path.isfile(path):
        return [path]
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, s) for s in shards]
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    return []


def _skeleton(config: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with params_on_meta():
        model = AutoModelForCausalLM.from_config(config)
    model.train()
    return model


def _init_into_store(model: nn.Module, store: Any, codec: str) -> None:
    # One module's parameters at a time: materialize on the CPU, run the model's own init, store.
    init = getattr(model, "_init_weights", None)
    full = {id(p): n for n, p in model.named_parameters()}
    done: set[int] = set()
    for mod in model.modules():
        own = [(n, p) for n, p in mod._parameters.items() if p is not None and id(p) not in done]
        if not own:
            continue
        metas = dict(own)
        for n, p in own:
            mod._parameters[n] = nn.Parameter(torch.empty(p.shape, dtype=torch.float32), requires_grad=p.requires_grad)
        if init is not None:
            init(mod)
        elif hasattr(mod, "reset_parameters"):
            mod.reset_parameters()
        with torch.no_grad():
            for n, p in own:
                store.put(full[id(p)], mod._parameters[n].detach().float().contiguous(), codec=codec)
                done.add(id(p))
                mod._parameters[n] = metas[n]


def _config_and_files(path_or_config: Any) -> tuple[Any, list[str]]:
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(path_or_config, PretrainedConfig):
        config, files = path_or_config, []
    elif isinstance(path_or_config, (str, os.PathLike)):
        path = os.fspath(path_or_config)
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        config = AutoConfig.from_pretrained(folder)
        files = safetensors_files(path)
        if not files:
            raise FileNotFoundError(f"{path}: no model.safetensors, model.safetensors.index.json or .safetensors file")
    else:
        raise TypeError(f"load_model takes a checkpoint path or a transformers config, got {type(path_or_config).__name__}")
    return config, files


def skeleton_for(path_or_config: Any) -> nn.Module:
    """The meta-device skeleton of a checkpoint folder or config, without reading any weights."""
    return _skeleton(_config_and_files(path_or_config)[0])


def load_model(path_or_config: Any, store: Any, codec: str = "raw") -> nn.Module:
    """A meta-device skeleton whose fp32 weights were streamed into ``store`` one tensor at a time."""
    config, files = _config_and_files(path_or_config)
    model = _skeleton(config)
    parts = decompose(model)
    if not files:
        _init_into_store(model, store, codec)
        return model
    wanted = set(parts.all_params())
    tied_head = f"{parts.head_name}.weight" if parts.tied else None
    for file in files:
        for name, tensor in read_safetensors(file):
            if name == tied_head:
                continue  # the tied head shares the embedding's key
            if name not in wanted:
                continue  # persistent buffers and unused tensors of old checkpoints
            store.put(name, tensor.to(torch.float32).contiguous(), codec=codec)
            wanted.discard(name)
            del tensor
    if wanted:
        raise ValueError(f"checkpoint {path_or_config} lacks {len(wanted)} parameters, e.g. {sorted(wanted)[:3]}")
    return model
