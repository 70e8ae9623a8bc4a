"""The model floor: the Qwen2.5-VL subclass and its chunked loss, the processor, the tiny default.

Light modules (``paths``, ``processor``, ``tiny``, ``loss``) never import transformers' modeling
code, so the launcher and the data checks can use them; ``qwen2_5_vl`` and ``registry`` do.
"""
