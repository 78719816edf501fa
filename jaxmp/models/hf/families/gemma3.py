"""Gemma 3 multimodal (4B, 12B, 27B): its ``text_config`` is a ``gemma3_text`` config, read
as one, and its text model is loaded alone: the vision tower's and projector's tensors are
skipped with a warning. The export writes the text model (``gemma3_text``,
``Gemma3ForCausalLM``).

transformers: ``models/gemma3/configuration_gemma3.py`` (``Gemma3Config``); tensors under
``language_model.model.`` as released, or ``model.language_model.`` as transformers 5
saves them.
"""
from jaxmp._checks import Choice
from jaxmp.models.hf.spec import COUNT, WRAPPER_SPECS, Field, Family

FAMILY = Family(
    "gemma3", "Gemma3ForConditionalGeneration",
    "Gemma 3 multimodal: its text model alone (``text_config``; vision tensors skipped)",
    {}, {},
    specs={**WRAPPER_SPECS,
           "mm_tokens_per_image": Field(COUNT, 256, null=None),
           "boi_token_index": Field(COUNT, 255_999, null=None),
           "eoi_token_index": Field(COUNT, 256_000, null=None),
           "image_token_index": Field(COUNT, 262_144, null=None),
           "tie_word_embeddings": Field(Choice((True,), "true"), True, null=True, exact=True)},
    text_of="gemma3_text",
    text_prefixes=(("language_model.model.", "language_model.lm_head.weight"),
                   ("model.language_model.", "lm_head.weight")))
