"""Hugging Face checkpoints in and out: ``from_pretrained`` and ``save_pretrained``.

Reads and writes the directory layout of transformers' ``save_pretrained``: a
``config.json`` (``model_type``, ``architectures`` and the family's fields) and the
weights as ``model.safetensors`` or as shards ``model-0000i-of-0000n.safetensors`` with a
``model.safetensors.index.json`` (``weight_map``: tensor name -> file). Only ``json``
and ``safetensors`` are used: no torch, no transformers.

One concept a module:

==========================  ==============================================================
``families/``               one module per ``model_type``, each declaring its record
                            (:class:`~jaxmp.models.hf.spec.Family`); :data:`FAMILIES`
                            collects them (the README's family table lists them)
``spec``                    the record's language: :class:`~jaxmp.models.hf.spec.Field`
                            (type, range, transformers' default), the shared specs, the
                            one-line messages, :data:`IGNORED_FIELDS`
``config``                  ``config.json`` <-> ModelConfig through a family's record
                            (:func:`config_from_hf`, :func:`config_to_hf`, :func:`family_of`)
``files``                   the directory's files, checked before they are opened
``layout``                  which tensor each parameter comes from, and its layout
``load`` / ``save``         :func:`from_pretrained`, :func:`load_weights`,
                            :func:`check_weights` / :func:`save_pretrained`
==========================  ==============================================================

What the model computes is checked field by field: a ``config.json`` field the family does
not know, or a value jaxmp cannot represent exactly (a sliding window, an activation other
than SiLU, biases on the output projection, FP8-quantized weights, ...) is a one-line
``ValueError`` naming the field; nothing is approximated. Fields that only concern training
or generation in transformers (``initializer_range``, ``router_aux_loss_coef``, token ids,
``use_cache``, ...) are ignored (:data:`IGNORED_FIELDS`).

A checkpoint directory from outside is checked, not trusted; each fault is a one-line
``ValueError`` naming the file, field or tensor and what is allowed, raised before work
is lost:

* ``config.json``: each family's table of fields (:attr:`Family.specs`, one
  :class:`Field` each: type, range, default) requires the shape fields and those
  transformers has no default for, fills the others with transformers' default for that
  family (never jaxmp's), and refuses a null, an ill-typed value (an integer is not a
  bool, a real is finite) or one out of range; no number anywhere may be NaN or infinite.
  Two fields naming one value must agree (a top-level ``rope_theta`` and
  ``rope_parameters``' own, ``rope_scaling`` and ``rope_parameters``: transformers reads
  one of them), ``layer_types`` has one entry per layer, and MLA's
  ``num_key_value_heads`` is the head count.
* files (:mod:`~jaxmp.models.hf.files`): regular files only, an index naming plain file
  names inside the directory, readable safetensors files.
* tensors (:mod:`~jaxmp.models.hf.load`): every needed tensor and no other, each of the
  expected shape and a floating dtype (or blockwise FP8 with its scales, or GPT-OSS's
  MXFP4 experts, where ``quantization_config`` says so: read dequantized), checked from
  the headers before the model is built;
  a tied head equal to its embedding; every slice finite as read and in the parameter
  dtype.
* ``tokenizer_config.json``'s ``eos_token`` is null, a non-empty string or
  ``{"content": non-empty string}``, and a ``tokenizer.json`` that does not load is named.
"""
from jaxmp.models.hf.config import (RUNTIME_FIELDS, config_from_hf, config_to_hf, family_of,
                                    quantization, text_config)
from jaxmp.models.hf.families import FAMILIES
from jaxmp.models.hf.files import check_directory, read_config, tokenizer_eos
from jaxmp.models.hf.load import check_fp8_base, check_weights, from_pretrained, load_weights
from jaxmp.models.hf.save import MAX_SHARD_BYTES, save_pretrained
from jaxmp.models.hf.spec import IGNORED_FIELDS, Family, Field

__all__ = ["from_pretrained", "save_pretrained", "config_from_hf", "config_to_hf", "FAMILIES",
           "IGNORED_FIELDS", "MAX_SHARD_BYTES", "RUNTIME_FIELDS", "load_weights", "read_config",
           "family_of", "tokenizer_eos", "check_weights", "check_directory", "Family", "Field",
           "quantization", "text_config", "check_fp8_base"]
