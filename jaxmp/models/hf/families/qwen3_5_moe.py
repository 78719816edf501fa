"""Qwen3.5-MoE multimodal (``Qwen3_5MoeForConditionalGeneration``): its ``text_config`` is a
``qwen3_5_moe_text`` config, read as one, and its text model (``model.language_model.``) is
loaded alone; the vision tower's tensors and the multi-token-prediction layers are skipped
with a warning. The export writes the text model (``qwen3_5_moe_text``).

transformers: ``models/qwen3_5_moe/configuration_qwen3_5_moe.py`` (``Qwen3_5MoeConfig``).
"""
from jaxmp._checks import BOOL, Choice
from jaxmp.models.hf.spec import COUNT, WRAPPER_SPECS, Field, Family

FAMILY = Family(
    "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration",
    "Qwen3.5-MoE multimodal: its text model alone (``text_config``; vision tensors skipped)",
    {}, {},
    specs={**WRAPPER_SPECS,
           "image_token_id": Field(COUNT, 248_056, null=None),
           "video_token_id": Field(COUNT, 248_057, null=None),
           "vision_start_token_id": Field(COUNT, 248_053, null=None),
           "vision_end_token_id": Field(COUNT, 248_054, null=None),
           "tie_word_embeddings": Field(Choice((False,), "false"), False, null=False,
                                        exact=True),
           "use_cache": Field(BOOL, True)},
    text_of="qwen3_5_moe_text",
    text_prefixes=(("model.language_model.", "lm_head.weight"),))
